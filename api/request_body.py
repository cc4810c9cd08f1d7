"""A request's JSON body, parsed strictly: whatever the api cannot forward as it is is a 400 here.

Python's json module accepts more than JSON: NaN and Infinity literals, numbers that overflow to inf, and
lone UTF-16 surrogates ("\\ud800", or their raw bytes) that no tokenizer, detokenizer or encoder can take.
A body nested deeper than the interpreter's recursion limit raises RecursionError. All of these are
refused here, so every string the handlers see encodes as UTF-8 and every number is finite.

msgspec's decoder is strict in all these ways already and several times faster (a body of 8 MB of floats:
0.07 s against 0.43 s), so it parses first; a body it refuses is parsed again the strict way below, which
either accepts it as Python's json reads it or says precisely what is wrong. Large bodies are parsed off
the event loop (api/handlers.py: parse_body).
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from pagedserve.api.errors import invalid

_DECODER = msgspec.json.Decoder()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def parse_json(raw: bytes) -> Any:
    """The body as JSON. Raises ApiError 400 for anything but strict, finite, UTF-8-encodable JSON."""
    try:
        return _DECODER.decode(raw)
    except (msgspec.MsgspecError, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        pass
    return _parse_strictly(raw)


def _parse_strictly(raw: bytes) -> Any:
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise invalid("the body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and too-long integers are ValueErrors
        raise invalid(f"the body is not valid JSON: {str(e)[:200]}") from None
    try:
        # One pass in C over every string, keys included: lone surrogates cannot be encoded.
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise invalid("the body holds a lone UTF-16 surrogate, which is not a character") from None
    except RecursionError:
        raise invalid("the body is nested too deeply") from None
    return body
