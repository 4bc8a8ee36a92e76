"""Session-wide fixtures (the shared tiny models, built once per cache and never downloaded) and the ``slow`` mark.

A test is ``slow`` when it starts something outside the test function: a subprocess, a real uvicorn server, Docker
or a browser. It is marked here automatically, by what the test uses: its own code, the same module's helpers it
calls, and its fixtures (``server``, ``client`` and their kin) are read for ``subprocess``, ``Popen``, a
``LiveServer``, ``uvicorn`` or ``playwright``. A test that reaches such things another way says ``@pytest.mark.slow`` itself.
``pytest -m "not slow"`` is then the fast subset; plain ``pytest`` (and ``.ci/run``) runs everything.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import inspect  # noqa: E402
import re  # noqa: E402
import types  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import hypothesis  # noqa: E402
import pytest  # noqa: E402

from tests import user_caches  # noqa: E402

# The suite never reads or writes the user's caches (calibration, kernels, demo model, offload folders, import
# table, Hub cache): before anything is collected, every cache points at the run's own temporary folder, which each
# subprocess inherits (tests/user_caches.py). Predictions then do not depend on whether someone ran
# 'loadmaster env --calibrate' here; the calibration tests point LOADMASTER_CALIBRATION at their own files.
REAL_CACHE = user_caches.real_cache_root()
REAL_CACHE_BEFORE = user_caches.listing(REAL_CACHE)
RUN_CACHES = user_caches.isolate()

from tests import models  # noqa: E402

# The property tests judge what a function returns, not how fast examples are drawn: on a 2-core CI machine busy
# with servers, one draw can stall for a second, and Hypothesis's timing checks then fail a correct function.
hypothesis.settings.register_profile(
    "loadmaster", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
hypothesis.settings.load_profile("loadmaster")


@pytest.fixture(scope="session")
def run_caches() -> Iterator[Path]:
    """The run's own cache folder (``XDG_CACHE_HOME``, ``HF_HOME``, ``LOADMASTER_HOME`` are under it)."""
    yield RUN_CACHES


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if anything under the user's own ``~/.cache/loadmaster`` changed while it ran."""
    changed = user_caches.changes(REAL_CACHE_BEFORE, user_caches.listing(REAL_CACHE))
    if changed:
        shown = "\n  ".join(changed[:20]) + ("\n  ..." if len(changed) > 20 else "")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            f"the test run changed the user's cache {REAL_CACHE} (tests must use their own, tests/user_caches.py;"
            f" or another loadmaster ran here meanwhile):\n  {shown}"
        )
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_sep("=", "user cache changed", red=True)
            reporter.write_line(message)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    user_caches.release(RUN_CACHES)


#: What in a test's code (or its helpers' or fixtures') starts a process or a server.
STARTS_SOMETHING = re.compile(
    r"\bsubprocess\.|\bPopen\(|\bLiveServer\(|\buvicorn\.|\bplaywright\b|\bchromium\.launch\("
)


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return models.tiny_llama_dir()


@pytest.fixture(scope="session")
def tiny_draft_llama() -> Path:
    return models.tiny_draft_llama_dir()


@pytest.fixture(scope="session")
def tiny_gpt2() -> Path:
    return models.tiny_gpt2_dir()


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    return models.tiny_moe_dir()


@pytest.fixture(scope="session")
def tiny_qwen_moe() -> Path:
    return models.tiny_qwen_moe_dir()


def _starts_something(func: object, seen: set[object]) -> bool:
    """Whether ``func``'s source, or that of a same-module function it names, starts a process or a server."""
    func = inspect.unwrap(func)  # type: ignore[arg-type]
    if func in seen or not isinstance(func, types.FunctionType):
        return False
    seen.add(func)
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    if STARTS_SOMETHING.search(source):
        return True
    module = inspect.getmodule(func)
    helpers = (getattr(module, name, None) for name in func.__code__.co_names)
    return any(
        _starts_something(h, seen)
        for h in helpers
        if isinstance(h, types.FunctionType) and h.__module__ == func.__module__
    )


def _is_slow(item: pytest.Item) -> bool:
    seen: set[object] = set()
    if isinstance(item, pytest.Function) and _starts_something(item.function, seen):
        return True
    fixture_defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(_starts_something(d.func, seen) for defs in fixture_defs.values() for d in defs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and _is_slow(item):
            item.add_marker(pytest.mark.slow)
