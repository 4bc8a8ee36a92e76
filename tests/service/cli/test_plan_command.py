"""``loadmaster plan`` and ``loadmaster estimate`` as a user runs them: a real process, real output, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.errors import PlanError
from planner.types import Plan

LOADMASTER = str(Path(sys.executable).parent / "loadmaster")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LOADMASTER, *args], capture_output=True, text=True, timeout=120)


def test_plan_prints_a_table_with_bars_and_predictions(tiny_llama):
    r = run(
        "plan", str(tiny_llama), "--gpus", "2x4MiB", "--max-memory", "cpu=1GiB", "--gpu-reserve", "0", "--context", "64"
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "GPU 0" in out and "GPU 1" in out and "[" in out and "#" in out
    assert "tokens/s" in out and "cost model" in out and "why:" in out


def test_plan_json_is_the_plan(tiny_gpt2):
    r = run(
        "plan",
        str(tiny_gpt2),
        "--max-memory",
        "0=8MiB",
        "--max-memory",
        "cpu=1GiB",
        "--gpu-reserve",
        "0",
        "--context",
        "32",
        "--strategy",
        "sequential",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    p = Plan.from_json(r.stdout)
    assert p.strategy == "sequential" and p.to_dict() == json.loads(r.stdout)


def test_custom_map_from_a_file(tiny_llama, tmp_path):
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"model.layers": "cpu", "": 0}))
    r = run(
        "plan",
        str(tiny_llama),
        "--max-memory",
        "0=64MiB,cpu=1GiB",
        "--gpu-reserve",
        "0",
        "--context",
        "16",
        "--strategy",
        f"@{f}",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    p = Plan.from_json(r.stdout)
    assert p.placement["model.layers.0"] == "cpu" and p.placement["model.embed_tokens"] == 0


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--max-memory", "cpu=-1GiB"], "negative"),
        (["--max-memory", "cpu=12parsecs"], "unknown unit"),
        (["--max-memory", "tpu0=1GiB"], "unknown device"),
        (["--max-memory", "cpu"], "DEV=SIZE"),
        (["--strategy", "balance"], "did you mean 'balanced'"),
        (["--strategy", "{not json"], "not valid JSON"),
        (["--strategy", '{"model.layerz": 0}'], "did you mean"),
        (["--strategy", '{"model.layers": 0}', "--max-memory", "0=1GiB"], "without a device"),
        (["--dtype", "fp8"], "unknown dtype"),
        (["--max-memory", "cpu=1MiB"], "does not fit"),
        (["--gpus", "4xlots"], "GPU declaration"),
    ],
)
def test_bad_input_exits_2_with_one_line(tiny_llama, args, needle, capsys):
    """In-process through the same ``main`` the console script calls (a process per case would cost minutes)."""
    from service.cli.main import main

    code = main(["plan", str(tiny_llama), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1


def test_bad_input_in_a_real_process_exits_2_without_traceback(tiny_llama):
    r = run("plan", str(tiny_llama), "--max-memory", "cpu=-1GiB")
    assert r.returncode == 2 and "negative" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_and_corrupt_checkpoint_exit_2(tmp_path, tiny_llama):
    from service.cli.main import main

    assert main(["plan", str(tmp_path / "nope")]) == 2
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_llama / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\xff" * 16)
    r = run("plan", str(broken))
    assert r.returncode == 2 and "model.safetensors" in r.stderr and "Traceback" not in r.stderr


def test_estimate_lists_formats_and_minimum_memory(tiny_llama):
    r = run("estimate", str(tiny_llama), "--context", "128", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["format"]: row for row in json.loads(r.stdout)}
    assert set(rows) == {"fp32", "bf16/fp16", "int8", "nf4/fp4"}
    # parameters halve in bf16; the rotary frequencies (non-persistent buffers) stay float32
    assert 1.9 < rows["fp32"]["weights"] / rows["bf16/fp16"]["weights"] <= 2.0
    assert rows["nf4/fp4"]["weights"] < rows["int8"]["weights"] < rows["bf16/fp16"]["weights"]
    # the minimum really is enough, and a byte less is not
    from planner.api import fits

    need = rows["bf16/fp16"]["min_single_gpu"]
    assert fits(tiny_llama, max_memory={0: need}, dtype="bf16", context=128)
    assert not fits(tiny_llama, max_memory={0: need - 1}, dtype="bf16", context=128)
    table = run("estimate", str(tiny_llama))
    assert table.returncode == 0 and "min 1 GPU" in table.stdout


HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "pydantic", "pydantic_settings")
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "configs"


@pytest.mark.parametrize(
    "args",
    [
        ["plan", str(EXAMPLES / "llama-3-70b.json"), "--gpus", "4x24GiB", "--max-memory", "cpu=64GiB", "--json"],
        [
            "plan",
            str(EXAMPLES / "mixtral-8x7b.json"),
            "--gpus",
            "1x24GiB",
            "--max-memory",
            "cpu=1GiB",
        ],  # no fit: advice
        ["estimate", str(EXAMPLES / "gemma-2-27b.json"), "--json"],
        ["plan", "{tiny_llama}", "--max-memory", "cpu=1GiB"],  # a checkpoint directory: config + headers
    ],
)
def test_plan_and_estimate_import_no_torch_transformers_or_server(tiny_llama, args):
    """The cold CLI stays fast because it imports none of these for the common families (checked in a fresh process,
    through the same ``main`` the console script calls)."""
    args = [a.replace("{tiny_llama}", str(tiny_llama)) for a in args]
    code = (
        "import sys\n"
        "from service.cli.main import main\n"
        f"rc = main({args!r})\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "sys.stderr.write('HEAVY=' + ','.join(heavy) + '\\n')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "HEAVY=" in r.stderr, r.stderr
    assert r.stderr.rsplit("HEAVY=", 1)[1].strip() == ""
    assert r.stdout.strip() or "does not fit" in r.stderr


def test_flags_and_environment_settings_read_to_the_same_plan_inputs(monkeypatch, tmp_path):
    """One parser: ``loadmaster plan`` flags and ``LOADMASTER_*`` settings (what ``serve`` plans with) agree."""
    import argparse

    from service.cli.plan_command import add_planner_flags, inputs_from_args
    from service.settings import ServiceSettings

    f = tmp_path / "map.json"
    f.write_text(json.dumps({"": "cpu"}))
    parser = argparse.ArgumentParser()
    add_planner_flags(parser)
    args = parser.parse_args(
        [
            "--max-memory",
            "0=1GiB",
            "--max-memory",
            "cpu=2GiB",
            "--gpus",
            "1x1GiB",
            "--strategy",
            f"@{f}",
            "--dtype",
            "bf16",
            "--batch-size",
            "3",
            "--context",
            "99",
            "--gpu-reserve",
            "1MiB",
            "--bandwidth",
            "gpu=1TB,disk=3GB",
            "--complete",
        ]
    )
    for name, value in {
        "MAX_MEMORY": "0=1GiB,cpu=2GiB",
        "GPUS": "1x1GiB",
        "STRATEGY": f"@{f}",
        "DTYPE": "bf16",
        "BATCH_SIZE": "3",
        "CONTEXT": "99",
        "GPU_RESERVE": "1MiB",
        "BANDWIDTH": "gpu=1TB,disk=3GB",
        "COMPLETE": "1",
    }.items():
        monkeypatch.setenv(f"LOADMASTER_{name}", value)
    from_flags = inputs_from_args(args)
    assert ServiceSettings().plan_inputs() == from_flags
    assert from_flags.strategy == {"": "cpu"} and from_flags.bandwidths == {"gpu": 1e12, "disk": 3e9}
    monkeypatch.setenv("LOADMASTER_MAX_MEMORY", "cpu")
    with pytest.raises(PlanError, match="DEV=SIZE"):
        ServiceSettings().plan_inputs()


def test_plan_sizes_the_native_cpu_quantization(tiny_llama):
    """``--cpu-quantization`` plans the bytes the loader stores (JSON round trip keeps it); with a GPU it exits 2."""
    args = ("plan", str(tiny_llama), "--max-memory", "cpu=1GiB", "--context", "64", "--dtype", "fp32")
    plain = Plan.from_json(run(*args, "--json").stdout)
    r = run(*args, "--cpu-quantization", "int4", "--json")
    assert r.returncode == 0, r.stderr
    q = Plan.from_json(r.stdout)
    assert q.workload.cpu_quantization == "int4" and q.to_dict() == json.loads(r.stdout)
    assert q.budgets[0].weights < plain.budgets[0].weights / 2  # the embedding and norms stay fp32
    text = run(*args, "--cpu-quantization", "int4")
    assert text.returncode == 0 and "cpu int4 (native kernels)" in text.stdout
    bad = run("plan", str(tiny_llama), "--gpus", "1x1GiB", "--cpu-quantization", "int8")
    assert bad.returncode == 2 and "--quantization (bitsandbytes) for GPU layers" in bad.stderr


def test_plan_caps_the_context_at_the_positions_and_refuses_beyond(tiny_llama, capsys):
    """As /plan does: the default 2048 becomes the tiny Llama's 1024 positions; --context 4096 is refused, naming
    both numbers, with exit status 2."""
    from service.cli.main import main

    assert main(["plan", str(tiny_llama), "--max-memory", "cpu=1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["context"] == 1024
    assert main(["plan", str(tiny_llama), "--max-memory", "cpu=1GiB", "--context", "4096"]) == 2
    err = capsys.readouterr().err
    assert "--context 4096 is more than the 1024 positions" in err, err


def test_plan_reserves_room_for_serves_draft_and_says_what_it_costs(tiny_llama, tiny_draft_llama, tmp_path):
    """``--speculate int4`` and ``--draft-model DIR`` on ``plan``: the plan serve would make beside its draft, with the
    draft's bytes in the CPU's budget and the cost in its reasons; the two drafts together are refused."""
    box = ("--max-memory", "cpu=16MiB", "--context", "512")
    for draft, label in (
        (("--speculate", "int4"), "int4 copy"),
        (("--draft-model", str(tiny_draft_llama)), "draft model"),
    ):
        r = run("plan", str(tiny_llama), *box, *draft, "--json")
        assert r.returncode == 0, r.stderr
        plan = Plan.from_json(r.stdout)
        cpu = plan.budget("cpu")
        assert cpu is not None and cpu.draft > 0 and cpu.total <= cpu.capacity
        assert any(reason.startswith(f"draft: {label}") for reason in plan.reasons), plan.reasons
        assert plan.workload.draft.tokens == 4  # resident here: serve's default of 4 drafts a pass
    # where the plan streams weights (layers on disk), serve drafts 8 a pass by default, and the plan says so
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"model.layers.2": "disk", "model.layers.3": "disk", "": "cpu"}))
    on_disk = ("--max-memory", "cpu=1GiB,disk=1GiB", "--strategy", f"@{f}", "--speculate", "int4", "--json")
    streamed = Plan.from_json(run("plan", str(tiny_llama), *on_disk).stdout)
    assert streamed.offloaded_bytes > 0 and streamed.workload.draft.tokens == 8
    asked = Plan.from_json(run("plan", str(tiny_llama), *on_disk, "--speculate-tokens", "3").stdout)
    assert asked.workload.draft.tokens == 3
    assert asked.prediction.speculative_tokens_per_s != streamed.prediction.speculative_tokens_per_s
    table = run("plan", str(tiny_llama), *box, "--draft-model", str(tiny_draft_llama))
    assert table.returncode == 0 and "draft model: " in table.stdout and "held on cpu" in table.stdout
    both = run("plan", str(tiny_llama), *box, "--draft-model", str(tiny_draft_llama), "--speculate", "int8")
    assert both.returncode == 2 and "two drafts" in both.stderr and "Traceback" not in both.stderr


def test_a_declared_box_smaller_than_a_local_checkpoint_plans_its_disk_tier():
    """``plan MODEL --max-memory cpu=SIZE`` plans what ``serve`` plans in a box of that size: the checkpoint's own
    shards are the disk tier, no ``--offload-folder`` needed (service/model/disk_tier.py); a config alone has none."""
    from tests.models import llama_100m_dir

    r = run("plan", str(llama_100m_dir()), "--max-memory", "cpu=200MiB", "--json")
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json(r.stdout)
    assert plan.budget("disk").weights > 0 and plan.budget("cpu").weights > 0
    config_only = run("plan", str(llama_100m_dir() / "config.json"), "--max-memory", "cpu=200MiB")
    assert config_only.returncode == 2 and "offload folder for disk" in config_only.stderr
