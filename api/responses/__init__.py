"""/v1/responses, OpenAI's Responses API, as a thin translation onto the chat machinery.

request.py   a Responses body -> the chat body it means (input items, instructions, tools, text.format)
output.py    a chat choice -> the Response object, and its event stream (sequence-numbered)
store.py     responses kept for previous_response_id: bounded in count, age and characters, per API key
handler.py   POST /v1/responses; add_routes(app)
"""

from pagedserve.api.responses.handler import add_routes

__all__ = ["add_routes"]
