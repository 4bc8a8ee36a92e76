"""``loadmaster plan --nodes N``: stages and hops for people, the ClusterPlan as JSON, exit code 2 on bad flags."""

from __future__ import annotations

import pytest

from planner.cluster import ClusterPlan
from planner.hardware.units import parse_rate
from service.cli.main import main


def test_plan_with_nodes_prints_stages_and_hops(tiny_llama, capsys):
    rc = main(
        ["plan", str(tiny_llama), "--nodes", "2", "--max-memory", "cpu=1GiB", "--batch-size", "4", "--context", "64"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "stage 0 -> 1" in out and "stage 1 -> 0" in out
    assert "0-1" in out and "2-3" in out and "predicted decode" in out and "bottleneck" in out


def test_plan_with_nodes_json_is_the_cluster_plan(tiny_gpt2, capsys):
    rc = main(
        [
            "plan",
            str(tiny_gpt2),
            "--nodes",
            "3",
            "--max-memory",
            "cpu=1GiB",
            "--inter-host-bandwidth",
            "100Gb",
            "--json",
        ]
    )
    cp = ClusterPlan.from_json(capsys.readouterr().out)
    assert rc == 0
    assert len(cp.stages) == 3 and len(cp.hops) == 3
    assert cp.inter_host_bandwidth == pytest.approx(12.5e9)
    assert cp.fingerprint and cp.fingerprint.startswith("sha256:")
    assert "lm_head" in cp.stages[0].blocks and "transformer.wte" in cp.stages[0].blocks


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "0"], "--nodes must be at least 1"),
        (["--nodes", "2", "--inter-host-bandwidth", "fast"], "inter-host-bandwidth"),
        (["--nodes", "9"], "fewer than the 9 hosts"),
        (["--nodes", "2", "--svg", "x.svg"], "--svg and --html"),
    ],
)
def test_bad_cluster_flags_exit_2_with_one_line(tiny_llama, capsys, flags, message):
    rc = main(["plan", str(tiny_llama), "--max-memory", "cpu=1GiB", *flags])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_rates_read_bits_and_bytes():
    assert parse_rate("10Gb") == pytest.approx(1.25e9)
    assert parse_rate("12.5GB/s") == pytest.approx(12.5e9)
