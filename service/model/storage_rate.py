"""The disk tier's read rate a server plans with when the machine has no calibration: measured on the shards.

The cost model predicts a disk-bound decode as the disk's read rate over the bytes each token streams. Its built-in
rate is a generic NVMe figure; ``loadmaster env --calibrate`` replaces it with this machine's. A server that would
stream weights from disk and has neither a calibration nor ``--bandwidth disk=`` reads the first
:data:`PROBE_BYTES` of its last shards the way it will stream them, through their maps with readahead
(:func:`loaders.checkpoint.disk_rate.streamed_read_rate`), and plans with that rate: about 0.3-0.5 s of its
start, and the prediction in ``/info`` then speaks of this disk as the server reads it. Measured once per process
and checkpoint.

Why not ``O_DIRECT`` (the device's rate, :func:`~loaders.checkpoint.disk_rate.cold_read_rate`): on a virtual disk
one direct request at a time read 0.7-1.1 GB/s while the server streamed the same shards at 1.3-1.8 GB/s, so the
prediction was off by 40% on a quiet disk.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

from loaders.checkpoint.disk_rate import DiskRate, streamed_read_rate
from loaders.run.memory_rate import memory_read
from planner.hardware.calibration import load_calibration
from planner.placement.inputs import PlanInputs

#: Bytes the probe reads: enough for a virtual disk's rate to settle (a burst from its host's cache averages out),
#: little enough to cost a fraction of a second.
PROBE_BYTES = 512 << 20
#: Bytes of RAM the memory probe sums (about 0.1-0.2 s on 2 cores): past the CPU's caches, small beside a box.
MEMORY_PROBE_BYTES = 128 << 20


def with_disk_rate(inputs: PlanInputs, path: Path) -> tuple[PlanInputs, str | None]:
    """``inputs`` (with ``resolved_hardware``) whose disk device reads at the rate measured on ``path``'s shards,
    and the reason to give; unchanged (None) where the rate is known or no weight can go to disk."""
    hardware = inputs.resolved_hardware
    if hardware is None or (inputs.bandwidths or {}).get("disk") or load_calibration() is not None:
        return inputs, None
    disk = next((d for d in hardware.devices if d.id == "disk"), None)
    shards = [(str(f), st.st_size, st.st_mtime_ns) for f in sorted(path.glob("*.safetensors")) for st in [f.stat()]]
    memory = sum(d.capacity for d in hardware.devices if d.id != "disk")
    if disk is None or not shards or sum(size for _, size, _ in shards) <= memory:
        return inputs, None
    rate = _probe(tuple(reversed(shards)))
    if rate.bytes_per_s <= 0:
        return inputs, None
    devices = tuple(
        replace(d, bandwidth=rate.bytes_per_s, link_bandwidth=rate.bytes_per_s) if d.id == "disk" else d
        for d in hardware.devices
    )
    hardware = replace(hardware, devices=devices, storage_bandwidth=rate.bytes_per_s)
    why = (
        f"disk read at {rate.bytes_per_s / 1e9:.2f} GB/s, measured on the checkpoint's shards ({rate.method}, "
        f"{rate.bytes_read >> 20} MiB in {rate.seconds:.2f} s): no calibration of this machine "
        "(loadmaster env --calibrate records one)"
    )
    bandwidths = {**(inputs.bandwidths or {}), "disk": rate.bytes_per_s}
    return replace(inputs, resolved_hardware=hardware, bandwidths=bandwidths), why


@functools.lru_cache(maxsize=8)
def _probe(files: tuple[tuple[str, int, int], ...]) -> DiskRate:
    """The measured rate, once per set of shards (their size and mtime in the key: a rewritten file is measured
    again)."""
    return streamed_read_rate([Path(name) for name, _, _ in files], PROBE_BYTES)


def with_memory_rate(inputs: PlanInputs) -> tuple[PlanInputs, str | None]:
    """``inputs`` whose CPU reads its resident weights at this host's measured memory rate, and the reason to
    give; unchanged (None) where a GPU computes, a calibration or ``--bandwidth cpu=`` gives the rate.

    Called where :func:`with_disk_rate` measured the disk: once the disk is a measured figure, the resident layers'
    share of a token (a fifth of it in a 3 GiB box for the 1B fp32 Llama) is what the built-in 80 GB/s left out."""
    hardware = inputs.resolved_hardware
    if hardware is None or (inputs.bandwidths or {}).get("cpu") or load_calibration() is not None:
        return inputs, None
    if any(isinstance(d.id, int) for d in hardware.devices) or not any(d.id == "cpu" for d in hardware.devices):
        return inputs, None
    rate = _memory_probe()
    devices = tuple(replace(d, bandwidth=rate) if d.id == "cpu" else d for d in hardware.devices)
    why = (
        f"cpu reads resident weights at {rate / 1e9:.1f} GB/s, measured ({MEMORY_PROBE_BYTES >> 20} MiB summed): "
        "no calibration of this machine (loadmaster env --calibrate records one)"
    )
    bandwidths = {**(inputs.bandwidths or {}), "cpu": rate}
    return replace(inputs, resolved_hardware=replace(hardware, devices=devices), bandwidths=bandwidths), why


@functools.lru_cache(maxsize=1)
def _memory_probe() -> float:
    """Measured once per process."""
    return memory_read(MEMORY_PROBE_BYTES, repeats=3)
