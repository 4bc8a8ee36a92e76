"""Predicted load time and decode speed of a placement, from a cost model simple enough to state in one line.

Decoding is memory-bound: each step reads every weight once (an embedding reads one row per sequence) and the
whole KV cache. So a step takes, summed over blocks, the bytes each block reads divided by the rate they
reach the computing device:

- a block on a GPU: the GPU's memory bandwidth;
- a block on ``cpu`` while GPUs compute: the host link (PCIe), or host memory if slower;
- a block on ``cpu`` without GPUs: host memory bandwidth;
- a block on ``disk``: host memory (then the link) while the disk share fits in the RAM the plan leaves
  free (a warm page cache), the disk's read bandwidth otherwise;
- KV cache: the bandwidth of the device that holds it.

Load time is the bytes copied out of the checkpoint over the storage read rate, plus the GPU share over the
link. Disk-placed tensors are served from the checkpoint in place, so they cost nothing to load.
"""
from __future__ import annotations

from planner.strategies import Loads, Problem
from planner.devices import device_key
from planner.types import DeviceId, Prediction

COST_MODEL = (
    "decode step = sum over blocks of bytes read per token / bandwidth of where they are read from "
    "(GPU memory; host link for cpu-offloaded blocks; RAM or disk read for disk blocks, warm if the disk share fits "
    "in free RAM) + KV cache / bandwidth of its device; tokens/s = batch / step; "
    "load = non-disk bytes / storage read + GPU bytes / host link"
)


def predict(problem: Problem, assignment: list[DeviceId], loads: Loads, batch_size: int) -> Prediction:
    hw = problem.hardware
    by_id = {d.id: d for d in hw.devices}
    cpu = by_id.get("cpu")
    has_gpu = problem.main_gpu is not None
    disk_bytes = sum(i.weight for i, d in zip(problem.items, assignment) if d == "disk")
    cpu_free = (cpu.capacity - loads.total("cpu")) if cpu else 0
    warm = disk_bytes <= cpu_free

    seconds_by_dev: dict[DeviceId, float] = {}
    rate_of: dict[DeviceId, float] = {}
    for dev_id, dev in by_id.items():
        if isinstance(dev_id, int):
            rate_of[dev_id] = dev.bandwidth
        elif dev_id == "cpu":
            rate_of[dev_id] = dev.link_bandwidth if has_gpu else dev.bandwidth
        elif warm and cpu is not None:
            rate_of[dev_id] = cpu.link_bandwidth if has_gpu else cpu.bandwidth
        else:
            rate_of[dev_id] = dev.bandwidth
    runs = problem.runs_on
    for item, dev in zip(problem.items, assignment):
        seconds_by_dev[dev] = seconds_by_dev.get(dev, 0.0) + item.read_per_token / rate_of[dev]
        if item.kv:
            runs_on = runs[dev]
            seconds_by_dev[runs_on] = seconds_by_dev.get(runs_on, 0.0) + item.kv / by_id[runs_on].bandwidth
    seconds = {device_key(d): v for d, v in seconds_by_dev.items()}
    step = sum(seconds.values())
    tps = batch_size / step if step > 0 else float("inf")

    load = 0.0
    for item, dev in zip(problem.items, assignment):
        if dev == "disk":
            continue
        load += item.weight / hw.storage_bandwidth
        if isinstance(dev, int):
            load += item.weight / hw.link_bandwidth
    return Prediction(
        load_seconds=round(load, 4),
        decode_tokens_per_s=round(tps, 4) if tps != float("inf") else 0.0,
        seconds_per_token_by_device={k: round(v, 6) for k, v in seconds.items()},
        cost_model=COST_MODEL,
    )

