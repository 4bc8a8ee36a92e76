"""Loader-test fixtures: one run per native-kernel path. Default offload folders already sit in the run's own
caches (tests/user_caches.py), so nothing here sets ``LOADMASTER_OFFLOAD_DIR`` for the rest of the session."""

from __future__ import annotations

from tests.loaders.kernel_paths import kernel_path, native_path  # noqa: F401  (fixtures: one run per kernel path)


def pytest_terminal_summary(terminalreporter):
    """State which native-kernel paths this run exercised, and which this CPU cannot run (CI logs show it)."""
    from loaders.native import kernel_build
    from tests.loaders.kernel_paths import KERNEL_PATHS_RUN

    if not KERNEL_PATHS_RUN:
        return

    runnable = kernel_build.runnable_isas()
    skipped = [isa for isa in kernel_build.ISAS if isa not in runnable]
    terminalreporter.write_line(
        f"native CPU kernel paths run: {', '.join(sorted(KERNEL_PATHS_RUN))}"
        + (f"; not runnable on this CPU: {', '.join(skipped)}" if skipped else "")
    )
