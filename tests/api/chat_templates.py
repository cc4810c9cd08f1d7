"""Chat templates in the styles of the model families whose tool formats the api parses, written here for
the tests (each renders tools, assistant tool calls and tool results the way its family's does), and the
tiny checkpoint's tokenizer saved with one of them into a directory of its own."""

from __future__ import annotations

import shutil
from pathlib import Path

HERMES = """\
{%- if tools %}<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{%- elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
<|im_start|>assistant
{%- if message.reasoning_content %}
<think>{{ message.reasoning_content }}</think>
{%- endif %}
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{%- elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{%- else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{%- if enable_thinking is defined and not enable_thinking %}
<think>

</think>
{%- else %}
<think>
{%- endif %}
{%- endif %}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

You may call these functions:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Answer with {"name": function name, "parameters": arguments}.<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""

MISTRAL = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][
{%- for call in message.tool_calls %}
{%- if call.id is not defined or call.id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, \
"id": "{{ call.id }}"}{{ ', ' if not loop.last }}
{%- endfor %}]{{ eos_token }}
{%- elif message.role == 'assistant' %}{{ message.content }}{% if not loop.last %}{{ eos_token }}{% endif %}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.role == 'system' %}{{ message.content }}

{% endif %}
{%- endfor %}
"""

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL}


def checkpoint_with_template(model_dir: Path, out_dir: Path, template: str) -> Path:
    """A copy of the tiny checkpoint whose tokenizer carries `template` as its chat template."""
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
