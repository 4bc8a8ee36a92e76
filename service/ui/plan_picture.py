"""The picture of a plan, as one standalone SVG: the only renderer, used by ``loadmaster plan --svg/--html`` and
by the web page (which asks the server for it at ``POST /ui/picture``), so the CLI and the page never disagree.

What it draws, top to bottom:

- one bar per device, stacked by weights, KV cache, activations and reserve against the device's capacity;
- the layers as a strip of blocks in execution order (one ``<rect class="layer">`` per placed block), each
  coloured by its device, with a mark at every hop (where the next block lives on another device);
- the predicted load time and decode rate, and a legend.

Its ``<title>``/``<desc>`` carry a text alternative (:func:`describe`), so a screen reader reads the plan.
Plain string building on purpose: this module imports nothing beyond the standard library and the planner's
types, because ``loadmaster plan --svg`` must stay fast to start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

from planner.hardware.devices import device_label
from planner.hardware.units import format_bytes
from planner.types import DeviceBudget, DeviceId, Plan

#: Fill colours of the bar segments, in stacking order.
SEGMENTS: tuple[tuple[str, str, str], ...] = (
    ("weights", "weights", "#555f6e"),
    ("kv_cache", "KV cache", "#f58518"),
    ("activations", "activations", "#54a24b"),
    ("reserve", "reserve", "#9d9d9d"),
)
#: GPU colours, by index (cycled); ``cpu`` and ``disk`` have their own, distinct from every GPU's.
GPU_COLOURS = ("#2f7ed8", "#8e44ad", "#16a085", "#d35400", "#c0392b", "#2c3e50", "#27ae60", "#b7950b")
CPU_COLOUR = "#e6a700"
DISK_COLOUR = "#7f4f24"

WIDTH = 960
MARGIN = 16
LABEL_W = 70
BAR_H = 22
ROW_GAP = 10


def device_colour(device: DeviceId) -> str:
    """The one colour a device is drawn in, everywhere (bars' labels, layer blocks, legend, the page)."""
    if isinstance(device, int):
        return GPU_COLOURS[device % len(GPU_COLOURS)]
    return {"cpu": CPU_COLOUR, "disk": DISK_COLOUR}.get(str(device), "#666666")


@dataclass(frozen=True)
class LayerBlock:
    """One placed block of the strip: its module name, device, and decoder-layer index when it is one."""

    name: str
    device: DeviceId
    layer: int | None


def layer_blocks(plan: Plan) -> list[LayerBlock]:
    """The plan's blocks in execution order (its unmerged placement, else its device map)."""
    placement = plan.placement or plan.device_map
    out = []
    for name, dev in placement.items():
        tail = name.rpartition(".")[2]
        out.append(LayerBlock(name=name, device=dev, layer=int(tail) if tail.isdigit() else None))
    return out


def hops(blocks: list[LayerBlock]) -> list[int]:
    """Indices ``i`` where block ``i`` runs on another device than block ``i - 1`` (activations move there)."""
    return [i for i in range(1, len(blocks)) if blocks[i].device != blocks[i - 1].device]


def describe(plan: Plan) -> str:
    """The plan in a few sentences: the text alternative of the picture."""
    w = plan.workload
    parts = [
        f"Plan for {plan.model} ({plan.architecture}), strategy {plan.strategy}, {w.dtype}"
        + (f" {w.quantization}" if w.quantization else "")
        + f", batch {w.batch_size} x context {w.context}."
    ]
    for b in plan.budgets:
        parts.append(
            f"{device_label(b.device)}: {format_bytes(b.total)} of {format_bytes(b.capacity)} "
            f"(weights {format_bytes(b.weights)}, KV cache {format_bytes(b.kv_cache)}, "
            f"activations {format_bytes(b.activations)}, reserve {format_bytes(b.reserve)}"
            + (f", draft model {format_bytes(b.draft)}" if b.draft else "")
            + f"); {len(b.blocks)} blocks."
        )
    blocks = layer_blocks(plan)
    parts.append(f"{len(blocks)} blocks, {len(hops(blocks))} hops between devices.")
    p = plan.prediction
    parts.append(f"Predicted load {p.load_seconds:.1f} s, decode {p.decode_tokens_per_s:.3g} tokens/s.")
    return " ".join(parts)


def _text(
    x: float, y: float, s: str, size: int = 12, anchor: str = "start", weight: str = "normal", cls: str = ""
) -> str:
    c = f' class="{cls}"' if cls else ""
    # A white halo keeps the text readable where it overlaps a coloured segment.
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}"{c} '
        'paint-order="stroke" stroke="#ffffff" stroke-width="3" stroke-linejoin="round">'
        f"{escape(s)}</text>"
    )


@dataclass
class _Drawing:
    """The SVG elements drawn so far, top to bottom, and ``y``: where the next row starts. Each section of the
    picture is a function that appends its elements and moves ``y`` down, so the sections read one at a time."""

    parts: list[str] = field(default_factory=list)
    y: int = MARGIN


def render_svg(plan: Plan) -> str:
    """The plan as a standalone SVG document (UTF-8 text, no external references)."""
    drawing = _Drawing()
    _draw_heading(drawing, plan)
    for b in plan.budgets:
        _draw_device_bar(drawing, b)
    _draw_layer_strip(drawing, layer_blocks(plan))
    _draw_prediction(drawing, plan)
    _draw_legend(drawing, plan)
    return _document(plan, drawing.parts, height=drawing.y + MARGIN)


def _draw_heading(drawing: _Drawing, plan: Plan) -> None:
    """The model, strategy and workload the plan is for, in bold, on the first line."""
    w = plan.workload
    drawing.y += 14
    drawing.parts.append(
        _text(
            MARGIN,
            drawing.y,
            f"{plan.model}: {plan.strategy}, {w.dtype}"
            + (f" {w.quantization}" if w.quantization else "")
            + f", batch {w.batch_size} x context {w.context}",
            15,
            weight="bold",
        )
    )
    drawing.y += 14


def _draw_device_bar(drawing: _Drawing, b: DeviceBudget) -> None:
    """One device's row: its colour and name, its capacity as a grey bar, the planned bytes stacked on it by kind
    (clipped at the capacity), and the total against the capacity at the right end."""
    drawing.y += ROW_GAP
    y, out = drawing.y, drawing.parts
    inner = WIDTH - 2 * MARGIN - LABEL_W
    x0 = MARGIN + LABEL_W
    dev = escape(str(b.device))
    out.append(f'<g class="device-bar" data-device="{dev}" data-capacity="{b.capacity}" data-total="{b.total}">')
    out.append(f'<rect x="{MARGIN}" y="{y}" width="10" height="{BAR_H}" fill="{device_colour(b.device)}"/>')
    out.append(_text(MARGIN + 14, y + BAR_H - 6, device_label(b.device), 12, weight="bold"))
    out.append(
        f'<rect class="capacity" x="{x0}" y="{y}" width="{inner}" height="{BAR_H}" fill="#f2f2f2" stroke="#888"/>'
    )
    x = float(x0)
    scale = inner / b.capacity if b.capacity > 0 else 0.0
    for key, label, colour in SEGMENTS:
        value = int(getattr(b, key))
        width = min(value * scale, x0 + inner - x)
        if value <= 0 or width <= 0:
            continue
        out.append(
            f'<rect class="segment" data-kind="{key}" data-bytes="{value}" x="{x:.2f}" y="{y}" '
            f'width="{width:.2f}" height="{BAR_H}" fill="{colour}"><title>{escape(device_label(b.device))} '
            f"{label}: {format_bytes(value)}</title></rect>"
        )
        x += width
    frac = b.total / b.capacity if b.capacity else 0.0
    out.append(
        _text(
            x0 + inner - 4,
            y + BAR_H - 6,
            f"{format_bytes(b.total)} / {format_bytes(b.capacity)} ({frac:.0%})",
            11,
            anchor="end",
        )
    )
    out.append("</g>")
    drawing.y += BAR_H


def _draw_layer_strip(drawing: _Drawing, blocks: list[LayerBlock]) -> None:
    """The blocks in execution order across the full width, each in its device's colour, with a red mark under
    every hop: where the activations move to another device."""
    out = drawing.parts
    drawing.y += ROW_GAP + 18
    out.append(
        _text(
            MARGIN,
            drawing.y,
            f"layers in execution order ({len(blocks)} blocks, {len(hops(blocks))} hops)",
            12,
            weight="bold",
        )
    )
    drawing.y += 8
    y = drawing.y
    strip_w = WIDTH - 2 * MARGIN
    cell = strip_w / max(len(blocks), 1)
    gap = 1.0 if cell > 3 else 0.0
    out.append('<g class="layer-strip">')
    for i, blk in enumerate(blocks):
        layer = f' data-layer="{blk.layer}"' if blk.layer is not None else ""
        out.append(
            f'<rect class="layer" data-name="{escape(blk.name)}" data-device="{escape(str(blk.device))}"{layer} '
            f'x="{MARGIN + i * cell:.2f}" y="{y}" width="{max(cell - gap, 0.5):.2f}" height="26" '
            f'fill="{device_colour(blk.device)}"><title>{escape(blk.name)} on {escape(device_label(blk.device))}'
            f"</title></rect>"
        )
    for i in hops(blocks):
        hx = MARGIN + i * cell
        out.append(
            f'<path class="hop" data-index="{i}" d="M{hx - 5:.2f},{y + 34} L{hx + 5:.2f},{y + 34} '
            f'L{hx:.2f},{y + 27} Z" fill="#d62728"><title>hop: {escape(blocks[i - 1].name)} -&gt; '
            f"{escape(blocks[i].name)}</title></path>"
        )
    out.append("</g>")
    drawing.y += 26 + 24


def _draw_prediction(drawing: _Drawing, plan: Plan) -> None:
    """The cost model's headline figures: load time, decode rate at the plan's batch, and what is offloaded."""
    p = plan.prediction
    drawing.parts.append(
        _text(
            MARGIN,
            drawing.y,
            f"predicted load {p.load_seconds:.1f} s; decode {p.decode_tokens_per_s:.3g} tokens/s "
            f"(batch {plan.workload.batch_size}); offloaded {format_bytes(plan.offloaded_bytes)}",
            12,
            cls="prediction",
        )
    )
    drawing.y += 20


def _draw_legend(drawing: _Drawing, plan: Plan) -> None:
    """One swatch per device, per bar segment and for the hop mark, on one line (the last row of the picture)."""
    y, out = drawing.y, drawing.parts
    x = float(MARGIN)
    legend: list[tuple[str, str]] = [(device_label(b.device), device_colour(b.device)) for b in plan.budgets]
    legend += [(label, colour) for _, label, colour in SEGMENTS]
    legend.append(("hop", "#d62728"))
    out.append('<g class="legend">')
    for label, colour in legend:
        out.append(f'<rect x="{x:.1f}" y="{y - 10}" width="12" height="12" fill="{colour}"/>')
        out.append(_text(x + 16, y, label, 11))
        x += 28 + 7 * len(label)
    out.append("</g>")


def _document(plan: Plan, parts: list[str], height: int) -> str:
    """The drawn parts in an ``<svg>`` of the full height on a white ground, titled and described for screen
    readers (:func:`describe`)."""
    text_alt = escape(describe(plan))
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="plan-picture" viewBox="0 0 {WIDTH} {height}" '
        f'width="{WIDTH}" height="{height}" role="img" aria-labelledby="plan-title plan-desc" '
        f'font-family="system-ui, sans-serif">'
        f'<title id="plan-title">Device plan for {escape(plan.model)}</title><desc id="plan-desc">{text_alt}</desc>'
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>'
    )
    return head + "".join(parts) + "</svg>\n"


def render_svg_dict(plan: dict[str, Any]) -> str:
    """:func:`render_svg` for a Plan as JSON (what ``/plan`` and ``/info`` answer)."""
    return render_svg(Plan.from_dict(plan))
