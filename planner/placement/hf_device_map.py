"""Device maps in transformers' ``hf_device_map`` format: merging a per-block placement into the shortest
covering prefixes, and reading a user's custom map back into per-block placements.

A key is ``""`` (the whole model), a module path (``model.layers.3``, covering every tensor below it) or a
single tensor name. The most specific key wins, as in transformers.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from planner.errors import PlanError
from planner.hardware.devices import parse_device
from planner.types import DeviceId, Skeleton


def merge_device_map(skeleton: Skeleton, placement: Mapping[str, DeviceId]) -> dict[str, DeviceId]:
    """The shortest set of prefixes that reproduces ``placement`` (block name -> device).

    A module path is emitted when every block below it shares a device; otherwise its children are visited.
    A block that is also the parent of other blocks (a module owning tensors directly and through children)
    falls back to naming its own tensors one by one when its subtree is mixed.
    """
    blocks = {b.name: b for b in skeleton.blocks}
    children: dict[str, dict[str, None]] = {}  # node -> its child nodes, in order (a dict as an ordered set)
    devices_below: dict[str, set[DeviceId]] = {}
    for b in skeleton.blocks:
        dev = placement[b.name]
        node = ""
        devices_below.setdefault("", set()).add(dev)
        for part in b.name.split(".") if b.name else ():
            child = f"{node}.{part}" if node else part
            children.setdefault(node, {})[child] = None
            devices_below.setdefault(child, set()).add(dev)
            node = child
    out: dict[str, DeviceId] = {}

    def visit(node: str) -> None:
        devs = devices_below.get(node, set())
        if len(devs) == 1:
            out[node] = next(iter(devs))
            return
        if node in blocks:
            own = blocks[node]
            for t in own.tensors:
                out[t.name] = placement[node]
        for child in children.get(node, []):
            visit(child)

    visit("")
    return out


def _prefixes(skeleton: Skeleton) -> set[str]:
    names = {""}
    for b in skeleton.blocks:
        parts = b.name.split(".") if b.name else []
        for i in range(1, len(parts) + 1):
            names.add(".".join(parts[:i]))
    return names


def _covers(key: str, name: str) -> bool:
    return key == "" or name == key or name.startswith(key + ".")


def covering_key(name: str, keys: Iterable[str]) -> str | None:
    """The device-map key that places ``name``: its longest covering prefix (the most specific key wins)."""
    best = None
    for k in keys:
        if _covers(k, name) and (best is None or len(k) > len(best)):
            best = k
    return best


def check_device_map(device_map: Mapping[str, Any], known: Collection[str]) -> dict[str, DeviceId]:
    """A user's map with every device read through :func:`planner.hardware.devices.parse_device`, once each key is found to be a
    name of this model (``known``: module paths and tensor names). Unknown names raise, suggesting the nearest."""
    if not isinstance(device_map, Mapping):
        raise PlanError(f"a custom device map must be a dict of module name -> device; got {type(device_map).__name__}")
    keys: dict[str, DeviceId] = {}
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise PlanError(f"device map key {key!r} must be a module or tensor name (a string)")
        if key != "" and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise PlanError(
                f"device map names {key!r}, which is not a module or tensor of this model{hint} "
                "(names are those of model.named_modules() and model.named_parameters())"
            )
        try:
            keys[key] = parse_device(value)
        except PlanError as e:
            raise PlanError(f"device map entry {key!r}: {e}") from None
    return keys


def assign_devices(
    names: Iterable[str], device_map: Mapping[str, Any], module_names: Iterable[str] = ()
) -> dict[str, DeviceId]:
    """The device of every tensor name, by the longest covering key: the one validator of a map, tensor by tensor.

    ``module_names`` adds module paths that own no tensors (a map may name them). Unknown keys and tensors that no
    key covers raise :class:`PlanError`.
    """
    names = list(names)
    known = set(module_names) | set(names)
    for n in names:  # every ancestor prefix of a tensor is a valid map key
        pos = n.find(".")
        while pos > 0:
            known.add(n[:pos])
            pos = n.find(".", pos + 1)
    keys = check_device_map(device_map, known)
    by_len = sorted(keys, key=len, reverse=True)
    out: dict[str, DeviceId] = {}
    uncovered = []
    for n in names:
        for k in by_len:
            if _covers(k, n):
                out[n] = keys[k]
                break
        else:
            uncovered.append(n)
    if uncovered:
        shown = ", ".join(uncovered[:10]) + (f", ... ({len(uncovered) - 10} more)" if len(uncovered) > 10 else "")
        raise PlanError(
            f"device map leaves {len(uncovered)} tensor(s) without a device: {shown}; "
            "add entries for them (or a '' entry for everything not named)"
        )
    return out


def check_tied_groups(tied_groups: Iterable[tuple[str, ...]], device_of: Callable[[str], DeviceId | None]) -> None:
    """Tied weights share one tensor, so every name of a group must be placed on one device."""
    for group in tied_groups:
        devs = {d for d in map(device_of, group) if d is not None}
        if len(devs) > 1:
            raise PlanError(
                f"tied weights {', '.join(group)} share one tensor but the map puts them on "
                f"{sorted(map(str, devs))}; put them on one device"
            )


def resolve_custom_map(
    skeleton: Skeleton, device_map: Mapping[str, Any], complete: bool = False
) -> dict[str, DeviceId]:
    """Per-block devices from a user's map. Unknown names, split no-split blocks, split tied groups and (unless
    ``complete``) uncovered tensors are errors. Blocks left uncovered with ``complete`` are simply absent from
    the result, for the planner to place."""
    tensor_names = {t.name for b in skeleton.blocks for t in b.tensors}
    aliases = {name for group in skeleton.tied_groups for name in group}
    keys = check_device_map(device_map, _prefixes(skeleton) | tensor_names | aliases)
    ordered = sorted(keys, key=len, reverse=True)  # most specific first

    def device_of(name: str) -> DeviceId | None:
        for k in ordered:
            if _covers(k, name):
                return keys[k]
        return None

    placement: dict[str, DeviceId] = {}
    uncovered: list[str] = []
    for b in skeleton.blocks:
        names = [t.name for t in b.tensors] or [b.name]
        devs = {device_of(n) for n in names}
        if None in devs and len(devs) > 1:
            missing = [n for n in names if device_of(n) is None]
            raise PlanError(
                f"device map covers only part of module {b.name!r}: {', '.join(missing[:5])} have no device; "
                f"place the module itself (e.g. {{{b.name!r}: 0}})"
            )
        if devs == {None}:
            uncovered.append(b.name)
            continue
        if len(devs) > 1:
            kind = "a no-split module" if b.no_split else "one module"
            raise PlanError(
                f"device map splits {kind} {b.name!r} across devices {sorted(map(str, devs))}; "
                f"its tensors must stay together: map {b.name!r} as a whole"
            )
        placement[b.name] = devs.pop()  # type: ignore[assignment]
    if uncovered and not complete:
        shown = ", ".join(repr(n) for n in uncovered[:5]) + (" ..." if len(uncovered) > 5 else "")
        raise PlanError(
            f"device map leaves {len(uncovered)} module(s) without a device: {shown}; "
            "map them, add a catch-all such as {'': 'cpu'}, or ask the planner to complete the map (complete=True)"
        )
    owner = skeleton.block_of_tensor()
    check_tied_groups(skeleton.tied_groups, lambda n: placement.get(owner[n]) if n in owner else device_of(n))
    return placement
