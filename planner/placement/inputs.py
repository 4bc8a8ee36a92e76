"""The planner's first stage: what the user asked for, read once, into typed records.

:class:`PlanInputs` is every planning input besides the model (memory limits, declared GPUs, strategy, dtype,
quantization, batch, context, reserve, bandwidths). The CLI flags and the service's ``LOADMASTER_*`` settings are
text and go through :meth:`PlanInputs.from_text`; ``/plan`` and Python callers hand structured values to the
constructor. Either way the same checks run and the same messages come out.

:func:`resolve_inputs` then turns model + inputs into :class:`ResolvedInputs` (Skeleton, Hardware, Workload and a
checked strategy), which :mod:`planner.placement.solve` consumes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from planner.errors import PlanError
from planner.hardware.device_inventory import build_hardware
from planner.hardware.devices import is_gpu, parse_device
from planner.hardware.units import parse_size
from planner.model.skeleton import load_skeleton
from planner.placement.quantization_choice import choose_quantization
from planner.placement.sizing import normalize_cpu_quantization, normalize_dtype, normalize_quantization
from planner.types import DeviceId, DraftBudget, Hardware, Skeleton, Workload

DEFAULT_CONTEXT = 2048

#: A strategy name, or a custom device map (module name -> device).
Strategy = str | Mapping[str, DeviceId]


def parse_max_memory(entries: list[str] | None) -> dict[str, str] | None:
    """``["0=20GiB,cpu=64GiB", "disk=1TB"]`` (flags, or a comma list from the environment) -> ``{dev: size}``."""
    if not entries:
        return None
    out: dict[str, str] = {}
    for entry in entries:
        for part in entry.split(","):
            if "=" not in part:
                raise PlanError(f"--max-memory {part!r} must look like DEV=SIZE, e.g. 0=20GiB or cpu=64GiB")
            dev, size = part.split("=", 1)
            out[dev.strip()] = size.strip()
    return out


def parse_bandwidths(entries: list[str] | None) -> dict[str, float] | None:
    """``["gpu=3.3TB"]`` -> ``{"gpu": 3.3e12}`` (bytes per second; the units of sizes)."""
    if not entries:
        return None
    out: dict[str, float] = {}
    for entry in entries:
        for part in entry.split(","):
            if "=" not in part:
                raise PlanError(f"--bandwidth {part!r} must look like KIND=RATE, e.g. gpu=3.3TB or disk=2GB")
            kind, rate = part.split("=", 1)
            out[kind.strip()] = float(parse_size(rate.strip().removesuffix("/s")))
    return out


def parse_strategy_text(text: str) -> Strategy:
    """A strategy name, a custom map as JSON, or ``@file.json`` holding one (the CLI's and the settings' form)."""
    text = text.strip()
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text()
        except OSError as e:
            raise PlanError(f"cannot read device map file {path}: {e.strerror}") from None
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"custom device map is not valid JSON ({e.msg} at char {e.pos})") from None
        if not isinstance(value, dict):
            raise PlanError("a custom device map must be a JSON object of module name -> device")
        return value
    return text


def _check_count(label: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{label} must be a whole number, got {value!r}")
    if value < 1:
        raise PlanError(f"{label} must be at least 1, got {value}")


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner is asked besides the model. Structured values; text goes through ``from_text``.

    ``strategy`` is a name or a custom map (module -> device); a JSON string of a map is read as the map.
    ``complete`` lets a custom map leave modules out for the planner to place.
    """

    max_memory: Mapping[Any, Any] | None = None
    gpus: str | list[Any] | tuple[Any, ...] | None = None
    strategy: Strategy = "auto"
    dtype: str | None = None
    quantization: str | None = None
    batch_size: int = 1
    context: int | None = None
    gpu_reserve: int | str | None = None
    offload_folder: str | os.PathLike | None = None
    bandwidths: Mapping[str, float] | None = None
    complete: bool = False
    cpu_quantization: str | None = None
    #: Prompt tokens a forward prefills (the serving engine's chunk), or None for a whole-batch prefill.
    prefill_chunk: int | None = None
    #: The devices, already resolved once: a server measures its box once, so that the choices it makes from one
    #: plan and the plan it loads see the same capacities (the process's footprint grows while it loads).
    resolved_hardware: Hardware | None = None
    #: Speculative decoding's draft model, whose bytes the plan reserves beside the target's
    #: (:mod:`planner.placement.draft_budget`); None without one.
    draft: DraftBudget | None = None

    @classmethod
    def from_text(
        cls,
        *,
        max_memory: list[str] | None = None,
        gpus: str | None = None,
        strategy: str = "auto",
        dtype: str | None = None,
        quantization: str | None = None,
        batch_size: int = 1,
        context: int | None = None,
        gpu_reserve: str | None = None,
        offload_folder: str | None = None,
        bandwidth: list[str] | None = None,
        complete: bool = False,
        cpu_quantization: str | None = None,
        prefill_chunk: int | None = None,
    ) -> PlanInputs:
        """From flags or ``LOADMASTER_*`` settings: ``DEV=SIZE`` and ``KIND=RATE`` entries, a strategy name, JSON
        or ``@file.json``."""
        return cls(
            max_memory=parse_max_memory(max_memory),
            gpus=gpus,
            strategy=parse_strategy_text(strategy),
            dtype=dtype,
            quantization=quantization,
            batch_size=batch_size,
            context=context,
            gpu_reserve=gpu_reserve,
            offload_folder=offload_folder,
            bandwidths=parse_bandwidths(bandwidth),
            complete=complete,
            cpu_quantization=cpu_quantization,
            prefill_chunk=prefill_chunk,
        )

    def hardware(self) -> Hardware:
        """The devices these inputs allow (declared, limited by ``max_memory``, or detected)."""
        if self.resolved_hardware is not None:
            return self.resolved_hardware
        hardware = build_hardware(self.max_memory, self.gpus, self.offload_folder, self.gpu_reserve, self.bandwidths)
        if not hardware.devices:
            raise PlanError("no devices to plan for; give max_memory (e.g. {'cpu': '16GiB'}) or --gpus")
        return hardware

    def on_hardware(self, hardware: Hardware) -> PlanInputs:
        """These inputs as run on ``hardware``: ``quantization="int8"`` with no GPU among its devices is the native
        int8 CPU kernels (:mod:`planner.placement.quantization_choice`)."""
        any_gpu = any(is_gpu(d.id) for d in hardware.devices)
        choice = choose_quantization(self.quantization, self.cpu_quantization, any_gpu, self.dtype)
        return replace(self, quantization=choice.quantization, cpu_quantization=choice.cpu_quantization)

    def workload(self, skeleton: Skeleton) -> Workload:
        return make_workload(
            skeleton,
            self.dtype,
            self.quantization,
            self.batch_size,
            self.context,
            self.cpu_quantization,
            self.prefill_chunk,
            self.draft,
        )

    def checked_strategy(self) -> Strategy:
        """The strategy with a JSON map read and every device of a custom map in its canonical spelling."""
        strategy = self.strategy
        if isinstance(strategy, str) and strategy.strip().startswith("{"):
            strategy = parse_strategy_text(strategy)
        if isinstance(strategy, Mapping):
            return {k: parse_device(v) for k, v in strategy.items()}
        return strategy


@dataclass(frozen=True)
class ResolvedInputs:
    """The three inputs of a plan, resolved: what the solver works on."""

    skeleton: Skeleton
    hardware: Hardware
    workload: Workload
    strategy: Strategy
    complete: bool = False


def resolve_skeleton(model: Any) -> Skeleton:
    """A Skeleton from whatever the caller has: a Skeleton, a model directory, a config.json path or a dict."""
    return model if isinstance(model, Skeleton) else load_skeleton(model)


def make_workload(
    skeleton: Skeleton,
    dtype: str | None = None,
    quantization: str | None = None,
    batch_size: int = 1,
    context: int | None = None,
    cpu_quantization: str | None = None,
    prefill_chunk: int | None = None,
    draft: DraftBudget | None = None,
) -> Workload:
    """The workload to plan for; the dtype defaults to the checkpoint's (fp16 under quantization of fp32, bf16
    under cpu_quantization of fp16).

    ``cpu_quantization`` (the native int8/int4 CPU formats) computes with float32 or bfloat16 activations: a
    float16 run is refused here, as the loader would refuse it. ``prefill_chunk`` is the serving engine's
    (:data:`planner.types.PREFILL_CHUNK`) when the plan is for the server; None budgets a whole-batch prefill."""
    _check_count("batch_size", batch_size)
    _check_count("context", context)
    _check_count("prefill_chunk", prefill_chunk)
    quant = normalize_quantization(quantization)
    cpu_quant = normalize_cpu_quantization(cpu_quantization)
    if quant and cpu_quant:
        raise PlanError(
            f"cpu_quantization={cpu_quant!r} and quantization={quant!r} were both given. quantization= is "
            "bitsandbytes for GPU layers, cpu_quantization= is for CPU and disk layers with no GPU in the map; "
            "pass the one that matches the devices."
        )
    default_dtype = (
        skeleton.default_dtype if skeleton.default_dtype in ("float16", "bfloat16", "float32") else "float32"
    )
    if quant and dtype is None:
        default_dtype = "float16" if default_dtype == "float32" else default_dtype
    if cpu_quant and dtype is None and default_dtype == "float16":
        default_dtype = "bfloat16"  # the native kernels compute in float32 or bfloat16; bfloat16 keeps the range
    run = normalize_dtype(dtype, default_dtype)
    if cpu_quant and run not in ("float32", "bfloat16"):
        raise PlanError(
            f"cpu_quantization={cpu_quant!r} computes with float32 or bfloat16 activations, not {run}: "
            "plan with --dtype bf16 or fp32."
        )
    return Workload(
        dtype=run,
        quantization=quant,
        batch_size=batch_size,
        context=context if context is not None else DEFAULT_CONTEXT,
        cpu_quantization=cpu_quant,
        prefill_chunk=prefill_chunk,
        draft=draft,
    )


def resolve_inputs(model: Any, inputs: PlanInputs, hardware: Hardware | None = None) -> ResolvedInputs:
    """Model + inputs -> Skeleton, Hardware, Workload and strategy. ``hardware`` skips resolving the devices."""
    skeleton = resolve_skeleton(model)
    if hardware is None:
        hardware = inputs.hardware()
    elif not hardware.devices:
        raise PlanError("no devices to plan for; give max_memory (e.g. {'cpu': '16GiB'}) or --gpus")
    workload = inputs.on_hardware(hardware).workload(skeleton)
    gpus = [d.id for d in hardware.devices if is_gpu(d.id)]
    if workload.cpu_quantization and gpus:
        raise PlanError(
            f"cpu_quantization={workload.cpu_quantization!r} is for layers that compute on the CPU, but GPUs "
            f"{', '.join(str(g) for g in gpus)} are among the devices: give --max-memory with only cpu (and disk), "
            "or use --quantization (bitsandbytes) for GPU layers."
        )
    return ResolvedInputs(skeleton, hardware, workload, inputs.checked_strategy(), inputs.complete)
