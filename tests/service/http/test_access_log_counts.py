"""The access log counts every sequence of a request (issue 38): for ``n=16`` the answer's usage, the
``loadmaster_generated_tokens`` metric and the request's access-log line agree, streamed or not; a request's prompt
counts once, as in its usage."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest

from tests.service.conftest import metric_samples


def _generated_metric(client: httpx.Client) -> float:
    return metric_samples(client.get("/metrics").text)["loadmaster_generated_tokens_total"]


def _log_line(caplog: pytest.LogCaptureFixture, rid: str) -> dict:
    for _ in range(100):
        lines = [json.loads(x.getMessage()) for x in caplog.records if x.name == "loadmaster.access"]
        mine = [x for x in lines if x["id"] == rid]
        if mine:
            assert len(mine) == 1
            return mine[0]
        threading.Event().wait(0.05)
    raise AssertionError(f"no access-log line for {rid}")


@pytest.mark.parametrize("stream", [False, True])
def test_n16_usage_metric_and_log_line_agree(client: httpx.Client, caplog: pytest.LogCaptureFixture, stream: bool):
    rid = f"n16-{'stream' if stream else 'plain'}"
    body = {"prompt": "Once upon a time", "n": 16, "max_tokens": 32, "temperature": 1.0, "seed": 7}
    before = _generated_metric(client)
    with caplog.at_level(logging.INFO, logger="loadmaster.access"):
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            with client.stream("POST", "/v1/completions", json=body, headers={"x-request-id": rid}) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
            usage = json.loads(events[-1])["usage"]
        else:
            r = client.post("/v1/completions", json=body, headers={"x-request-id": rid})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 16
            usage = r.json()["usage"]
        line = _log_line(caplog, rid)
    generated = usage["completion_tokens"]
    assert generated > 32  # more than one sequence's worth
    assert line["generated_tokens"] == generated
    assert _generated_metric(client) - before == generated
    assert line["prompt_tokens"] == usage["prompt_tokens"]


def test_best_of_counts_every_candidate(client: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    body = {"inputs": "Hello", "parameters": {"best_of": 4, "do_sample": True, "max_new_tokens": 8, "details": True}}
    before = _generated_metric(client)
    with caplog.at_level(logging.INFO, logger="loadmaster.access"):
        r = client.post("/generate", json=body, headers={"x-request-id": "best-of-4"})
        assert r.status_code == 200, r.text
        line = _log_line(caplog, "best-of-4")
    assert line["generated_tokens"] == _generated_metric(client) - before > 8
