"""Flags and PAGEDSERVE_* variables for a process's config dataclass (common/config.py): the parser's
arguments, their help taken from the fields' comments, the environment's values, and the one-line exit on a
setting the config refuses.

Every field of a config is a command-line flag (`max_num_seqs` -> `--max-num-seqs`) and an environment
variable (`PAGEDSERVE_MAX_NUM_SEQS`); the flag wins over the variable, the variable over the default.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import os
import sys
import textwrap
import tokenize
import types
from collections.abc import Container, Mapping
from dataclasses import MISSING, fields
from functools import cache
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from pagedserve.common.preflight import CONFIG_ERROR, flag_named_in

ENV_PREFIX = "PAGEDSERVE_"
C = TypeVar("C")


def json_string_list(name: str, text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form for --allowed-origins and its kin), else ValueError."""
    value = json.loads(text) if text.lstrip().startswith("[") else None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a JSON list of strings, e.g. '[\"*\"]', got {text[:100]!r}")
    return value


def json_object_of(text: str, config_cls: type, what: str) -> dict[str, Any] | None:
    """The JSON object that `text` (a flag's value) holds, whose keys must be fields of `config_cls`; None for
    an empty string. ValueError names what is wrong, `what` naming the flag's config."""
    if not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what} must be a JSON object")
    known = {f.name for f in fields(config_cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; known: {sorted(known)}")
    return raw


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _scalar_type(tp: Any) -> Any:
    if get_origin(tp) in (types.UnionType,):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def choices_of(config_cls: type) -> dict[str, tuple[Any, ...]]:
    """The fields of `config_cls` typed as a Literal, and the values each may take."""
    hints = get_type_hints(config_cls)
    literals = [f.name for f in fields(config_cls) if get_origin(hints[f.name]) is Literal]
    return {name: get_args(hints[name]) for name in literals}


def check_choices(config: Any) -> None:
    """Raises ValueError where a field typed as a Literal holds another value (for __post_init__)."""
    for name, allowed in choices_of(type(config)).items():
        value = getattr(config, name)
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


@cache
def field_descriptions(config_cls: type) -> dict[str, str]:
    """Each field's description, read from the comment beside it in the class's source: on its own line(s)
    right above the field, or at the end of the field's line. Empty where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(config_cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # line number -> comment text
    code_lines: set[int] = set()  # lines holding code, not only a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    (cls_node,) = ast.parse(source).body
    descriptions = {}
    for node in cls_node.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above = []
        line = node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        beside = comments.get(node.end_lineno or node.lineno, "")
        descriptions[node.target.id] = " ".join(above + [beside]).strip()
    return descriptions


def add_config_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config_cls: type,
    skip: Container[str] = (),
    notes: Mapping[str, str] | None = None,
) -> None:
    """Adds one flag per field of `config_cls` (but those in `skip`), defaulting to its environment variable,
    then its default. A flag's help is the field's comment, its default, its environment variable and its
    entry in `notes`; a Literal field's values are the flag's choices."""
    hints = get_type_hints(config_cls)
    descriptions = field_descriptions(config_cls)
    choices = choices_of(config_cls)
    for f in fields(config_cls):
        if f.name in skip:
            continue
        note = f"; {notes[f.name]}" if notes and f.name in notes else ""
        tp = _scalar_type(hints[f.name])
        env_name = ENV_PREFIX + f.name.upper()
        default = f.default if f.default is not MISSING else None
        env_value = os.environ.get(env_name)
        description = descriptions.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        about = f"{description} " if description else ""
        if tp is bool:
            parser.add_argument(
                _flag(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=_parse_bool(env_value) if env_value is not None else default,
                help=f"{about}(default {default!r}; env {env_name}{note})",
            )
            continue
        if f.name in choices:
            tp = str
        if env_value is not None:
            try:
                default = tp(env_value)
            except ValueError as e:
                raise SystemExit(f"{env_name}={env_value!r}: {e}") from e
        parser.add_argument(
            _flag(f.name),
            dest=f.name,
            type=tp,
            default=default,
            choices=choices.get(f.name),
            help=f"{about}(default {default!r}; env {env_name}{note})",
        )


def config_from_args(config_cls: type[C], args: argparse.Namespace) -> C:
    """The config of `args`' values for `config_cls`'s fields; a config with a `revision` field has its
    `model` resolved to a local directory (common/model_source.py: a Hugging Face repo id, from the cache or
    the Hub). Exits with one line naming the flag when a value is bad or the model cannot be found (status 2,
    a configuration error the supervisor does not restart)."""
    names = [f.name for f in fields(config_cls)]
    try:
        config = config_cls(**{name: getattr(args, name) for name in names})
    except ValueError as e:
        flag = flag_named_in(str(e), names)
        print(f"error: {flag + ': ' if flag else ''}bad setting: {e}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR) from None
    if "revision" not in {f.name for f in fields(config_cls)}:
        return config
    from pagedserve.common.model_source import ModelSourceError, resolve_config

    try:
        return resolve_config(config)
    except ModelSourceError as e:
        print(f"error: --model: {e}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR) from None


def parse_config(config_cls: type[C], argv: list[str] | None = None, description: str = "") -> C:
    """The config for this process, from its command line and the PAGEDSERVE_* environment."""
    parser = argparse.ArgumentParser(description=description)
    add_config_args(parser, config_cls)
    return config_from_args(config_cls, parser.parse_args(argv))
