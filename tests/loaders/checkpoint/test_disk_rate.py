"""The disk tier's rate, measured on real files: a cold read of at most the asked bytes, and a server's plan inputs
that take it only where weights can go to disk and no rate is known (the suite runs with the calibration off)."""

from __future__ import annotations

import os
from pathlib import Path

from loaders.checkpoint.disk_rate import CHUNK, STREAM_BLOCK, cold_read_rate, streamed_read_rate
from loaders.checkpoint.shard_reader import ShardReader
from planner.placement.inputs import PlanInputs
from service.model.storage_rate import PROBE_BYTES, with_disk_rate, with_memory_rate

MiB = 1 << 20


def _shards(folder: Path, sizes_mib: list[int]) -> list[Path]:
    files = []
    for i, size in enumerate(sizes_mib):
        f = folder / f"model-{i + 1:05d}-of-{len(sizes_mib):05d}.safetensors"
        f.write_bytes(os.urandom(size * MiB))
        files.append(f)
    return files


def test_a_cold_read_reads_what_it_is_asked_and_times_it(tmp_path: Path) -> None:
    files = _shards(tmp_path, [24, 24])
    whole = cold_read_rate(files)
    assert whole.bytes_read == 48 * MiB and whole.seconds > 0 and whole.bytes_per_s > 0
    assert whole.method in ("O_DIRECT", "buffered after POSIX_FADV_DONTNEED")
    part = cold_read_rate(files, limit=CHUNK)
    assert part.bytes_read == CHUNK


def test_a_streamed_read_reads_what_it_is_asked_and_leaves_nothing_cached(tmp_path: Path) -> None:
    """The server's probe: blocks through the shards' maps, read ahead and given back. It reads exactly the bytes
    asked (across a shard boundary, in more than one block), and leaves none of them in the page cache, where they
    would take room from the weights about to load."""
    files = _shards(tmp_path, [40, 100])
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)  # dirty pages cannot be dropped
        os.close(fd)
    limit = 40 * MiB + STREAM_BLOCK + 8 * MiB  # the second shard's second block is cut short
    rate = streamed_read_rate(files, limit)
    assert rate.bytes_read == limit and rate.seconds > 0 and rate.bytes_per_s > 0
    reader = ShardReader()
    for f in files:
        reader.mapping(str(f))
    cached = [reader.is_cached(str(f), lo, lo + 4096, samples=1) for f in files for lo in range(0, 40 * MiB, 4 * MiB)]
    if rate.method.startswith("mapped"):
        assert not any(cached), cached
    else:  # a file system whose pages cannot be dropped first: the direct read, which caches nothing either
        assert rate.method in ("O_DIRECT", "buffered after POSIX_FADV_DONTNEED")


def test_a_server_plans_with_the_measured_rate_only_where_weights_go_to_disk(tmp_path: Path) -> None:
    _shards(tmp_path, [40, 40])
    small = PlanInputs(max_memory={"cpu": "32MiB", "disk": "1GiB"})
    inputs, why = with_disk_rate(PlanInputs(**{**vars(small), "resolved_hardware": small.hardware()}), tmp_path)
    disk = next(d for d in inputs.resolved_hardware.devices if d.id == "disk")
    assert why is not None and "measured on the checkpoint's shards" in why and "env --calibrate" in why
    assert disk.bandwidth == disk.link_bandwidth == inputs.bandwidths["disk"] > 0
    assert disk.bandwidth != small.hardware().devices[-1].bandwidth
    assert f"{min(80 * MiB, PROBE_BYTES) >> 20} MiB" in why

    roomy = PlanInputs(max_memory={"cpu": "1GiB", "disk": "1GiB"})
    same, why = with_disk_rate(PlanInputs(**{**vars(roomy), "resolved_hardware": roomy.hardware()}), tmp_path)
    assert why is None and same.bandwidths is None, "everything fits in memory: no disk tier to measure"

    told = PlanInputs(max_memory={"cpu": "32MiB", "disk": "1GiB"}, bandwidths={"disk": 5e8})
    same, why = with_disk_rate(PlanInputs(**{**vars(told), "resolved_hardware": told.hardware()}), tmp_path)
    assert why is None and same.bandwidths == {"disk": 5e8}, "--bandwidth disk= is the user's: not measured over"


def test_a_streaming_server_measures_its_memory_rate_unless_told(tmp_path: Path) -> None:
    """The resident layers' share of a streamed token is read at this host's measured memory rate, not the
    built-in 80 GB/s; ``--bandwidth cpu=`` is the user's, and a GPU host's CPU rate is not what decode reads at."""
    small = PlanInputs(max_memory={"cpu": "32MiB", "disk": "1GiB"})
    inputs, why = with_memory_rate(PlanInputs(**{**vars(small), "resolved_hardware": small.hardware()}))
    cpu = next(d for d in inputs.resolved_hardware.devices if d.id == "cpu")
    built_in = next(d for d in small.hardware().devices if d.id == "cpu").bandwidth
    assert why is not None and "GB/s, measured" in why and "env --calibrate" in why
    assert cpu.bandwidth == inputs.bandwidths["cpu"] > 1e8 and cpu.bandwidth != built_in

    told = PlanInputs(max_memory={"cpu": "32MiB", "disk": "1GiB"}, bandwidths={"cpu": 7e9})
    same, why = with_memory_rate(PlanInputs(**{**vars(told), "resolved_hardware": told.hardware()}))
    assert why is None and same.bandwidths == {"cpu": 7e9}
