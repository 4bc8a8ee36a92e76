"""The engine's KV cache: one preallocated slot per running sequence, on the device of each layer.

Each attention layer owns a keys and a values tensor ``[slots, kv_heads, capacity, head_dim]``, created on the first
write with the device and dtype the layer computes in (so a layer on GPU 0, the CPU or streamed from disk keeps its
cache where it runs). A sequence holds one slot from admission to its end: joining writes its prompt's KV into
its slot, leaving frees the slot, and nothing else moves; no cache is concatenated or re-indexed between steps.

The storage grows in both dimensions by doubling: its capacity (tokens per slot) when a longer sequence needs it,
up to ``max_len``, and the slots it holds when a higher slot is first used, up to ``slots``. So memory follows the
longest sequence and the concurrency actually served rather than the most allowed; growth copies the cache, which
happens at most log2(max_len) + log2(slots) times between two resets. The scheduler keeps slots × capacity within
the plan's KV budget (:meth:`SlotKVCache.storage_tokens`): a box whose plan holds two sequences of the full context
can run sixteen short ones at once, and drops the storage (:meth:`SlotKVCache.reset`) when idle to seat a longer one.

A forward does not bind the cache itself: it gets a :class:`BoundSlotCache`, a light transformers ``Cache`` that
shares the storage and holds its own binding (which slots take part and where each row's new tokens go), made by
:meth:`SlotKVCache.bound` or :meth:`SlotKVCache.bound_packed`. So several forwards can be in flight at once, each
with its own rows (the micro-batches of :mod:`service.engine.multi_gpu_runner`, one on each device run), as long as
they write different slots. A binding has one of two layouts:

- **batched** (rows of equal width, e.g. a decode step): :meth:`BoundSlotCache.update` (what every transformers
  attention layer calls) writes the new keys and values there and returns the rows' keys and values up to the
  longest row's length; the runner's mask hides, per row, what lies beyond that row's own length. When the rows are
  consecutive slots (the usual case: slots are handed out lowest first) the returned tensors are views; otherwise
  they are gathered.
- **packed** (rows of different widths, e.g. decode rows next to a prefill chunk): the rows' tokens are laid end to
  end as one sequence of batch 1, so no row is padded to another's width; ``update`` writes each token at its own
  (slot, position) and returns every row's keys up to its own length, laid end to end the same way. The runner's
  block-diagonal mask keeps each row to its own keys.

Storage grows only when a bound view is made (on the engine's thread, before the forward starts), never inside a
forward, so views in flight never see the storage replaced under them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

#: Smallest capacity a layer's storage starts at (tokens per slot).
MIN_CAPACITY = 64


@dataclass
class BatchedBinding:
    """The rows of one forward in the batched layout: their slots, where each row's new tokens start, the width
    every row writes, and the key span."""

    slots: torch.Tensor  # [B] long, on CPU
    starts: torch.Tensor  # [B] long, on CPU
    width: int  # tokens each row writes (shorter rows are padded)
    span: int  # keys each row attends over (the longest row's length after this forward)
    consecutive: slice | None  # slots[0]..slots[-1] when they are consecutive and ascending


@dataclass
class PackedBinding:
    """The rows of one forward in the packed layout: for each fed token, and for each key the forward reads,
    its slot and position (all ``[N]`` long tensors on the CPU)."""

    write_slots: torch.Tensor  # [T]: the slot of each fed token
    write_positions: torch.Tensor  # [T]: its position in that slot
    read_slots: torch.Tensor  # [S]: the slot of each key read, row after row, each row up to its own length
    read_positions: torch.Tensor  # [S]

    @property
    def span(self) -> int:
        return int(self.read_slots.numel())


class SlotKVCache:
    """The slots' storage, per attention layer. Forwards run on it through :class:`BoundSlotCache` views (see the
    module docstring); the engine copies prefixes between slots here."""

    def __init__(self, slots: int, max_len: int):
        if slots < 1 or max_len < 1:
            raise ValueError(f"a KV cache needs at least one slot and one token per slot (got {slots}, {max_len})")
        self.slots = slots  # the most the storage may hold
        self.max_len = max_len
        self.allocated = 0  # slots the storage holds now
        self.capacity = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    # -- the runner's side ---------------------------------------------------------------------------------------
    def bound(self, slots: list[int], starts: list[int], width: int, span: int) -> BoundSlotCache:
        """A view for one forward: row ``b`` writes ``width`` tokens into slot ``slots[b]`` from ``starts[b]``
        (rows shorter than ``width`` are padded; their padding lands past their length and is overwritten later)."""
        self._grow(max(slots) + 1, max(starts) + width)
        lo = slots[0]
        consecutive = slice(lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else None
        binding = BatchedBinding(
            slots=torch.tensor(slots, dtype=torch.long),
            starts=torch.tensor(starts, dtype=torch.long),
            width=width,
            span=span,
            consecutive=consecutive,
        )
        return BoundSlotCache(self, binding)

    def bound_packed(self, binding: PackedBinding) -> BoundSlotCache:
        """A view for one forward in the packed layout (see :class:`PackedBinding`)."""
        used = max(int(binding.write_slots.max()), int(binding.read_slots.max()) if binding.read_slots.numel() else 0)
        self._grow(used + 1, int(binding.write_positions.max()) + 1)
        return BoundSlotCache(self, binding)

    @torch.inference_mode()
    def copy_prefix(self, source: int, target: int, start: int, end: int) -> None:
        """Copy positions ``[start, end)`` of slot ``source`` into slot ``target`` on every layer (prefix reuse)."""
        if end <= start:
            return
        self._grow(max(source, target) + 1, end)
        for store in (self.keys, self.values):
            for t in store.values():
                t[target, :, start:end].copy_(t[source, :, start:end])

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for store in (self.keys, self.values) for t in store.values())

    def storage_tokens(self, slots: int, length: int) -> int:
        """Token positions (per layer, keys and values each) the storage would hold once grown to seat slots
        ``0..slots-1`` with ``length`` positions each: what the scheduler keeps within the plan's KV budget."""
        return self._slots_for(slots) * self._capacity_for(length)

    def reset(self) -> None:
        """Drop the storage (no sequence holds a slot): the next forward starts it again at the shape it needs."""
        self.keys.clear()
        self.values.clear()
        self.allocated = self.capacity = 0

    def _slots_for(self, need: int) -> int:
        if need <= self.allocated:
            return self.allocated
        slots = max(1, self.allocated)
        while slots < need:
            slots *= 2
        return min(slots, self.slots)

    def _capacity_for(self, need: int) -> int:
        if need <= self.capacity:
            return self.capacity
        capacity = max(MIN_CAPACITY, self.capacity)
        while capacity < need:
            capacity *= 2
        return min(capacity, self.max_len)

    def _grow(self, slots: int, need: int) -> None:
        if need > self.max_len:
            raise ValueError(f"a row needs {need} cache positions; the cache holds {self.max_len} per sequence")
        if slots > self.slots:
            raise ValueError(f"a row uses slot {slots - 1}; the cache has {self.slots} slots")
        allocated, capacity = self._slots_for(slots), self._capacity_for(need)
        if (allocated, capacity) == (self.allocated, self.capacity):
            return
        for store in (self.keys, self.values):
            for layer, old in store.items():
                new = old.new_zeros((allocated, old.shape[1], capacity, old.shape[3]))
                new[: old.shape[0], :, : old.shape[2]].copy_(old)
                store[layer] = new
        self.allocated, self.capacity = allocated, capacity

    def _layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer ``layer_idx``'s keys and values storage, made on its first write where and as the layer computes."""
        if layer_idx not in self.keys:
            shape = (self.allocated, key_states.shape[1], self.capacity, key_states.shape[3])
            self.values[layer_idx] = value_states.new_zeros(shape[:3] + (value_states.shape[3],))
            self.keys[layer_idx] = key_states.new_zeros(shape)
        return self.keys[layer_idx], self.values[layer_idx]


class BoundSlotCache(Cache):
    """A transformers ``Cache`` for one forward: the shared :class:`SlotKVCache` storage and this forward's own
    binding. ``update`` writes at each row's position and returns the slots' keys/values up to the bound span
    (see the module docstring). Made by :meth:`SlotKVCache.bound` / :meth:`SlotKVCache.bound_packed`."""

    def __init__(self, store: SlotKVCache, binding: BatchedBinding | PackedBinding):
        super().__init__(layers=[])
        self.store = store
        self.binding = binding
        self._indices: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _index(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Slot and position indices of every written token ``[B, width]``, and the slots ``[B]``, on ``device``
        (packed: slots and positions of the written tokens, then of the keys read)."""
        if device not in self._indices:
            b = self.binding
            if isinstance(b, PackedBinding):
                packed = (b.write_slots, b.write_positions, b.read_slots, b.read_positions)
                self._indices[device] = tuple(t.to(device) for t in packed)
                return self._indices[device]
            positions = b.starts.unsqueeze(1) + torch.arange(b.width).unsqueeze(0)
            rows = b.slots.unsqueeze(1).expand_as(positions)
            self._indices[device] = (rows.to(device), positions.to(device), b.slots.to(device))
        return self._indices[device]

    # -- transformers' side ----------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.binding
        keys, values = self.store._layer(layer_idx, key_states, value_states)  # noqa: SLF001 - its own storage
        if isinstance(b, PackedBinding):
            write_slots, write_positions, read_slots, read_positions = self._index(keys.device)
            # [1, H, T, D] -> [T, H, D]; advanced indices on dims 0 and 2 put the indexed dim first
            keys[write_slots, :, write_positions] = key_states[0].transpose(0, 1).to(keys.dtype)
            values[write_slots, :, write_positions] = value_states[0].transpose(0, 1).to(values.dtype)
            return (
                keys[read_slots, :, read_positions].transpose(0, 1).unsqueeze(0),
                values[read_slots, :, read_positions].transpose(0, 1).unsqueeze(0),
            )
        rows, positions, slots = self._index(keys.device)
        # [B, H, T, D] -> [B, T, H, D]: advanced indices on dims 0 and 2 put the indexed dims first
        keys[rows, :, positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows, :, positions] = value_states.transpose(1, 2).to(values.dtype)
        if b.consecutive is not None:
            return keys[b.consecutive, :, : b.span], values[b.consecutive, :, : b.span]
        return keys[:, :, : b.span].index_select(0, slots), values[:, :, : b.span].index_select(0, slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.binding.span

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.store.max_len

    @property
    def is_compileable(self) -> bool:
        return False
