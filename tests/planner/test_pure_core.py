"""The planner's core is pure: planning a Skeleton imports neither torch nor transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_planning_a_skeleton_imports_no_torch():
    code = (
        "import sys\n"
        "import planner, planner.api, planner.placement.estimate, planner.placement.advice, planner.model.safetensors_header\n"
        "from tests.planner.synthetic import llama_like\n"
        "p = planner.plan(llama_like(), max_memory={0: '1GiB', 'cpu': '1GiB'}, gpus=None)\n"
        "assert p.device_map\n"
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
