"""Reading a request body by hand, so that every way a body can be bad is a 4xx in the
OpenAI error shape and never an exception that escapes to the ASGI server (which would
close the client's keep-alive connection).

Checked in order: size (413, ``server.max_body_bytes``), UTF-8 (400), JSON syntax (400),
nesting deeper than :data:`MAX_DEPTH` (400), integers longer than :data:`MAX_INT_DIGITS`
digits and non-finite numbers (400), a top level that is not an object (400), then the
pydantic model (422 naming the field); a route may check fields before the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from slimkv.server.errors import APIError, validation_error

MAX_DEPTH = 64        # no OpenAI body nests deeper than ~6
MAX_INT_DIGITS = 40   # token ids, seeds, max_tokens: a 128-bit number has 39 digits
Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request, model: type[Body], max_bytes: int,
                    precheck: Callable[[dict], None] | None = None) -> Body:
    """``precheck``: run on the parsed object before the model (it raises the 400s of
    fields the model does not define: slimkv.server.unsupported)."""
    data = await read_json(request, max_bytes)
    if precheck is not None:
        precheck(data)
    return validate(model, data)


async def read_json(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object, every check but the model's done."""
    return parse_json(await _read_bytes(request, max_bytes))


def validate(model: type[Body], data: dict) -> Body:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc)
    except RecursionError:
        raise _invalid("the request body nests too deeply")


async def _read_bytes(request: Request, max_bytes: int) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(raw)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or an ``APIError`` (400) saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8: {exc}", "invalid_encoding")
    try:
        data = json.loads(text, parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_reject_constant)
    except RecursionError:
        data = None
    except ValueError as exc:  # JSONDecodeError, and the number hooks below
        raise _invalid(f"the request body is not valid JSON: {exc}")
    if data is None or _depth_over(data, MAX_DEPTH):
        raise _invalid(f"the request body nests deeper than {MAX_DEPTH} levels")
    if not isinstance(data, dict):
        raise _invalid("the request body must be a JSON object")
    return data


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer with over {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _depth_over(data: object, limit: int) -> bool:
    """Whether containers nest deeper than ``limit`` (iterative: no recursion to overflow)."""
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children
                         if isinstance(child, (dict, list)))
    return False


def _invalid(message: str) -> APIError:
    return APIError(400, message, "invalid_json")


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is over {max_bytes} bytes (server.max_body_bytes)",
                    "request_too_large")
