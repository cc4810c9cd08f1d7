"""JSON constraints are compact unless the request allows free whitespace (issue 39, vLLM #38696): a request's
`response_format` as the api parses it (api/structured_fields.py), run through the real scheduler core and
the CPU model runner on the tiny random model at temperature 1. With free whitespace such a model draws
spaces, tabs and newlines until max_tokens; compact, every output ends (EOS) well before it and validates
with `jsonschema`. (json_object is tested on its grammar only: its free-form strings have no length bound,
so a random model's outputs need not end.)"""

from __future__ import annotations

import json
import random

import jsonschema
import xgrammar as xgr
from transformers import AutoTokenizer

from pagedserve.api.structured_fields import parse_structured
from pagedserve.common.config import WorkerConfig
from pagedserve.common.grammars import compile_grammar
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from tests.engine_loop import run_engine

MAX_TOKENS = 200
SMALL_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    },
    {
        "type": "object",
        "properties": {"v": {"type": "number", "minimum": 0, "maximum": 9}},
        "required": ["v"],
    },
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "null"}}}}},
]


def _response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def test_response_format_outputs_end_and_validate_at_temperature_1(tiny_model_dir) -> None:
    config = WorkerConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=400
    )
    runner = ModelRunner(config)
    rng = random.Random(0)
    requests, schemas = [], []
    for seed, schema in enumerate(SMALL_SCHEMAS * 2):
        structured = parse_structured(_response_format(schema))
        prompt = [rng.randrange(1, 4000) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, structured=structured)
        requests.append((prompt, params))
        schemas.append(schema)
    run = run_engine(
        runner, requests, owner=b"t", max_steps=20000, max_num_seqs=16, max_num_batched_tokens=128
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for i, schema in enumerate(schemas):
        tokens = run.tokens[(i, 0)]
        ended = tokens[-1] in runner.eos_token_ids
        assert ended, f"request {i} ran to max_tokens: {tokenizer.decode(tokens)!r}"
        text = tokenizer.decode(tokens[:-1])
        jsonschema.validate(json.loads(text), schema)
        assert "\n" not in text and "\t" not in text and "  " not in text, text


def test_disable_any_whitespace_false_allows_pretty_printed_json(tiny_model_dir) -> None:
    """vLLM's per-request option, explicitly false, accepts what json.dumps(indent=2) writes; by default the
    same document is refused at its first newline."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
    schema = SMALL_SCHEMAS[1]
    pretty = json.dumps({"name": "ab", "ok": True}, indent=2)
    compact = json.dumps({"name": "ab", "ok": True})
    allowed = {**_response_format(schema), "structured_outputs": {"disable_any_whitespace": False}}
    for body, document, accepted in (
        (_response_format(schema), compact, True),
        (_response_format(schema), pretty, False),
        (allowed, pretty, True),
        ({"structured_outputs": {"json": schema, "disable_any_whitespace": False}}, pretty, True),
        ({"structured_outputs": {"json": schema}}, pretty, False),
        ({"response_format": {"type": "json_object"}}, pretty, False),  # json_object: any object, compact
        ({"response_format": {"type": "json_object"}}, compact, True),
    ):
        matcher = xgr.GrammarMatcher(compile_grammar(compiler, parse_structured(body)))
        assert matcher.accept_string(document) == accepted, (body, document)
        assert matcher.is_completed() == accepted
