"""Tool calls with no flags (issue 39): the server reads the checkpoint's chat template, picks the parser of
the format it writes (api/tool_parsers/detect.py), and tool_choice `auto` works through the openai client;
--tool-call-parser without --enable-auto-tool-choice is still vLLM's 400, and a template that renders no
tools gets no parser."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pagedserve.api.tool_parsers.detect import detect_tool_parser
from pagedserve.common.config import ApiConfig
from tests.api.chat_templates import TEMPLATES, checkpoint_with_template
from tests.api.harness import ApiServer
from tests.api.test_tool_calls import CALLS, MESSAGES, TOOLS, ToolServer, assert_calls, expected_content
from tests.api.test_tool_parsers import FORMATS as JSON_FORMATS
from tests.api.test_tool_parsers_more import FORMATS as MORE_FORMATS

FORMATS = {**JSON_FORMATS, **MORE_FORMATS}
# Templates in the style of Qwen3-Coder's and gpt-oss's (the markers and layout of the real ones)
QWEN3_CODER = """\
{%- if tools %}<|im_start|>system
You have access to the following functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
If you choose to call a function reply in the following format:
<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls %}
<tool_call>
<function={{ call.function.name }}>
{%- for key, value in call.function.arguments.items() %}
<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{%- endfor %}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
HARMONY = """\
{%- if tools %}<|start|>developer<|message|># Tools
namespace functions {
{%- for tool in tools %}
type {{ tool.function.name }} = (_: {{ (tool.function.parameters or {}) | tojson }}) => any;
{%- endfor %}
}<|end|>{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- for call in message.tool_calls %}<|start|>assistant to=functions.{{ call.function.name }}\
<|channel|>commentary json<|message|>{{ call.function.arguments | tojson }}<|call|>
{%- endfor %}
{%- elif message.role == 'tool' %}<|start|>functions to=assistant<|channel|>commentary<|message|>\
{{ message.content | tojson }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
SERVED_TEMPLATES = {**TEMPLATES, "qwen3_coder": QWEN3_CODER, "openai": HARMONY}

# The lines of each family's real chat template that carry its markers (the checkpoints' own templates)
REAL_TEMPLATE_LINES = {
    "qwen3_coder": "{%- if tools %}<tools>{%- for tool in tools %}<function>\n<name>{{ tool.name }}</name>"
    "{%- endfor %}</tools>\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    "\nvalue_1\n</parameter>\n</function>\n</tool_call>{%- endif %}",
    "glm45": "{%- if tools -%}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>"
    "{%- endif %}",
    "kimi_k2": "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}{%- endif %}"
    "<|tool_calls_section_begin|><|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>"
    "{{ tool_call['function']['arguments'] }}<|tool_call_end|><|tool_calls_section_end|>",
    "deepseek_v31": "{% if tools %}{{ tools }}{% endif %}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    "{{ tool['function']['name'] }}<｜tool▁sep｜>{{ tool['function']['arguments'] }}<｜tool▁call▁end｜>",
    "openai": "{%- if tools -%}namespace functions {{ tools }}{%- endif -%}<|start|>assistant<|channel|>"
    "commentary to=functions.{{ name }} <|constrain|>json<|message|>{{ args }}<|call|>",
}


def test_each_familys_template_is_recognised() -> None:
    for name, template in {**REAL_TEMPLATE_LINES, **SERVED_TEMPLATES}.items():
        assert detect_tool_parser(template) == name, name
    # DeepSeek V3's older form, and templates that never render tools, get no parser
    assert detect_tool_parser("{{ tools }}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ name }}") == ""
    v3 = "{{ tools }}<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n'"
    assert detect_tool_parser(v3) == ""
    assert detect_tool_parser("{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}") == ""
    assert detect_tool_parser("{{ tools }} plain text") == ""


@pytest.fixture(scope="module", params=sorted(SERVED_TEMPLATES))
def detected_server(request: Any, tiny_model_dir: Path, tmp_path_factory: Any) -> Iterator[ToolServer]:
    from transformers import AutoTokenizer

    fmt = request.param
    template = SERVED_TEMPLATES[fmt]
    root = checkpoint_with_template(tiny_model_dir, tmp_path_factory.mktemp(fmt) / "ckpt", template)
    server = ApiServer(str(root), ApiConfig(), max_model_len=2048, num_kv_blocks=1024)  # no tool flags
    yield ToolServer(fmt, server, AutoTokenizer.from_pretrained(str(root)))
    server.close()


def test_auto_tool_calls_with_no_flags(detected_server: ToolServer) -> None:
    fmt = detected_server.fmt
    detected_server.script(FORMATS[fmt](expected_content(fmt) or "", CALLS, False))
    request = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=400)
    [choice] = detected_server.client.chat.completions.create(**request).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == expected_content(fmt)
    assert_calls(choice.message.tool_calls, fmt)
    params = detected_server.server.fake.submits()[-1].params
    assert params.skip_special_tokens is (fmt == "llama3_json")  # the detected parser reads its markers
    with detected_server.client.chat.completions.stream(**request) as stream:
        [choice] = stream.get_final_completion().choices
    assert choice.finish_reason == "tool_calls" and (choice.message.content or None) == expected_content(fmt)
    assert_calls(choice.message.tool_calls, fmt)


def test_the_calls_come_back_through_the_template(detected_server: ToolServer) -> None:
    """The round trip: the client sends the calls back with their results, and the template renders them."""
    fmt = detected_server.fmt
    detected_server.script(FORMATS[fmt]("", CALLS, False))
    first = detected_server.client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=400
    )
    calls = first.choices[0].message.tool_calls or []
    assert len(calls) == len(CALLS)
    results = [{"role": "tool", "tool_call_id": c.id, "content": f"result {i}"} for i, c in enumerate(calls)]
    detected_server.script("It is sunny.")
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    final = detected_server.client.chat.completions.create(
        model="tiny-llama", messages=[*MESSAGES, assistant, *results], tools=TOOLS, max_tokens=50
    )
    assert final.choices[0].message.content == "It is sunny." and final.choices[0].finish_reason == "stop"
    prompt = detected_server.tokenizer.decode(detected_server.server.fake.submits()[-1].prompt_token_ids)
    assert "get_weather" in prompt and "result 1" in prompt


def test_a_parser_flag_without_enable_is_still_vllms_400(tiny_model_dir: Path, tmp_path: Path) -> None:
    root = checkpoint_with_template(tiny_model_dir, tmp_path / "ckpt", TEMPLATES["hermes"])
    server = ApiServer(str(root), ApiConfig(tool_call_parser="hermes"), max_model_len=2048, num_kv_blocks=64)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=4)
        assert "--enable-auto-tool-choice" in e.value.body["message"]
    finally:
        server.close()
