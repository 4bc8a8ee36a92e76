"""Runs the README's examples for real, so a renamed flag, a changed API or a changed output breaks a test.

Every fenced ``bash``, ``console`` and ``python`` block of README.md is an example this test runs from the
repository root, with ``.venv/bin`` (the running interpreter's folder) first on ``PATH``:

- ``console``: each ``$ command`` runs; the lines shown after it must be the command's output, where a line
  holding only ``...`` stands for any number of lines left out.
- ``bash``: the block runs under ``bash -euo pipefail``; ``curl`` fails on an HTTP error status
  (``--fail-with-body``), so an example that gets a 4xx or 5xx fails the test.
- ``python``: the block runs in a fresh interpreter and must exit 0.

The ``console`` examples of ``docs/*.md`` run the same way (a ``loadmaster: error:`` line shown under a command
means the command must fail with exit code 2 and print that on stderr).

An HTML comment on the line just above a block tells this test how to treat it:

- ``<!-- readme-test: server -->``: the block starts a server. It runs in the background (on a free port, see
  below) until the blocks after it have run, must become ready, and must exit 0 on SIGTERM.
- ``<!-- readme-test: skip (why) -->``: the block cannot run here (Docker, GPUs, the test run itself); the reason
  is required, and the set stays small (``MAX_SKIPPED``).

The README speaks to users, so its examples name a placeholder model and the default port; the test substitutes
them (``PLACEHOLDERS``): ``/models/my-model`` becomes the shared tiny Llama fixture and port 8080 a free port.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import user_caches
from tests.service.conftest import free_port

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"

MODEL_PLACEHOLDER = "/models/my-model"
PORT_PLACEHOLDER = "8080"
MAX_SKIPPED = 2
RUN_LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "console", "python": "python"}
SAMPLE_LANGUAGES = {"json", "text", ""}  # output samples shown to the reader, not run
MARKER = re.compile(r"^<!--\s*readme-test:\s*(?P<kind>server|skip)\s*(?:\((?P<why>[^)]*)\))?\s*-->$")
TIMEOUT_S = 300


@dataclass(frozen=True)
class Example:
    """One fenced block of the README that the test runs."""

    source: str  # the Markdown file's name, for messages and test ids
    line: int  # 1-based line of the opening fence
    language: str  # "bash", "console" or "python"
    code: str
    marker: str | None  # "server", "skip" or None
    skip_reason: str | None

    @property
    def test_id(self) -> str:
        return f"{self.source}:{self.line}-{self.language}"


def parse_examples(text: str, source: str = "README.md") -> list[Example]:
    """The README's runnable blocks in order. Unknown fence languages are an error, so an example cannot drop out
    of the test by being fenced as ``sh-session`` or similar."""
    lines = text.splitlines()
    examples: list[Example] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^```\s*([\w-]*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        language = fence.group(1)
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{source}:{i + 1}: the fenced block is never closed")
        above = lines[i - 1].strip() if i > 0 else ""
        marker = MARKER.match(above)
        if above.startswith("<!--") and "readme-test" in above and not marker:
            raise ValueError(
                f"{source}:{i}: unreadable marker {above!r}: use '<!-- readme-test: server -->' or "
                "'<!-- readme-test: skip (why) -->'"
            )
        if language in RUN_LANGUAGES:
            kind = marker.group("kind") if marker else None
            why = (marker.group("why") or "").strip() if marker else None
            if kind == "skip" and not why:
                raise ValueError(f"{source}:{i}: a skipped example must say why: '<!-- readme-test: skip (why) -->'")
            code = "\n".join(lines[i + 1 : end]) + "\n"
            examples.append(Example(source, i + 1, RUN_LANGUAGES[language], code, kind, why))
        elif language not in SAMPLE_LANGUAGES:
            raise ValueError(
                f"{source}:{i + 1}: fence language {language!r} is neither run ({sorted(RUN_LANGUAGES)}) "
                f"nor an output sample ({sorted(SAMPLE_LANGUAGES)})"
            )
        elif marker:
            raise ValueError(
                f"{source}:{i}: a readme-test marker above a {language or 'plain'} block, which is not run"
            )
        i = end + 1
    return examples


EXAMPLES = parse_examples(README.read_text())
SERVER_EXAMPLES = [e for e in EXAMPLES if e.marker == "server"]
#: The ``console`` examples of docs/*.md run too: each shows a command and what it prints, which must stay true.
DOCS_CONSOLE = [
    e
    for page in sorted((REPO / "docs").glob("*.md"))
    for e in parse_examples(page.read_text(), f"docs/{page.name}")
    if e.language == "console"
]


def _env() -> dict[str, str]:
    """The user's shell after setup: the venv first on PATH, no LOADMASTER_* settings leaking in, offline hub, and
    the test run's own caches (tests/user_caches.py), never the user's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_")}
    env.update(user_caches.env())
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO))
    return env


def _substitute(code: str, model: Path, port: int | None) -> str:
    code = code.replace(MODEL_PLACEHOLDER, str(model))
    if port is not None:
        code = re.sub(rf"\b{PORT_PLACEHOLDER}\b", str(port), code)
    return code


def console_commands(code: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines, each with the output lines shown under it."""
    runs: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:], []))
        elif runs:
            runs[-1][1].append(line.rstrip())
        elif line.strip():
            raise ValueError(f"console block starts with {line!r}, not a '$ ' command")
    return runs


def output_matches(shown: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` is ``shown`` with each ``...`` line standing for any run of lines (trailing blank
    lines ignored on both sides)."""
    while shown and not shown[-1]:
        shown = shown[:-1]
    while actual and not actual[-1]:
        actual = actual[:-1]
    pattern = "".join("(?:.*\n)*?" if line == "..." else re.escape(line) + "\n" for line in shown)
    return re.fullmatch(pattern, "".join(line + "\n" for line in actual)) is not None


def test_output_matching_reads_ellipses() -> None:
    assert output_matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert output_matches(["a", "b", ""], ["a", "b"])
    assert not output_matches(["a", "d"], ["a", "b", "d"])
    assert not output_matches(["a", "...", "x"], ["a", "b", "d"])
    assert output_matches(["a", "..."], ["a", "b"]) and not output_matches(["a"], ["a", "b"])


def test_the_readme_has_runnable_examples_and_few_exceptions() -> None:
    languages = {e.language for e in EXAMPLES if e.marker != "skip"}
    assert languages == {"bash", "console", "python"}, languages
    skipped = [e for e in EXAMPLES if e.marker == "skip"]
    assert len(skipped) <= MAX_SKIPPED, f"too many examples skipped ({[e.test_id for e in skipped]}): make them run"
    assert len(SERVER_EXAMPLES) == 1, "one example starts the server the curl examples after it talk to"
    assert any("curl" in e.code for e in EXAMPLES if e.line > SERVER_EXAMPLES[0].line)


def test_an_unmarked_unknown_fence_is_refused() -> None:
    with pytest.raises(ValueError, match="neither run"):
        parse_examples("```sh-session\n$ ls\n```\n")
    with pytest.raises(ValueError, match="must say why"):
        parse_examples("<!-- readme-test: skip -->\n```bash\nls\n```\n")


@dataclass
class RunningServer:
    port: int
    process: subprocess.Popen


@pytest.fixture(scope="module")
def readme_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The README's server command, run as written (placeholders substituted), on a free port."""
    (example,) = SERVER_EXAMPLES
    port = free_port()
    log = tmp_path_factory.mktemp("readme-server") / "server.log"
    command = _substitute(example.code, tiny_llama, port).strip()
    with log.open("w") as out:
        process = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=REPO,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(
                    f"{example.test_id}: the server exited with {process.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{example.test_id}: the server was not ready in {TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield RunningServer(port, process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert process.returncode == 0, (
        f"the README's server exited {process.returncode} on SIGTERM:\n{log.read_text()[-3000:]}"
    )


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, input=stdin, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def _check_console(example: Example, code: str) -> None:
    """Run each ``$ command`` and compare what it prints (stdout, or stderr when it fails with exit code 2: a usage
    error's one line) with the lines shown under it."""
    for command, shown in console_commands(code):
        p = _run(["bash", "-euo", "pipefail", "-c", command])
        printed = p.stdout if p.returncode == 0 else p.stderr
        shows_usage_error = any(line.startswith("loadmaster: error:") for line in shown)
        assert p.returncode == 0 or (p.returncode == 2 and shows_usage_error), (
            f"{example.test_id}: '{command}' exited {p.returncode}:\n{p.stderr[-3000:]}"
        )
        actual = [line.rstrip() for line in printed.splitlines()]
        assert output_matches(shown, actual), (
            f"{example.test_id}: '{command}' printed something other than the page shows.\n"
            f"shown:\n" + "\n".join(shown) + "\nactual:\n" + "\n".join(actual)
        )


@pytest.mark.slow
@pytest.mark.parametrize("example", DOCS_CONSOLE, ids=lambda e: e.test_id)
def test_docs_console_example(example: Example) -> None:
    _check_console(example, example.code)


@pytest.mark.slow
@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.marker is None], ids=lambda e: e.test_id)
def test_readme_example(example: Example, request: pytest.FixtureRequest, tiny_llama: Path) -> None:
    port = None
    if SERVER_EXAMPLES and example.line > SERVER_EXAMPLES[0].line:
        port = request.getfixturevalue("readme_server").port
    code = _substitute(example.code, tiny_llama, port)
    if example.language == "console":
        _check_console(example, code)
    elif example.language == "bash":
        script = 'curl() { command curl --fail-with-body --max-time 120 "$@"; }\n' + code
        p = _run(["bash", "-euo", "pipefail", "-s"], stdin=script)
        assert p.returncode == 0, f"{example.test_id} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    else:
        p = _run([sys.executable, "-c", code])
        assert p.returncode == 0, f"{example.test_id} failed ({p.returncode}):\n{p.stderr[-3000:]}"
