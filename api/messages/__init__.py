"""/v1/messages, Anthropic's Messages API, as a thin translation onto the chat machinery.

request.py   an Anthropic body -> the chat body it means (system, blocks, tools, tool_choice, thinking)
output.py    a chat choice -> the Message object, its event stream, and Anthropic's error body
handler.py   POST /v1/messages and /v1/messages/count_tokens; add_routes(app)
"""

from pagedserve.api.messages.handler import add_routes, is_messages_path
from pagedserve.api.messages.output import error_response

__all__ = ["add_routes", "error_response", "is_messages_path"]
