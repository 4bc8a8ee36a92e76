"""One forward over rows of the slot cache: each row feeds some tokens of one sequence at that sequence's own
positions, and gets back the logits of its last fed token (or, if it asks, of every fed token).

An engine iteration is one forward: the decode rows (one token each) and the prefill chunks (up to a chunk's tokens)
together, so every weight, offloaded ones included, is read once per iteration. Rows of equal width (a decode step)
run batched ``[B, width]``; rows of different widths run packed: their tokens end to end as one sequence of batch 1
(no row padded to another's width), each token at its own position, with a block-diagonal mask that keeps each row
to its own slot's keys (:mod:`service.engine.kv_pool`). The packed mask is dense: a row's queries also meet (masked) the
keys of the other rows, attention work (not weight reads) that a decode row next to a prefill chunk pays.

In bf16 with the native attention (:mod:`loaders.native.attention`) an iteration is two forwards: the decode rows
batched, and the prompt chunks packed, each token attending only its own row's keys on the native kernel, so that a
row gets the same bits whatever rows it is packed with (:meth:`ModelRunner.prepare`). Without that kernel (or with
a sliding window, or layers on a GPU) bf16 rows run one batched forward per row width.

The runner builds the position ids and the attention mask itself (row ``b``'s token ``t`` sees keys
``0 .. start_b + t`` of its own slot, and, for a sliding-window model, only the window's), hands transformers a
prepared 4D mask (which it uses as given) and a view of the :class:`~service.engine.kv_pool.SlotKVCache` bound to these
rows (:class:`~service.engine.kv_pool.BoundSlotCache`), and asks for the logits it needs only (``logits_to_keep``). The
model is called as it is loaded, so device-map hooks, disk offload and the native kernels all run as for any forward,
once per call for every row.

Building a call (:meth:`ModelRunner.prepare`, a list of :class:`ModelCall`) is apart from running it and from
reading its logits back (:meth:`ModelRunner.collect`), so that the device pipeline
(:mod:`service.engine.multi_gpu_runner`) runs the very same calls, micro-batch by micro-batch, on its schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from loaders.native import map_guard

if TYPE_CHECKING:
    from loaders.native.decode_step import NativeDecoder
from service.engine.kv_pool import BatchedBinding, BoundSlotCache, PackedBinding, SlotKVCache

#: Most tokens a decode row may feed and still run on the native decode step (:meth:`ModelRunner.run`): a verify
#: pass's drafts plus one, or a draft model's catch-up after a verify pass.
SHORT_ROW = 17

#: The lowest transformers the runner works with (pyproject's bound; a test keeps the two equal). Older ones take
#: ``cache=`` into ``**kwargs`` without using it, so the model decodes without its KV cache: wrong tokens, no error.
MIN_TRANSFORMERS = "5.24"


def installed_transformers() -> str:
    """The version of the transformers this process imports."""
    import transformers

    return transformers.__version__


def require_transformers() -> None:
    """Refuse a transformers older than :data:`MIN_TRANSFORMERS` with what to do (issue 34, defect 3)."""
    from packaging.version import Version

    installed = installed_transformers()
    if Version(installed) < Version(MIN_TRANSFORMERS):
        from service.errors import GenerationError

        raise GenerationError(
            f"transformers {installed} is installed but the engine needs transformers >= {MIN_TRANSFORMERS}: it "
            "hands the model its KV cache as cache=, which older versions silently ignore (every token would be "
            f"decoded without the cache, wrongly). Install a newer one: pip install 'transformers>={MIN_TRANSFORMERS},<6'."
        )


#: Under the native attention, a prompt row whose keys reach past this many positions runs in a call of its own on
#: SDPA rather than packed on the native kernel: attending one row's long context, SDPA's blocked GEMMs are ~2.4x
#: faster (256 bf16 query tokens over 1000 keys: 7.0 against 15.7 ms a layer on an AVX-512 EPYC), while packed short
#: rows are where the kernel wins (each token reads its own row's keys only, not the whole packed sequence).
LONG_PROMPT_CONTEXT = 512


@dataclass
class Row:
    """The tokens one sequence feeds in a forward, written into ``slot`` from position ``start``. ``every_logits``
    asks for the logits after each of them (a prompt's own logprobs), not only after the last."""

    slot: int
    start: int
    tokens: Sequence[int]
    every_logits: bool = False
    #: A decode row: a sequence's last token, and the drafts it verifies if any, or a draft model's few tokens of
    #: catch-up; such a row may run on the native decode step one token a step-row (:meth:`ModelRunner.run`). A
    #: prompt chunk is not one: it runs the model's forward, as transformers does.
    decoding: bool = False


@dataclass
class RunOutput:
    """What one forward gives back: ``last[b]`` the logits after row ``b``'s last token (``[B, vocab]``), and for
    each row that asked, ``every[b]`` the logits after each of its tokens (``[len(tokens), vocab]``)."""

    last: torch.Tensor
    every: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ModelCall:
    """One forward as the model takes it, over rows ``members`` (indices into the rows being run): token ids,
    position ids, the prepared mask, the slot cache bound to these rows, and which logits to keep. ``kept[i]`` is
    how many logits member ``i`` gets back (1, or its width when it asked for every token's)."""

    members: list[int]
    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | dict[str, torch.Tensor]
    cache: BoundSlotCache
    keep: int | torch.Tensor
    kept: list[int]
    packed: bool

    def kwargs(self, device: torch.device) -> dict[str, Any]:
        """The model's keyword arguments for this call."""
        return dict(
            input_ids=self.ids.to(device),
            attention_mask=self.mask,
            position_ids=self.positions.to(device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=self.keep,
        )

    def row_logits(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Each member's kept logits ``[kept, vocab]`` out of the call's ``[B, kept, vocab]`` logits."""
        if not self.packed:
            return [logits[i, logits.shape[1] - n :] for i, n in enumerate(self.kept)]
        out, at = [], 0
        for n in self.kept:
            out.append(logits[0, at : at + n])
            at += n
        return out

    def shifted(self, offset: int) -> ModelCall:
        """The same call over rows ``offset`` further on (a micro-batch's calls in its whole iteration)."""
        return replace(self, members=[m + offset for m in self.members])


class ModelRunner:
    """Runs the model over :class:`Row`\\ s with the engine's slot cache."""

    def __init__(self, model: torch.nn.Module, device: torch.device, cache: SlotKVCache):
        self.model = model
        self.device = device
        self.cache = cache
        config = getattr(model, "config", None)
        implementation = getattr(config, "_attn_implementation", None) or "eager"
        self.bool_mask = implementation in _bool_mask_attention()
        self.window = getattr(config, "sliding_window", None) if _uses_sliding_window(config) else None
        layer_types = set(getattr(config, "layer_types", None) or ())
        self.mixed = self.window is not None and layer_types == {"full_attention", "sliding_attention"}
        self.mask_dtype = getattr(model, "dtype", torch.float32)
        packable = getattr(model, "runs_packed_rows", True)
        #: bf16 prompt rows packed apart from decode rows (see :meth:`prepare`): only where every attention call
        #: runs the native kernel, which gives a prompt token the same result packed or alone, and torch's GEMM
        #: gives a prompt row's products the same bits whatever rows share them (probed). Under SDPA a packed
        #: row's keys sit at an offset that depends on its batch-mates, which changes the order of attention's sums,
        #: and bf16 rounding then lets a row's greedy tokens depend on its neighbours (fp32 stays within 1e-5).
        self.half_packed = (
            packable
            and self.mask_dtype == torch.bfloat16
            and _native_attention_everywhere(model)
            and _prompt_products_row_independent(model)
        )
        #: Whether rows of different widths share a packed forward. Not for a model that cannot take it (the
        #: pipeline's ring), nor in half precision without the native attention: those get one batched forward per
        #: row width.
        self.packed = packable and (self.mask_dtype == torch.float32 or self.half_packed)
        #: Whether attention runs the native kernel, which takes prompt rows too (see :meth:`prepare`).
        self.native_attention = implementation == _native_attention_name()
        #: Decode steps (one token per row) on the native kernels end to end, where the model is Llama-shaped and
        #: runs the native attention (:mod:`loaders.native.decode_step`); ``None``: every call runs the model's forward.
        self.native_decoder = (
            _native_decoder(model) if self.native_attention and self.window is None and packable else None
        )
        #: Logits a prompt row keeps in a call of its own: two in bf16 packing, as in its packed call.
        self._keep_last = 2 if self.half_packed else 1
        #: Model calls run so far (tests count them: one per engine iteration, unless rows of several widths run
        #: one call per width).
        self.forwards = 0

    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        """Feed every row's tokens; return the logits after each row's last token, ``[B, vocab]``."""
        return self.run(rows).last

    @torch.inference_mode()
    def run(self, rows: Sequence[Row]) -> RunOutput:
        """Feed every row's tokens in one forward (batched or packed, see the module docstring; decode rows of a
        few tokens each on the native decode step, see :meth:`_short_rows_native`)."""
        native = self._short_rows_native(rows)
        if native is not None:
            return native
        calls = self.prepare(rows)
        self.forwards += len(calls)
        logits = [self._call(c) for c in calls]
        map_guard.check(
            self.model
        )  # a shard read in place was truncated during the step: its logits are not the model's
        return self.collect(rows, calls, logits)

    def _short_rows_native(self, rows: Sequence[Row]) -> RunOutput | None:
        """Decode rows that feed several tokens (a verify pass's drafts, a draft model's catch-up) on the native
        decode step, each token a step-row of its own in its sequence's slot, or None where it does not take them.
        The step writes every step-row's key and value before any attends, and step-row ``i`` attends positions
        ``0 .. start + i`` of its slot, so a row's later tokens see its earlier ones exactly as in a forward; the
        products are the one-token step's, so a verified token gets the logits plain decoding would give it (the
        model's forward costs ~10 ms of overhead a call on a small model, the step a tenth of that)."""
        decoder = self.native_decoder
        if decoder is None or all(len(r.tokens) == 1 for r in rows):
            return None
        if not all(len(r.tokens) == 1 or (r.decoding and len(r.tokens) <= SHORT_ROW) for r in rows):
            return None
        flat = [Row(r.slot, r.start + i, [token]) for r in rows for i, token in enumerate(r.tokens)]
        if not decoder.takes(len(flat), self.cache.keys):
            return None
        logits = self.forward(flat)
        last: list[torch.Tensor] = []
        every: dict[int, torch.Tensor] = {}
        at = 0
        for b, r in enumerate(rows):
            n = len(r.tokens)
            last.append(logits[at + n - 1])
            if r.every_logits:
                every[b] = logits[at : at + n]
            at += n
        return RunOutput(last=torch.stack(last), every=every)

    def close(self) -> None:
        """Nothing to stop (the device pipeline's runner stops its workers here)."""

    def prepare(self, rows: Sequence[Row]) -> list[ModelCall]:
        """The forward(s) that feed ``rows``: one batched call for rows of one width, one packed call for rows of
        different widths, or, for a model that does not take the packed layout, one batched call per row width (a
        row asking for every token's logits alone); in bf16 with the native attention, see
        :meth:`_decode_and_prompt_calls`. Under the native attention a prompt row reaching past
        :data:`LONG_PROMPT_CONTEXT` runs in a call of its own, on SDPA."""
        if not rows:
            raise ValueError("a forward needs at least one row")
        if min(len(r.tokens) for r in rows) < 1:
            raise ValueError("every row feeds at least one token")
        everyone = list(range(len(rows)))
        if not self.native_attention:
            return self._calls(rows, everyone)
        is_long = [len(r.tokens) > 1 and r.start + len(r.tokens) > LONG_PROMPT_CONTEXT for r in rows]
        rest = [b for b in everyone if not is_long[b]]
        calls = self._calls([rows[b] for b in rest], rest) if rest else []
        for b in everyone:  # alone, on SDPA: its result depends on its own keys only
            if is_long[b]:
                calls.append(self._batched([rows[b]], [b], rows[b].every_logits, self._keep_last, additive=True))
        return calls

    def _calls(self, rows: Sequence[Row], members: list[int]) -> list[ModelCall]:
        """:meth:`prepare`'s calls for ``rows``, which are ``members`` of the rows being run."""
        if self.half_packed:
            return self._decode_and_prompt_calls(rows, members)
        if len({len(r.tokens) for r in rows}) == 1 and not any(r.every_logits for r in rows):
            return [self._batched(rows, members)]
        if self.packed:
            return [self._packed(rows, members)]
        groups: dict[int | tuple[int], list[int]] = {}
        for b, r in enumerate(rows):
            groups.setdefault((b,) if r.every_logits else len(r.tokens), []).append(b)
        return [
            self._batched([rows[b] for b in group], [members[b] for b in group], every=rows[group[0]].every_logits)
            for group in groups.values()
        ]

    @staticmethod
    def collect(rows: Sequence[Row], calls: Sequence[ModelCall], logits: Sequence[torch.Tensor]) -> RunOutput:
        """The :class:`RunOutput` of ``rows`` from each call's logits (in the order of ``calls``)."""
        last: list[torch.Tensor | None] = [None] * len(rows)
        every: dict[int, torch.Tensor] = {}
        for call, out in zip(calls, logits):
            for b, row_logits in zip(call.members, call.row_logits(out)):
                last[b] = row_logits[-1]
                if rows[b].every_logits:
                    every[b] = row_logits
        return RunOutput(last=torch.stack(last), every=every)

    def _decode_and_prompt_calls(self, rows: Sequence[Row], members: list[int]) -> list[ModelCall]:
        """bf16 with the native attention: one batched call for the one-token rows (decode steps), whose products
        run on the native kernel, and one packed call for every other row (prompt chunks, rows asking for every
        token's logits), whose products run on torch's GEMM (:mod:`loaders.native.linear` sizes them by tokens per
        row). Each prompt row keeps its last two tokens' logits, so that the head's product also has several
        tokens per row, whether one prompt runs or many. Which call a row takes depends on the row alone."""
        one = [b for b, r in enumerate(rows) if len(r.tokens) == 1 and not r.every_logits]
        taken = set(one)
        prompts = [b for b in range(len(rows)) if b not in taken]
        calls = [self._batched([rows[b] for b in one], [members[b] for b in one])] if one else []
        if prompts:
            calls.append(self._packed([rows[b] for b in prompts], [members[b] for b in prompts], keep_last=2))
        return calls

    def _batched(
        self, rows: Sequence[Row], members: list[int], every: bool = False, keep_last: int = 1, additive: bool = False
    ) -> ModelCall:
        """Rows of one width ``[B, width]``; keeps the logits after each row's last ``keep_last`` tokens (after
        every token, with ``every``). ``additive`` gives attention the additive mask even where it takes booleans
        (which the native implementation leaves to SDPA)."""
        width = len(rows[0].tokens)
        ids = torch.tensor([list(r.tokens) for r in rows], dtype=torch.long)
        starts = torch.tensor([r.start for r in rows], dtype=torch.long)
        offsets = torch.arange(width).unsqueeze(0)
        positions = starts.unsqueeze(1) + offsets
        span = int(starts.max()) + width
        keys = torch.arange(span).view(1, 1, span)
        query = positions.unsqueeze(2)  # [B, T, 1]
        causal = keys <= query
        cache = self.cache.bound([r.slot for r in rows], [r.start for r in rows], width, span)
        mask = self._mask(causal, keys, query, additive)
        keep = min(keep_last, width)
        kept = [width if every else keep] * len(rows)
        return ModelCall(members, ids, positions, mask, cache, 0 if every else keep, kept, packed=False)

    def _packed(self, rows: Sequence[Row], members: list[int], keep_last: int = 1) -> ModelCall:
        """Rows end to end as one sequence ``[1, T]`` (see the module docstring), as ``members`` of the rows run;
        each row keeps the logits of its last ``keep_last`` tokens (at most its width), or of every token."""
        lengths = torch.tensor([len(r.tokens) for r in rows], dtype=torch.long)
        starts = torch.tensor([r.start for r in rows], dtype=torch.long)
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        index = torch.arange(len(rows))
        ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long).unsqueeze(0)
        token_row = index.repeat_interleave(lengths)  # [T]
        first = torch.cumsum(lengths, 0) - lengths  # where each row's tokens begin in the packed sequence
        positions = starts[token_row] + torch.arange(len(token_row)) - first[token_row]  # [T]
        spans = starts + lengths
        key_row = index.repeat_interleave(spans)  # [S]
        key_positions = torch.arange(len(key_row)) - (torch.cumsum(spans, 0) - spans)[key_row]
        query = positions.view(1, -1, 1)  # [1, T, 1]
        keys = key_positions.view(1, 1, -1)  # [1, 1, S]
        causal = (token_row.view(1, -1, 1) == key_row.view(1, 1, -1)) & (keys <= query)
        last = first + lengths - 1
        keep_parts = [
            torch.arange(int(first[b]), int(first[b]) + len(r.tokens))
            if r.every_logits
            else torch.arange(int(last[b]) - min(keep_last, len(r.tokens)) + 1, int(last[b]) + 1)
            for b, r in enumerate(rows)
        ]
        keep = torch.cat(keep_parts)  # ascending: rows are in order
        cache = self.cache.bound_packed(
            PackedBinding(
                write_slots=slots[token_row],
                write_positions=positions,
                read_slots=slots[key_row],
                read_positions=key_positions,
            )
        )
        mask = self._mask(causal, keys, query)
        kept = [len(part) for part in keep_parts]
        return ModelCall(members, ids, positions.unsqueeze(0), mask, cache, keep.to(self.device), kept, packed=True)

    def _mask(
        self, causal: torch.Tensor, keys: torch.Tensor, query: torch.Tensor, additive: bool = False
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The prepared mask from the causal booleans ``[B, T, S]``: windowed for a sliding-window model, one per
        layer type for a hybrid one."""
        windowed = causal & (keys > query - self.window) if self.window is not None else causal
        if self.mixed:  # per-layer-type masks, as transformers passes them to hybrid models
            return {
                "full_attention": self._prepared(causal, additive),
                "sliding_attention": self._prepared(windowed, additive),
            }
        return self._prepared(windowed, additive)

    def _call(self, call: ModelCall) -> torch.Tensor:
        """The model's forward for ``call`` (or, for decode rows, the native decoder's step); its logits
        ``[B, kept, vocab]``."""
        decoder, binding = self.native_decoder, call.cache.binding
        if (
            decoder is not None
            and isinstance(binding, BatchedBinding)
            and binding.width == 1
            and decoder.takes(len(call.members), self.cache.keys)
        ):
            logits = decoder.step(call.ids[:, 0], binding.starts, binding.slots, self.cache.keys, self.cache.values)
            return logits.unsqueeze(1)
        return self.model(**call.kwargs(self.device)).logits

    def _prepared(self, allowed: torch.Tensor, additive: bool = False) -> torch.Tensor:
        """``[B, T, span]`` booleans as the 4D mask the attention implementation takes (bool for SDPA, additive
        otherwise, or when asked), on the input device."""
        mask = allowed.unsqueeze(1)
        if additive or not self.bool_mask:
            mask = torch.zeros(mask.shape, dtype=self.mask_dtype).masked_fill_(~mask, torch.finfo(self.mask_dtype).min)
        return mask.to(self.device)


def _native_decoder(model: torch.nn.Module) -> NativeDecoder | None:
    """The model's native decode step, or ``None``. Imported here, on the loading thread: the kernels' modules pull
    in transformers' attention code, which the app leaves out of its start (``service.cli.startup_imports``)."""
    from loaders.native.decode_step import NativeDecoder

    return NativeDecoder.for_model(model)


def _uses_sliding_window(config) -> bool:
    """Whether the model's attention is windowed (Mistral-style ``sliding_window``, unless switched off)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return False
    return getattr(config, "use_sliding_window", True) is not False


def _native_attention_name() -> str:
    """The loader's native attention implementation name (imported here, as :func:`_bool_mask_attention` is)."""
    from loaders.native.attention import NATIVE_ATTENTION

    return NATIVE_ATTENTION


def _native_attention_everywhere(model: torch.nn.Module) -> bool:
    """Whether every attention call of ``model`` runs the native kernel: the loader switched it to the native
    implementation, it has no sliding window, and all its weights compute on the CPU (none on a GPU)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != _native_attention_name() or _uses_sliding_window(config):
        return False
    return all(p.device.type in ("cpu", "meta") for p in model.parameters())


def _prompt_products_row_independent(model: torch.nn.Module) -> bool:
    """Whether torch's bf16 GEMM, which runs prompt rows' products, gives a row the same bits whatever rows share
    it, probed on the first float linear layer's weight and on the widest one's (different input widths), where
    they are in memory (a layer streamed from disk is not probed). Where it does not, bf16 rows are not packed.
    Layers on the native kernels and on torch's alike: with ``cpu_kernels="torch"`` every product is torch's.
    Quantized layers are not probed: their kernels give a row the same bits whatever its batch (tested)."""
    from loaders.native.linear import rows_independent_on_this_cpu  # as _bool_mask_attention

    weights = [
        m.weight
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.device.type == "cpu" and m.weight.is_floating_point()
    ]
    if not weights:
        return True
    return rows_independent_on_this_cpu([weights[0], max(weights, key=lambda w: w.shape[1])])


def _bool_mask_attention() -> tuple[str, ...]:
    """The attention implementations that take sdpa's boolean masks. Imported here, not at the top: the loader's
    attention module imports transformers' model code, which the server loads on its loading thread, not before it
    listens."""
    from loaders.native.attention import BOOL_MASK_ATTENTION

    return BOOL_MASK_ATTENTION


def supports_slot_cache(model: torch.nn.Module) -> bool:
    """Whether the model can run on the slot cache: a causal LM whose attention layers all take a transformers
    ``Cache`` through ``update`` and accept a prepared 4D mask (plain full or sliding-window attention)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        return False
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    return implementation in (*_bool_mask_attention(), "eager")
