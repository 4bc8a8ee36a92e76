"""``loadmaster serve`` as a real process: settings from flags and environment, usage errors exit 2, and SIGTERM
drains in-flight requests before exiting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.cli.main import build_parser, settings_from_args
from tests import user_caches
from tests.models import llama_100m_dir
from tests.service.conftest import free_port

REPO = Path(__file__).resolve().parents[3]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_")}
    env.update(user_caches.env())  # the run's own caches (tests/user_caches.py), never the user's
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), **extra)
    return env


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float, poll: float) -> None:
    """Wait for ``/health/ready`` to answer 200; the server's log is the message when it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(poll)


def _serve_100m(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str, Path]:
    """Start ``loadmaster serve`` on the 100M Llama (8 GiB of CPU) with extra ``flags``; the process, its URL and
    the log file that carries its output."""
    port = free_port()
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "service.cli", "serve", str(llama_100m_dir()), "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*argv, "--max-memory", "cpu=8GiB", *flags], stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO
        )
    return proc, f"http://127.0.0.1:{port}", log


def test_every_flag_is_also_an_environment_variable(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    monkeypatch.setenv("LOADMASTER_MODEL", str(tiny_llama))
    monkeypatch.setenv("LOADMASTER_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("LOADMASTER_PORT", "9999")
    monkeypatch.setenv("LOADMASTER_API_KEY", "a,b")
    monkeypatch.setenv("LOADMASTER_MAX_MEMORY", "cpu=2GiB,disk=10GiB")
    monkeypatch.setenv("LOADMASTER_STRATEGY", "sequential")
    monkeypatch.setenv("LOADMASTER_GRACE_PERIOD", "3.5")
    s = settings_from_args(build_parser().parse_args(["serve"]))
    assert s.model == str(tiny_llama) and s.max_batch_size == 7 and s.port == 9999
    assert s.api_key == ["a", "b"] and s.max_memory == ["cpu=2GiB", "disk=10GiB"]
    assert s.strategy == "sequential" and s.grace_period == 3.5
    # flags win over the environment
    s = settings_from_args(
        build_parser().parse_args(
            ["serve", "other-dir", "--max-batch-size", "3", "--api-key", "z", "--strategy", "balanced"]
        )
    )
    assert s.model == "other-dir" and s.max_batch_size == 3 and s.api_key == ["z"] and s.strategy == "balanced"
    # a switch: --no-prefix-cache, or LOADMASTER_PREFIX_CACHE=false
    assert s.prefix_cache is True
    assert settings_from_args(build_parser().parse_args(["serve", "--no-prefix-cache"])).prefix_cache is False
    monkeypatch.setenv("LOADMASTER_PREFIX_CACHE", "false")
    assert settings_from_args(build_parser().parse_args(["serve"])).prefix_cache is False
    assert settings_from_args(build_parser().parse_args(["serve", "--prefix-cache"])).prefix_cache is True
    # every serve flag has a settings field of the same name
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001 - argparse has no public walk
    fields = set(type(s).model_fields)
    for action in serve._actions:  # noqa: SLF001
        if action.dest not in ("help",):
            assert action.dest in fields, action.dest


@pytest.mark.parametrize(
    "args,env,mentions",
    [
        (["serve", "/no/such/model"], {}, "does not exist"),
        (["serve"], {}, "No model to serve"),
        (["serve", "{model}", "--max-memory", "lots"], {}, "DEV=SIZE"),
        (["serve", "{model}"], {"LOADMASTER_MAX_BATCH_SIZE": "many"}, "max_batch_size"),
        (["serve", "{model}", "--max-input-tokens", "4096", "--max-total-tokens", "100"], {}, "max_input_tokens"),
        (["serve", "{model}", "--cpu-quantization", "int3"], {}, "cpu_quantization"),
        (["serve", "{model}", "--strategy", "fastest"], {}, "unknown strategy 'fastest'"),
        (["serve", "{model}", "--api-key", ""], {}, "API key is empty or blank"),
        (["serve", "{model}", "--speculate", "eagle"], {}, "speculate"),
    ],
)
def test_usage_errors_exit_2_with_one_line(tiny_llama: Path, args: list[str], env: dict, mentions: str) -> None:
    argv = [a.replace("{model}", str(tiny_llama)) for a in args]
    p = subprocess.run(
        [sys.executable, "-m", "service.cli", *argv], capture_output=True, text=True, env=_env(**env), timeout=120
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loadmaster: error:") and mentions in lines[0], p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "args,env,mentions",
    [
        (["--max-memory", "cpu=lots"], {}, "'lots'"),
        (["--max-memory", "cpu=1e400GiB"], {}, "too large"),
        (["--strategy", "fastest"], {}, "unknown strategy 'fastest'"),
        (["--dtype", "fp8"], {}, "unknown dtype 'fp8'"),
        (["--quantization", "int2"], {}, "unknown quantization 'int2'"),
        (["--gpus", "lots"], {}, "GPU declaration"),
        (["--log-level", "verbose"], {}, "log_level"),
        (["--api-key", "good", "--api-key", "  "], {}, "API key is empty or blank"),
        (["--speculate", "ngram", "--pipeline"], {}, "--speculate does not apply to a --pipeline"),
        (["--speculate", "int4", "--pipeline"], {}, "--speculate does not apply to a --pipeline"),
        (["--speculate", "int8", "--gpus", "1x24GiB"], {}, "--gpus places it on GPUs"),
        (["--speculate", "int4", "--quantization", "nf4"], {}, "--quantization places it on GPUs"),
        (["--speculate-tokens", "0"], {}, "speculate_tokens"),
        ([], {"LOADMASTER_API_KEY": "a,,b"}, "API key is empty or blank"),
        ([], {"LOADMASTER_API_KEY": ""}, "API key is empty or blank"),
    ],
)
def test_invalid_flag_values_exit_2_before_serving(
    tiny_llama: Path,
    args: list[str],
    env: dict,
    mentions: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """The same check in-process (the subprocess cases above prove the real process): the value is refused by
    ``main`` at start, before a server exists, with exit status 2 and one line naming it."""
    from service.cli.main import main

    for key in [k for k in os.environ if k.startswith("LOADMASTER_") and k not in user_caches.VARIABLES]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", str(tiny_llama), "--port", "1", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loadmaster: error:") and mentions in err[0], err


def test_sigterm_finishes_the_request_in_flight_then_exits(tmp_path: Path) -> None:
    proc, url, log = _serve_100m(tmp_path, "--grace-period", "60", "--max-total-tokens", "256")
    try:
        _wait_ready(url, proc, log, timeout=120, poll=0.1)

        n = 40
        with (
            httpx.Client(timeout=120) as c,
            c.stream(
                "POST", url + "/generate_stream", json={"inputs": "Long ago", "parameters": {"max_new_tokens": n}}
            ) as r,
        ):
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            # no new work is accepted while draining: the listener is closed (or says 503)
            try:
                refused = httpx.post(url + "/generate", json={"inputs": "x"}, timeout=5).status_code == 503
            except httpx.TransportError:
                refused = True
            assert refused
            rest = [line for line in lines if line.startswith("data:")]
        events = [json.loads(x[len("data:") :]) for x in [first, *rest]]
        assert len(events) == n
        assert events[-1]["details"]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_model_that_fails_to_load_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    """As TGI and vLLM do: the load fails (a config, no weights), one error line is logged, the process exits 1."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    p = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", str(tmp_path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,  # a slow, busy machine: the process imports torch and transformers before it fails
        cwd=REPO,
    )
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "loading the model failed" in errors[0], p.stderr
    assert "Traceback" not in p.stderr


def test_grace_period_end_gives_streams_an_error_event_and_requests_a_json_503(tmp_path: Path) -> None:
    """SIGTERM with requests far from done: at the end of the grace period the stream's last event is a
    ``not_ready`` error and the plain request is answered with a JSON 503, not a cut connection; then the process
    exits."""
    proc, url, log = _serve_100m(tmp_path, "--grace-period", "1", "--max-total-tokens", "1024", "--threads", "1")
    try:
        _wait_ready(url, proc, log, timeout=600, poll=0.2)

        body = {"inputs": "Long ago", "parameters": {"max_new_tokens": 900}}
        plain: dict = {}

        def post_plain() -> None:
            plain["response"] = httpx.post(url + "/generate", json=body, timeout=300)

        with httpx.Client(timeout=300) as c, c.stream("POST", url + "/generate_stream", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            waiter = threading.Thread(target=post_plain)
            waiter.start()
            time.sleep(1.0)  # the plain request is admitted and generating
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
            waiter.join(300)
        events = [json.loads(x[len("data:") :]) for x in [first, *rest]]
        assert events[-1].get("error_type") == "not_ready" and "shutting down" in events[-1]["error"], events[-1]
        assert 1 <= len(events) - 1 < 900
        resp = plain["response"]
        assert resp.status_code == 503 and resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error_type"] == "not_ready"
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
