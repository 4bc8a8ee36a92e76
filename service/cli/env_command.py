"""The ``loadmaster env`` subcommand: the machine report for bug reports, and ``--calibrate``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def run_env(args: argparse.Namespace) -> int:
    from planner.errors import LoadmasterError
    from planner.hardware.calibration import ENV_VAR, calibration_path, save_calibration
    from service.cli import env_report

    if args.calibrate:
        path = calibration_path()
        if path is None:
            raise LoadmasterError(f"calibration is off ({ENV_VAR}=off); unset it, or set it to a file to save to")
        from service.cli.calibrate import calibrate

        folder = Path(args.offload_folder or Path(path).parent)
        say = (lambda m: sys.stderr.write(m + "\n")) if args.json else (lambda m: sys.stdout.write(m + "\n"))
        cal = calibrate(folder, say=say)
        save_calibration(cal, path)
        say(f"saved to {path}; 'loadmaster plan' now predicts with these figures")
    report = env_report.collect(args.offload_folder)
    sys.stdout.write((report.to_json() if args.json else env_report.format_report(report)) + "\n")
    return 0


def register(subparsers: Any) -> None:
    """Add ``env`` to the ``loadmaster`` command line."""
    p = subparsers.add_parser(
        "env",
        help="print what a bug report needs: GPUs, CPU and kernels, memory, versions, settings",
        description="Describe this machine and installation (secrets masked). --calibrate measures the rates the "
        "planner's cost model uses and saves them to the user's cache (LOADMASTER_CALIBRATION: a "
        "file, or off).",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--offload-folder",
        default=None,
        help="folder whose free disk to report and where --calibrate reads its scratch file "
        "(default LOADMASTER_OFFLOAD_FOLDER, else the current folder; for --calibrate, the cache)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure memory, disk, link and kernel rates (under a minute) and save them for the planner",
    )
    p.set_defaults(func=run_env)
