"""One spelling of a device: every accepted input reads to the canonical id, and every rendering reads back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from planner.errors import HardwareSpecError
from planner.hardware.devices import (
    device_key,
    device_label,
    device_order,
    gpu_range_label,
    parse_device,
    torch_device_name,
)


@pytest.mark.parametrize(
    "spelling,expected",
    [
        (0, 0),
        (3, 3),
        ("0", 0),
        (" 12 ", 12),
        ("gpu0", 0),
        ("gpu:1", 1),
        ("GPU 0", 0),
        ("GPU 7", 7),
        ("cuda:0", 0),
        ("CUDA:2", 2),
        ("cuda", 0),
        ("gpu", 0),
        ("cpu", "cpu"),
        ("CPU", "cpu"),
        ("disk", "disk"),
        ("Disk ", "disk"),
        (SimpleNamespace(type="cuda", index=2), 2),
        (SimpleNamespace(type="cuda", index=None), 0),
        (SimpleNamespace(type="cpu", index=None), "cpu"),
    ],
)
def test_every_accepted_spelling_reads_to_the_canonical_id(spelling, expected):
    assert parse_device(spelling) == expected
    assert type(parse_device(spelling)) is type(expected)


@pytest.mark.parametrize(
    "bad,needle",
    [
        (-1, "negative"),
        (True, "boolean"),
        ("tpu0", "unknown device"),
        ("cpuu", "did you mean 'cpu'"),
        ("cuda:x", "unknown device"),
        (1.5, "float"),
        (SimpleNamespace(type="meta", index=None), "not one"),
    ],
)
def test_other_spellings_are_refused_with_the_accepted_ones_named(bad, needle):
    with pytest.raises(HardwareSpecError) as e:
        parse_device(bad)
    assert needle in str(e.value) and "'cuda:0'" in str(e.value)


@pytest.mark.parametrize("device", [0, 1, 15, "cpu", "disk"])
def test_every_rendering_reads_back_to_the_same_device(device):
    assert parse_device(device_label(device)) == device
    assert parse_device(device_key(device)) == device
    if isinstance(device, int):
        assert parse_device(torch_device_name(device)) == device


def test_renderings():
    assert [device_label(d) for d in (0, "cpu", "disk")] == ["GPU 0", "cpu", "disk"]
    assert [device_key(d) for d in (0, "cpu", "disk")] == ["0", "cpu", "disk"]
    assert [torch_device_name(d) for d in (1, "cpu", "disk")] == ["cuda:1", "cpu", "cpu"]
    assert gpu_range_label(0, 3) == "GPU 0-3" and gpu_range_label(2, 2) == "GPU 2"
    assert sorted(["disk", 1, "cpu", 0], key=device_order) == [0, 1, "cpu", "disk"]
