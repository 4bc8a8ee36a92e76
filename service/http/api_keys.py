"""API keys: which routes need one, and a constant-time check of the one a request carries.

Keys are compared in constant time (``hmac.compare_digest``) against every configured key, so the time taken says
nothing about how much of a key was right.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from service.errors import AuthError

#: Routes open without a key: probes must work for orchestrators that hold no secrets.
OPEN_PATHS = frozenset({"/health", "/health/ready"})


def is_open(method: str, path: str, accept: str = "") -> bool:
    """Whether a request needs no API key: the probes, and the web page's shell (which holds no data and must
    load to ask for the key): ``GET /ui``, and ``GET /`` from a browser. ``POST /`` (generation) always needs one,
    and so does ``GET /`` from other clients, as before the page existed."""
    if path in OPEN_PATHS:
        return True
    if method not in ("GET", "HEAD"):
        return False
    return path == "/ui" or (path == "/" and "text/html" in accept)


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_api_key(header: str | None, keys: Iterable[str], x_api_key: str | None = None) -> None:
    """Raise :class:`AuthError` unless ``header`` is ``Bearer <one of keys>``, or (what Anthropic's clients send)
    ``x_api_key`` is one of keys (case-sensitive, constant time)."""
    token = bearer_token(header) or (x_api_key.strip() if x_api_key and x_api_key.strip() else None)
    if token is None:
        raise AuthError("This server needs an API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.")
    given = token.encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key.encode())
    if not ok:
        raise AuthError("The API key is not valid.")
