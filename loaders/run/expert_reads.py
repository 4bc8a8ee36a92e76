"""Routed experts on disk, read per hit expert: a MoE layer streamed from disk on a host without GPUs reads only
the experts its tokens were sent to, not all of them.

A decode step of one sequence uses ``k`` of a MoE layer's ``E`` experts (4 of 32 in gpt-oss-20b: an eighth of its
expert bytes). The block readahead (:mod:`loaders.run.readahead`) reads whole blocks, so a disk layer read all
``E`` every step. Here the experts' tensors are left out of the block's ranges, and a forward pre-hook on the
experts module, which receives the router's choice, maps in each hit expert's slice of each fused tensor
(``[E, ...]``: expert ``e`` is bytes ``[start + e*s, start + (e+1)*s)`` of the tensor's range) before the products
run: one ``MADV_WILLNEED`` for all of them first, so the disk has every read queued, then one
``MADV_POPULATE_READ`` each. Where the disk share outgrows the page cache (``drop_behind``, as for blocks), the
slices are given back once the experts have computed.

The reads cannot overlap the layer's own compute (the router decides them), only the other blocks' readahead; the
planner's cost model reads a disk MoE layer's touched experts per step (:mod:`planner.placement.cost_model`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertTensorRange:
    """One fused experts tensor on disk (``tensor``, its name): its shard, first byte, and bytes per expert."""

    tensor: str
    path: str
    start: int
    per_expert: int


def _router_indices(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The experts forward's routing choice: transformers' experts take ``(hidden_states, top_k_index, weights)``
    (gpt-oss's ``router_indices``)."""
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        return args[1]
    for key in ("top_k_index", "router_indices"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return None


class SparseExpertReads:
    """Forward hooks that read a disk experts module's hit experts, and (``drop_behind``) give them back after."""

    def __init__(self, reader, modules: Mapping[str, tuple[int, list[ExpertTensorRange]]], drop_behind: bool):
        self.reader = reader
        #: experts module name -> (number of experts, its fused tensors' ranges)
        self.modules = dict(modules)
        self.drop_behind = drop_behind
        self.handles: list = []
        #: Bytes asked for so far (the hit experts' slices), for tests and the log.
        self.bytes_read = 0

    def install(self, model: torch.nn.Module) -> None:
        for name, (experts, ranges) in self.modules.items():
            mod = model.get_submodule(name)
            self.handles.append(mod.register_forward_pre_hook(self._before(experts, ranges), with_kwargs=True))
            if self.drop_behind:
                self.handles.append(mod.register_forward_hook(self._give_back))

    @staticmethod
    def _slices(ranges: list[ExpertTensorRange], hit: list[int]) -> list[tuple[str, int, int]]:
        return [(r.path, r.start + e * r.per_expert, r.start + (e + 1) * r.per_expert) for r in ranges for e in hit]

    def _before(self, experts: int, ranges: list[ExpertTensorRange]):
        def read_hit_experts(module, args, kwargs):
            idx = _router_indices(args, kwargs)
            hit = list(range(experts)) if idx is None else [e for e in torch.unique(idx).tolist() if 0 <= e < experts]
            slices = self._slices(ranges, hit)
            module._loadmaster_read_slices = slices
            try:
                for path, start, end in slices:
                    self.reader.advise_willneed(path, start, end)
                for path, start, end in slices:
                    self.reader.make_resident(path, start, end)
            except (OSError, ValueError):  # best effort: the products fault in whatever is missing
                log.debug("reading hit experts ahead failed; their pages will be faulted in", exc_info=True)
            self.bytes_read += sum(end - start for _, start, end in slices)
            return None

        return read_hit_experts

    def _give_back(self, module, args, output) -> None:
        """After the experts computed (``drop_behind``): unmap and drop the slices the pre-hook read."""
        for path, start, end in getattr(module, "_loadmaster_read_slices", ()):
            self.reader.drop_mapped(path, start, end)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def disk_experts(
    model: torch.nn.Module, disk_ranges: Mapping[str, tuple[str, int, int]]
) -> dict[str, tuple[int, list[ExpertTensorRange]]]:
    """The routed-experts modules whose fused tensors are all on disk, with those tensors' per-expert ranges: a
    module named ``*.experts`` with ``num_experts``, every 3-D or larger tensor of which with ``E`` leading rows
    (the fused matrices, MXFP4 blocks and scales) has a disk range that splits into ``E`` equal slices (its other
    tensors, such as biases, are read with the block)."""
    out: dict[str, tuple[int, list[ExpertTensorRange]]] = {}
    for name, mod in model.named_modules():
        experts = getattr(mod, "num_experts", None)
        if not name.endswith(".experts") or not isinstance(experts, int) or experts < 2:
            continue
        ranges, whole = [], True
        for leaf, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if t.dim() < 3 or t.shape[0] != experts:  # a per-expert bias ([E, N]) is small: read with the block
                continue
            where = disk_ranges.get(f"{name}.{leaf}")
            if where is None or (where[2] - where[1]) % experts:
                whole = False
                break
            ranges.append(ExpertTensorRange(f"{name}.{leaf}", where[0], where[1], (where[2] - where[1]) // experts))
        if whole and ranges:
            out[name] = (experts, ranges)
    return out
