"""API keys: Bearer, case-sensitive, several keys; health routes open, everything else closed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.errors import AuthError
from service.http.api_keys import check_api_key
from tests.service.conftest import LiveServer, settings_for


@pytest.fixture(scope="module")
def keyed(tiny_gpt2: Path) -> Iterator[LiveServer]:
    s = LiveServer(settings_for(tiny_gpt2, api_key=["s3cret-Key", "second"])).start()
    yield s
    s.stop()


@pytest.mark.parametrize("path", ["/health", "/health/ready"])
def test_health_routes_stay_open(keyed: LiveServer, path: str) -> None:
    assert httpx.get(keyed.url + path).status_code == 200


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
        ("POST", "/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
        ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("GET", "/v1/models", None),
        ("POST", "/plan", {}),
        ("GET", "/info", None),
        ("GET", "/metrics", None),
        ("GET", "/docs", None),
        ("GET", "/openapi.json", None),
    ],
)
@pytest.mark.parametrize(
    "header",
    [None, "Bearer wrong", "Bearer s3cret-key", "Bearer S3CRET-KEY", "s3cret-Key", "Basic s3cret-Key", "Bearer"],
)
def test_everything_else_needs_a_valid_key(keyed: LiveServer, method: str, path: str, body, header) -> None:
    headers = {"Authorization": header} if header is not None else {}
    r = httpx.request(method, keyed.url + path, json=body, headers=headers)
    assert r.status_code == 401
    if path.startswith("/v1/"):
        assert r.json()["error"]["type"] == "authentication_error"
    else:
        assert r.json()["error_type"] == "authentication"
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("key", ["s3cret-Key", "second"])
def test_each_configured_key_is_accepted(keyed: LiveServer, key: str) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.post(keyed.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, headers=auth)
    assert r.status_code == 200
    assert httpx.get(keyed.url + "/metrics", headers=auth).status_code == 200


def test_openai_client_with_key(keyed: LiveServer) -> None:
    import openai

    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="second", max_retries=0)
    assert good.models.list().data[0].id == "tiny-gpt2"
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_key_check_needs_an_exact_match() -> None:
    check_api_key("Bearer abc", ["x", "abc"])
    check_api_key("bearer abc", ["abc"])  # the scheme is case-insensitive (RFC 7235); the key is not
    for header in ("Bearer abcd", "Bearer ab", "Bearer ABC", "", None, "abc"):
        with pytest.raises(AuthError):
            check_api_key(header, ["abc"])
