"""PlanInputs: the one reader of the planner's inputs, as text (flags, settings) or as structured values (/plan)."""

from __future__ import annotations

import json

import pytest

from planner.errors import PlanError
from planner.placement.inputs import PlanInputs, parse_bandwidths, parse_max_memory, parse_strategy_text


def test_text_entries_read_to_structured_inputs(tmp_path):
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"model.layers": "cpu", "": "cuda:0"}))
    inputs = PlanInputs.from_text(
        max_memory=["0=20GiB,cpu=64GiB", "disk=1TB"],
        gpus="2x24GiB",
        strategy=f"@{f}",
        bandwidth=["gpu=3.3TB/s", "disk=2GB"],
        batch_size=4,
        context=512,
        complete=True,
    )
    assert inputs.max_memory == {"0": "20GiB", "cpu": "64GiB", "disk": "1TB"}
    assert inputs.bandwidths == {"gpu": 3.3e12, "disk": 2e9}
    assert inputs.strategy == {"model.layers": "cpu", "": "cuda:0"}
    assert inputs.checked_strategy() == {"model.layers": "cpu", "": 0}
    assert (inputs.batch_size, inputs.context, inputs.complete) == (4, 512, True)
    assert PlanInputs.from_text() == PlanInputs()


def test_a_json_string_strategy_is_read_as_a_map_but_never_as_a_file():
    assert PlanInputs(strategy='{"": "GPU 1"}').checked_strategy() == {"": 1}
    assert PlanInputs(strategy="@/etc/passwd").checked_strategy() == "@/etc/passwd"  # a name; solve refuses it


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: parse_max_memory(["cpu"]), "DEV=SIZE"),
        (lambda: parse_bandwidths(["gpu"]), "KIND=RATE"),
        (lambda: parse_bandwidths(["gpu=fast"]), "cannot read memory size"),
        (lambda: parse_strategy_text("{not json"), "not valid JSON"),
        (lambda: parse_strategy_text("@/no/such/map.json"), "cannot read device map file"),
        (lambda: PlanInputs(strategy={"": "tpu"}).checked_strategy(), "unknown device"),
        (lambda: PlanInputs(max_memory={}).hardware(), "max_memory is empty"),
        (lambda: PlanInputs(batch_size=0).workload(_skeleton()), "batch_size must be at least 1"),
        (lambda: PlanInputs(context=2.5).workload(_skeleton()), "context must be a whole number"),
    ],
)
def test_bad_inputs_raise_plan_errors_that_say_what_to_write(call, needle):
    with pytest.raises(PlanError) as e:
        call()
    assert needle in str(e.value)


def _skeleton():
    from tests.planner.synthetic import llama_like

    return llama_like(layers=2)
