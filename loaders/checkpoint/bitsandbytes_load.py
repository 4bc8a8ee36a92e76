"""Loading with bitsandbytes quantization (int8, nf4, fp4), through transformers' own integration.

bitsandbytes replaces each linear layer with its quantized module and quantizes weights as they arrive; that
machinery lives in transformers' ``from_pretrained``, so quantized loads go through it with our device map
rather than re-implementing bitsandbytes' parameter classes. The checkpoint has already been validated by the
caller. bitsandbytes modules cannot be served from disk, so a map that sends any module to ``"disk"`` is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from loaders.checkpoint.load_progress import LoadProgress, LoadStats, peak_rss_bytes
from planner.errors import PlanError
from planner.hardware.devices import parse_device, torch_device_name
from planner.types import DeviceId

log = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "nf4", "fp4")


def bnb_config(quantization: str, compute_dtype: torch.dtype, cpu_offload: bool = False):
    """``cpu_offload``: GPUs compute and some modules sit on the CPU, which then stay unquantized (fp32)."""
    from transformers import BitsAndBytesConfig

    q = quantization.lower()
    if q in ("int8", "8bit", "llm_int8"):
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=cpu_offload)
    if q in ("nf4", "fp4"):
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=q,
            bnb_4bit_compute_dtype=compute_dtype,
            llm_int8_enable_fp32_cpu_offload=cpu_offload,
        )
    raise PlanError(f"Unknown quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)}.")


def load_quantized(
    path: Path,
    device_map: Mapping[str, DeviceId],
    dtype: torch.dtype,
    quantization: str,
    *,
    progress: Callable[[LoadProgress], None] | None = None,
    t0: float,
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    gpus = any(isinstance(v, int) for v in device_map.values())
    cpu_offload = gpus and any(v == "cpu" for v in device_map.values())
    config = bnb_config(quantization, dtype, cpu_offload)
    disk = sorted(k for k, v in device_map.items() if v == "disk")
    if disk:
        raise PlanError(
            f"bitsandbytes-quantized modules cannot be offloaded to disk ({', '.join(disk[:5])}). "
            "Give the CPU more memory, or load without quantization to use disk offload."
        )
    hf_map = {k: (v if isinstance(v, int) else "cpu") for k, v in device_map.items()}
    if progress is not None:
        progress(LoadProgress(0, 1, "loading"))
    model = AutoModelForCausalLM.from_pretrained(
        str(path), quantization_config=config, dtype=dtype, device_map=hf_map, local_files_only=True
    )
    model.eval()
    stats = LoadStats()
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        dev = torch_device_name(parse_device(t.device))
        stats.bytes_per_device[dev] = stats.bytes_per_device.get(dev, 0) + t.numel() * t.element_size()
    for m in model.modules():  # int8 row scales (SCB) and 4-bit absmax live beside the weight, not as parameters
        w = getattr(m, "weight", None)
        qs = getattr(w, "quant_state", None)
        qs_tensors = (getattr(qs, "absmax", None), getattr(qs, "code", None)) if qs is not None else ()
        for extra in (getattr(w, "SCB", None), *qs_tensors):
            if isinstance(extra, torch.Tensor) and id(extra) not in seen:
                seen.add(id(extra))
                dev = torch_device_name(parse_device(extra.device))
                stats.bytes_per_device[dev] = stats.bytes_per_device.get(dev, 0) + extra.numel() * extra.element_size()
    stats.seconds = time.perf_counter() - t0
    stats.peak_rss_bytes = peak_rss_bytes()
    model.hf_device_map = dict(device_map)
    model.load_stats = stats
    if progress is not None:
        progress(LoadProgress(1, 1, "ready"))
    return model
