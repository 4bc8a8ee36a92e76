"""The ``loadmaster plan`` and ``loadmaster estimate`` subcommands, and the planner flags ``serve`` shares.

Output is for people (a table with bars) unless ``--json``. Bad input is the CLI's job to turn into exit code
2 with one line; here we only raise the planner's own errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from planner.api import plan_inputs
from planner.errors import PlanError
from planner.hardware.devices import device_label
from planner.hardware.units import format_bytes
from planner.placement.estimate import estimate
from planner.placement.inputs import DEFAULT_CONTEXT, PlanInputs
from planner.placement.speculative_rate import draft_tokens, with_draft_tokens
from planner.types import PREFILL_CHUNK, Plan
from service.model.disk_tier import with_checkpoint_disk
from service.model.positions import model_position_limit, planned_context


def add_planner_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``plan`` and ``serve``: the planner's inputs."""
    g = parser.add_argument_group("planning")
    g.add_argument(
        "--max-memory",
        action="append",
        default=None,
        metavar="DEV=SIZE",
        help="budget for a device, repeatable: 0=20GiB, cuda:1=80GB, cpu=64GiB, disk=500GB",
    )
    g.add_argument(
        "--gpus", default=None, metavar="NxSIZE", help="plan for GPUs that are not here, e.g. 4x24GiB or 2x80GB,1x24GiB"
    )
    g.add_argument(
        "--strategy",
        default="auto",
        help="auto, balanced, balanced_low_0, sequential, or a custom map as JSON or @file.json",
    )
    g.add_argument("--complete", action="store_true", help="let the planner place modules a custom map leaves out")
    g.add_argument("--dtype", default=None, help="fp32, fp16 or bf16 (default: the checkpoint's)")
    g.add_argument("--quantization", default=None, help="bitsandbytes int8, nf4 or fp4")
    g.add_argument(
        "--cpu-quantization",
        default=None,
        help="int8 or int4: weight-only quantization, at load, of the linear layers that compute "
        "on the CPU or stream from disk, sized as the native kernels store them (GPU layers: --quantization)",
    )
    g.add_argument("--batch-size", type=int, default=1, help="sequences generated at once (default 1)")
    g.add_argument("--context", type=int, default=None, help="tokens per sequence, prompt + output (default 2048)")
    g.add_argument(
        "--gpu-reserve", default=None, metavar="SIZE", help="held back per GPU for the CUDA context (default 512MiB)"
    )
    g.add_argument("--offload-folder", default=None, help="folder for disk offload; makes disk usable by the plan")
    g.add_argument(
        "--bandwidth",
        action="append",
        default=None,
        metavar="KIND=RATE",
        help="override a cost-model bandwidth per second, repeatable: gpu=3.3TB, cpu=80GB, link=50GB, disk=7GB",
    )


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """The planner's inputs from parsed flags, read by the one parser the settings and ``/plan`` share. The context
    is capped at the model's positions (a local folder's or config.json's) as ``/plan`` caps it: by default quietly,
    and ``--context`` beyond them is refused, naming both numbers. Like ``serve``, the plan budgets activations
    for the serving engine's step (its prefill chunk)."""
    positions = model_position_limit(args.model) if getattr(args, "model", None) else None
    context = (
        args.context if positions is None else planned_context(args.context, DEFAULT_CONTEXT, positions, "--context")
    )
    return PlanInputs.from_text(
        max_memory=args.max_memory,
        gpus=args.gpus,
        strategy=args.strategy,
        dtype=args.dtype,
        quantization=args.quantization,
        batch_size=args.batch_size,
        context=context,
        gpu_reserve=args.gpu_reserve,
        offload_folder=args.offload_folder,
        bandwidth=args.bandwidth,
        complete=args.complete,
        cpu_quantization=args.cpu_quantization,
        prefill_chunk=PREFILL_CHUNK,
    )


def _bar(fraction: float, width: int = 20) -> str:
    fraction = max(0.0, min(fraction, 1.0))
    full = int(round(fraction * width))
    return "#" * full + "." * (width - full)


def _short(name: str) -> str:
    return name.replace("model.layers.", "layers.").replace("transformer.h.", "h.")


def _compress_runs(device_map: dict[str, Any]) -> list[tuple[str, Any]]:
    """``model.layers.0`` .. ``model.layers.10`` on one device print as ``model.layers.0-10``, for reading only."""
    out: list[tuple[str, Any]] = []
    run: tuple[str, int, int, Any] | None = None  # prefix, first, last, device
    for key, dev in device_map.items():
        prefix, _, index = key.rpartition(".")
        if index.isdigit() and run and run[0] == prefix and run[2] + 1 == int(index) and run[3] == dev:
            run = (prefix, run[1], int(index), dev)
            continue
        if run:
            out.append((f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else ""), run[3]))
            run = None
        if index.isdigit() and prefix:
            run = (prefix, int(index), int(index), dev)
        else:
            out.append((key, dev))
    if run:
        out.append((f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else ""), run[3]))
    return out


def _speculative_lines(plan: Plan) -> list[str]:
    """The plan's speculative prediction, where it has a draft model."""
    p, draft = plan.prediction, plan.workload.draft
    if not p.speculative_tokens_per_s or p.speculative_acceptance is None or draft is None:
        return []
    return [
        f"speculative: {p.speculative_tokens_per_s:.3g} tokens/s for one stream with the draft, if "
        f"{p.speculative_acceptance:.0%} of its {draft.tokens} tokens a pass are accepted (serve's /info "
        "predicts again from the acceptance it measures)"
    ]


def format_plan(plan: Plan) -> str:
    w = plan.workload
    q = f", {w.quantization}" if w.quantization else ""
    q += f", cpu {w.cpu_quantization} (native kernels)" if w.cpu_quantization else ""
    lines = [
        f"Plan for {plan.model}{f' at commit {plan.revision}' if plan.revision else ''} ({plan.architecture}): strategy {plan.strategy}, {w.dtype}{q}, "
        f"batch {w.batch_size} x context {w.context}"
        + (f", activations for a step of {w.step_tokens()} tokens" if w.prefill_chunk else ""),
        "",
        f"{'device':<7} {'blocks':<38} {'weights':>9} {'KV cache':>9} {'activ.':>9} {'reserve':>9} "
        f"{'total':>9} {'capacity':>9}  use",
    ]
    for b in plan.budgets:
        if not b.blocks and b.total == 0:
            span = "-"
        elif not b.blocks:
            span = "(runs offloaded blocks)"
        else:
            span = (
                _short(b.blocks[0])
                if len(b.blocks) == 1
                else f"{_short(b.blocks[0])} .. {_short(b.blocks[-1])} ({len(b.blocks)})"
            )
        frac = b.total / b.capacity if b.capacity else 0.0
        lines.append(
            f"{device_label(b.device):<7} {span[:38]:<38} {format_bytes(b.weights):>9} {format_bytes(b.kv_cache):>9} "
            f"{format_bytes(b.activations):>9} {format_bytes(b.reserve):>9} {format_bytes(b.total):>9} "
            f"{format_bytes(b.capacity):>9}  [{_bar(frac)}] {frac:.0%}"
        )
    p = plan.prediction
    lines += [
        "",
        f"offloaded: {format_bytes(plan.offloaded_bytes)}",
        *(
            f"draft model: {format_bytes(b.draft)} held on {device_label(b.device)} (in its total; why: says the cost)"
            for b in plan.budgets
            if b.draft
        ),
        f"predicted load: {p.load_seconds:.1f} s   decode: {p.decode_tokens_per_s:.3g} tokens/s (batch {w.batch_size})"
        + (
            f", {p.lone_decode_tokens_per_s:.3g} for one stream alone"
            if w.batch_size > 1 and p.lone_decode_tokens_per_s
            else ""
        ),
        *_speculative_lines(plan),
        *(
            ["at once: " + ", ".join(f"{c.sequences} streams {c.tokens_per_s:.3g} tokens/s" for c in p.concurrent)]
            if p.concurrent
            else []
        ),
        f"cost model: {p.cost_model}",
        "",
        "kernels:",
        *(f"  {tier}: {kernel}" for tier, kernel in plan.kernels.items()),
        "",
        "device map:",
    ]
    for k, v in _compress_runs(plan.device_map):
        lines.append(f"  {k or '(whole model)'}: {v}")
    lines.append("")
    lines.append("why:")
    lines += [f"  {r}" for r in plan.reasons]
    if plan.warnings:
        lines.append("warnings:")
        lines += [f"  ! {x}" for x in plan.warnings]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    if args.nodes != 1 or args.micro_batches is not None or args.inter_host_bandwidth is not None:
        from service.cli.cluster_plan_command import cluster_plan_from_args, format_cluster_plan

        if args.speculate != "off" or args.draft_model is not None:
            raise PlanError("--speculate and --draft-model plan a draft beside one host's model; leave out --nodes")
        if args.svg or args.html:
            raise PlanError("--svg and --html draw one host's plan; leave them out with --nodes")
        cluster = cluster_plan_from_args(args, inputs_from_args(args))
        sys.stdout.write((cluster.to_json() if args.json else format_cluster_plan(cluster)) + "\n")
        return 0
    inputs = with_checkpoint_disk(inputs_from_args(args), Path(args.model).expanduser())  # serve's disk tier
    result = plan_inputs(args.model, with_draft(args, inputs))
    result = with_draft_tokens(result, draft_tokens(args.speculate_tokens, result))  # as serve, once planned
    sys.stdout.write((result.to_json() if args.json else format_plan(result)) + "\n")
    write_pictures(result, svg=args.svg, html=args.html)
    return 0


def with_draft(args: argparse.Namespace, inputs: PlanInputs) -> PlanInputs:
    """``serve``'s draft flags on ``plan``: the inputs with room reserved for the draft as ``serve`` reserves it
    (:mod:`planner.placement.draft_budget`), so the plan shows what the draft costs before anything loads. An int4
    or int8 copy is sized from the model's Skeleton; a ``--draft-model`` is planned first, on the same devices."""
    from service.model.draft_copy import DRAFT_SCHEMES, copy_budget

    if args.draft_model is not None and args.speculate != "off":
        raise PlanError(f"--draft-model and --speculate {args.speculate} are two drafts; give one of them")
    if args.speculate in DRAFT_SCHEMES:
        return replace(
            inputs,
            draft=replace(
                copy_budget(args.model, args.speculate, inputs), tokens=draft_tokens(args.speculate_tokens, None)
            ),
        )
    if args.draft_model is None:
        return inputs
    from service.model.draft_model import draft_budget, plan_draft

    path = Path(args.draft_model).expanduser()
    if not path.is_dir():
        raise PlanError(f"--draft-model {str(path)!r} is not a directory; give the draft checkpoint's directory")
    inputs = replace(inputs, resolved_hardware=inputs.hardware())  # the draft and the model on the same devices
    budget = draft_budget(path, plan_draft(path, inputs))
    return replace(inputs, draft=replace(budget, tokens=draft_tokens(args.speculate_tokens, None)))


def write_pictures(result: Plan, svg: str | None, html: str | None) -> None:
    """``--svg``/``--html``: the plan's picture (service.ui.plan_picture), and the web page with it embedded."""
    if svg:
        from service.ui.plan_picture import render_svg

        Path(svg).write_text(render_svg(result), encoding="utf-8")
    if html:
        from service.ui.page import page_html

        Path(html).write_text(page_html(plan=result.to_dict()), encoding="utf-8")


def run_estimate(args: argparse.Namespace) -> int:
    rows = estimate(args.model, batch_size=args.batch_size, context=args.context, gpu_reserve=args.gpu_reserve)
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    first = rows[0]
    out = [
        f"Estimate for {first['model']}: batch {first['batch_size']} x context {first['context']}",
        "",
        f"{'format':<10} {'weights':>10} {'largest block':>14} {'KV cache':>10} {'activations':>12} "
        f"{'min 1 GPU':>10} {'min CPU':>10}",
    ]
    for r in rows:
        out.append(
            f"{r['format']:<10} {format_bytes(r['weights']):>10} {format_bytes(r['largest_block']):>14} "
            f"{format_bytes(r['kv_cache']):>10} {format_bytes(r['activations']):>12} "
            f"{format_bytes(r['min_single_gpu']):>10} {format_bytes(r['min_cpu']):>10}"
        )
    out.append("")
    out.append("min 1 GPU = everything on one GPU, including its reserve; min CPU = everything in RAM, no GPU.")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def register(subparsers: Any) -> None:
    """Add ``plan`` and ``estimate`` to the ``loadmaster`` command line."""
    p = subparsers.add_parser(
        "plan",
        help="plan a device map without loading weights",
        description="Plan where each layer goes, for this machine or for declared hardware.",
    )
    p.add_argument(
        "model",
        help="a model directory (config.json + safetensors), a config.json, or a Hub id "
        "org/name[@revision] (reads config.json and the shard headers only)",
    )
    add_planner_flags(p)
    p.add_argument(
        "--speculate",
        default="off",
        choices=["off", "ngram", "int4", "int8"],
        help="plan room for serve's draft: int4/int8 reserve the model's own quantized copy and its KV (ngram and "
        "off need none)",
    )
    p.add_argument(
        "--speculate-tokens",
        type=int,
        default=None,
        choices=range(1, 17),
        metavar="N",
        help="most draft tokens a verify pass checks, as serve's flag (1-16; default 4, or 8 where the plan streams "
        "the weights): for the speculative prediction",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="DIR",
        help="plan room for serve --draft-model DIR: the draft planned first, resident, and reserved with its KV",
    )
    p.add_argument("--json", action="store_true", help="print the Plan as JSON (what /plan returns)")
    p.add_argument("--svg", default=None, metavar="FILE", help="also write the plan's picture as SVG")
    p.add_argument(
        "--html",
        default=None,
        metavar="FILE",
        help="also write the web page with this plan embedded (works offline, from a file)",
    )
    from service.cli.cluster_plan_command import add_cluster_flags

    add_cluster_flags(p)
    p.set_defaults(func=run_plan)

    e = subparsers.add_parser(
        "estimate", help="model size per dtype/quantization and the smallest memory that serves it"
    )
    e.add_argument("model", help="a model directory, a config.json, or a Hub id org/name[@revision]")
    e.add_argument("--batch-size", type=int, default=1)
    e.add_argument("--context", type=int, default=None)
    e.add_argument("--gpu-reserve", default=None, metavar="SIZE")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=run_estimate)
