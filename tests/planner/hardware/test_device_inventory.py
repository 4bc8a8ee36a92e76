"""Sizes, device keys and declared GPUs as users write them."""

from __future__ import annotations

import pytest

from planner.errors import HardwareSpecError
from planner.hardware.device_inventory import build_hardware, parse_gpus
from planner.hardware.devices import parse_device
from planner.hardware.units import format_bytes, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        (123, 123),
        ("123", 123),
        ("20GiB", 20 * 2**30),
        ("20GB", 20 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5TiB", int(1.5 * 2**40)),
        ("80GB", 80 * 10**9),
        ("80 gb", 80 * 10**9),
        ("4KiB", 4096),
        ("2KB", 2000),
        ("0", 0),
        ("16G", 16 * 2**30),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", -5, "twenty", "20XB", "", "GiB", None, True, float("nan")])
def test_parse_size_rejects_with_actionable_message(bad):
    with pytest.raises(HardwareSpecError) as e:
        parse_size(bad)
    assert "GiB" in str(e.value) or "negative" in str(e.value) or "finite" in str(e.value)


def test_format_bytes_labels_binary_units_and_round_trips():
    assert format_bytes(2**30) == "1.0GiB"
    assert format_bytes(1536 * 2**20) == "1.5GiB"
    assert format_bytes(512) == "512B"
    assert parse_size(format_bytes(3 * 2**40)) == 3 * 2**40


@pytest.mark.parametrize(
    "key,expected", [(0, 0), ("0", 0), ("cuda:1", 1), ("CUDA:2", 2), ("cpu", "cpu"), ("disk", "disk"), ("gpu3", 3)]
)
def test_device_keys(key, expected):
    assert parse_device(key) == expected


@pytest.mark.parametrize("bad", ["cpuu", "tpu", -1, "cuda:-1", 1.5, "mps"])
def test_unknown_device_key(bad):
    with pytest.raises(HardwareSpecError) as e:
        parse_device(bad)
    assert "cpu" in str(e.value) or "start at 0" in str(e.value)


def test_unknown_device_suggests_nearest():
    with pytest.raises(HardwareSpecError, match="did you mean 'cpu'"):
        parse_device("cpuu")


def test_declared_gpus():
    assert parse_gpus("4x24GiB") == [24 * 2**30] * 4
    assert parse_gpus("2x80GB,1x24GiB") == [80 * 10**9] * 2 + [24 * 2**30]
    assert parse_gpus("24GiB+48GiB") == [24 * 2**30, 48 * 2**30]
    for bad in ["0x24GiB", "4xfoo", "", "x24GiB"]:
        with pytest.raises(HardwareSpecError):
            parse_gpus(bad)


def test_max_memory_defines_exactly_the_devices_in_order():
    hw = build_hardware({"cpu": "8GiB", "cuda:1": "10GB", 0: 123, "disk": "1TB"})
    assert [d.id for d in hw.devices] == [0, 1, "cpu", "disk"]
    assert [d.capacity for d in hw.devices] == [123, 10**10, 8 * 2**30, 10**12]


def test_max_memory_errors_name_the_entry():
    with pytest.raises(HardwareSpecError, match=r"max_memory\['cpu'\]"):
        build_hardware({"cpu": "-3GiB"})
    with pytest.raises(HardwareSpecError, match="empty"):
        build_hardware({})
    with pytest.raises(HardwareSpecError, match="mapping"):
        build_hardware(["cpu"])  # type: ignore[arg-type]


def test_declared_gpus_with_cpu_budget_and_detected_default(tmp_path):
    hw = build_hardware({"cpu": "64GiB"}, gpus="2x24GiB")
    assert [(d.id, d.capacity) for d in hw.devices] == [(0, 24 * 2**30), (1, 24 * 2**30), ("cpu", 64 * 2**30)]
    detected = build_hardware(offload_folder=tmp_path / "offload")
    ids = [d.id for d in detected.devices]
    assert "cpu" in ids and "disk" in ids
    assert detected.get("cpu").capacity > 0


def test_bandwidth_overrides_are_validated():
    hw = build_hardware({0: "1GiB", "cpu": "1GiB"}, bandwidths={"gpu": 3e12})
    assert hw.get(0).bandwidth == 3e12
    with pytest.raises(HardwareSpecError, match="unknown bandwidth"):
        build_hardware({"cpu": 1}, bandwidths={"nvlink": 1e9})
    with pytest.raises(HardwareSpecError, match="positive"):
        build_hardware({"cpu": 1}, bandwidths={"gpu": 0})


def test_an_offload_folder_beside_max_memory_without_disk_adds_the_disk_it_names(tmp_path):
    """``--offload-folder`` says disk may be used: beside a ``max_memory`` that names no disk, the folder's free space
    is the disk tier (it was accepted and ignored); a declared ``disk=`` budget wins, and no folder adds none."""
    hw = build_hardware({"cpu": "1GiB"}, offload_folder=tmp_path / "not-yet" / "offload")
    assert [d.id for d in hw.devices] == ["cpu", "disk"] and hw.get("disk").capacity > 0
    declared = build_hardware({"cpu": "1GiB", "disk": "5GiB"}, offload_folder=tmp_path)
    assert declared.get("disk").capacity == 5 * 2**30
    assert [d.id for d in build_hardware({"cpu": "1GiB"}).devices] == ["cpu"]
