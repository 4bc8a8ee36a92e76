"""What every request body must be before a route parses it: JSON (else 415), within the size limit (else 413), and
JSON that Python can hold without surprise: no NaN or Infinity, no number too large to be finite, no string with a
lone UTF-16 surrogate (which cannot be encoded to UTF-8, so it would fail later, deep inside a tokenizer or while
writing the answer), no nesting deep enough to exhaust the parser's recursion.

Each check raises a :class:`~service.errors.RequestValidationError` (or its 413/415 subclasses) naming what was
wrong and where, so every route answers these inputs with a 4xx in the error envelope.
"""

from __future__ import annotations

import json
import math
from typing import Any

from service.errors import RequestValidationError

#: Deepest nesting of arrays and objects accepted (no route takes more than a few levels).
MAX_DEPTH = 64
#: Content types read as JSON; ``+json`` suffixes are accepted too.
JSON_TYPES = ("application/json",)


class BodyTooLargeError(RequestValidationError):
    """The request body is over ``--max-body-bytes``."""

    error_type = "payload_too_large"
    status_code = 413


class UnsupportedMediaTypeError(RequestValidationError):
    """The request body is not JSON."""

    error_type = "unsupported_media_type"
    status_code = 415


def check_content_type(content_type: str | None) -> None:
    """Refuse a body that says it is not JSON. A body without a content type is read as JSON, as FastAPI does."""
    if content_type is None or not content_type.strip():
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media in JSON_TYPES or media.endswith("+json"):
        return
    raise UnsupportedMediaTypeError(
        f"The request body has content type {media!r}; this server reads JSON only: send "
        "'Content-Type: application/json'."
    )


def too_large(limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(
        f"The request body is larger than {limit} bytes (--max-body-bytes); send a smaller one (a shorter prompt)."
    )


def _where(path: list[str]) -> str:
    # Keys may hold the very surrogates being refused: escape them so that the message itself is valid text.
    return ".".join(p.encode("utf-8", "backslashreplace").decode("utf-8") for p in path) or "body"


def _walk(value: Any, path: list[str], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise RequestValidationError(f"The request body nests deeper than {MAX_DEPTH} levels at {_where(path)}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestValidationError(
            f"{_where(path)} is {value} (NaN, Infinity, or a number too large to be finite); send a finite number."
        )
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestValidationError(
                f"{_where(path)} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                "text; send valid Unicode."
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(key, [*path, "<key>"], depth + 1)
            _walk(item, [*path, str(key)[:64]], depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, [*path, str(i)], depth + 1)


def check_json(body: bytes) -> None:
    """Parse ``body`` strictly and check every value in it; raise :class:`RequestValidationError` with its place."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestValidationError(f"The request body is not UTF-8 (byte {exc.start}); send UTF-8 JSON.") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise RequestValidationError(f"The request body nests deeper than {MAX_DEPTH} levels.") from None
    except ValueError as exc:  # JSONDecodeError, and ints over Python's digit limit
        raise RequestValidationError(f"The request body is not JSON ({exc}); send a JSON object.") from None
    _walk(value, [], 0)
