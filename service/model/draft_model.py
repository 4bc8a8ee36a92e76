"""The draft model of ``--draft-model DIR``: a smaller checkpoint with the target's tokenizer that drafts for it; and
the draft a server plans before its target and loads after it, whichever kind (:func:`plan_drafting`,
:func:`load_drafting`).

Its tokens are fed to the target as they are, so it must speak the target's vocabulary: same tokens, same ids, same
special ids (:func:`check_same_vocabulary`); anything else would be verified against the wrong text and rejected,
or index past the target's embeddings. It is confined as the target is (its files resolve under
``--allowed-root``, else its own directory), and goes through the one load like the target: described, planned,
placed. Its plan comes first, on the box the target is planned on, and must hold it resident on one device (a draft
read from disk drafts no faster than the target decodes); what that plan holds, and the KV of a draft slot per
engine slot, is then reserved in the target's plan (:mod:`planner.placement.draft_budget`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from planner.errors import ModelSourceError
from planner.hardware.devices import device_label
from planner.placement.draft_budget import DRAFT_PREFILL_CHUNK
from planner.placement.inputs import PlanInputs
from planner.placement.speculative_rate import draft_tokens
from planner.types import DraftBudget, Plan
from service.model.draft_copy import DRAFT_SCHEMES, DraftCopy, copy_budget, load_draft_copy
from service.model.model_paths import confine_model_files, real_roots
from service.settings import ServiceSettings

#: Special-token ids a tokenizer names, compared between target and draft.
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


class DraftModelError(ModelSourceError):
    """A ``--draft-model`` that cannot draft for the served model: missing, not a safetensors checkpoint, another
    vocabulary, or too big to hold resident. A usage error, like a model that does not fit (``serve`` exits 2)."""


def draft_dir(settings: ServiceSettings, allowed_root_option: str) -> Path:
    """The ``--draft-model`` directory, refused by name when it is missing, holds no config or safetensors, or
    has files that resolve outside the allowed roots (``--allowed-root``, else its own directory)."""
    assert settings.draft_model is not None
    path = Path(settings.draft_model).expanduser()
    if not path.is_dir():
        raise DraftModelError(
            f"--draft-model {str(path)!r} is not a directory; give a local checkpoint directory (config.json, "
            "*.safetensors and the target's tokenizer)."
        )
    roots = real_roots(settings.allowed_root) if settings.allowed_root else [path.resolve()]
    confine_model_files(path, roots, allowed_root_option)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise DraftModelError(
            f"--draft-model {str(path)!r} is not a safetensors checkpoint (it needs config.json and *.safetensors "
            "beside the tokenizer); save the draft with save_pretrained(safe_serialization=True)."
        )
    return path.resolve()


def _vocab_size(path: Path) -> int:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise DraftModelError(f"{path.name}/config.json cannot be read: {exc}") from None
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    return int(text.get("vocab_size") or 0)


def check_same_vocabulary(target: Path, target_tok: Any, draft: Path, draft_tok: Any) -> None:
    """Refuse a draft whose tokenizer is not the target's: another token or id in the vocabulary, other special
    ids, or logits over more tokens than the target's embeddings hold."""
    name = f"--draft-model {draft.name}"
    mine, theirs = target_tok.get_vocab(), draft_tok.get_vocab()
    if mine != theirs:
        differ = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
        sample = ", ".join(f"{t!r}: {mine.get(t)} vs {theirs.get(t)}" for t in differ[:3])
        raise DraftModelError(
            f"{name} has another vocabulary than {target.name} ({len(theirs)} tokens vs {len(mine)}; "
            f"{len(differ)} differ, e.g. {sample}); a draft must share the target's tokenizer."
        )
    for attr in (*SPECIAL_IDS, "all_special_ids"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if (sorted(a) if isinstance(a, list) else a) != (sorted(b) if isinstance(b, list) else b):
            raise DraftModelError(
                f"{name}'s tokenizer has {attr} {b}, {target.name}'s has {a}; a draft must share the target's "
                "special tokens."
            )
    if _vocab_size(draft) > _vocab_size(target) > 0:
        raise DraftModelError(
            f"{name} predicts over {_vocab_size(draft)} token ids, more than the {_vocab_size(target)} "
            f"{target.name} embeds; a draft's ids must all be the target's."
        )


def plan_draft(path: Path, inputs: PlanInputs) -> Plan:
    """The draft's own plan on the target's box (the resolved hardware in ``inputs``), for one sequence and its
    drafting chunk, placed as ``auto`` places it: refused unless it is whole and resident on one device."""
    from planner.api import plan_inputs

    asked = replace(
        inputs, strategy="auto", complete=False, batch_size=1, prefill_chunk=DRAFT_PREFILL_CHUNK, draft=None
    )
    plan = plan_inputs(path, asked)
    devices = sorted({device_label(d) for d in plan.placement.values()})
    if len(devices) != 1 or "disk" in devices:
        raise DraftModelError(
            f"--draft-model {path.name} does not fit resident on one device of this box (its plan puts it on "
            f"{', '.join(devices)}); a draft read from disk drafts no faster than the target decodes: choose a "
            "smaller draft, or give the box more memory."
        )
    return plan


def draft_budget(path: Path, plan: Plan) -> DraftBudget:
    """What the target's plan reserves for the draft: its plan's weights and working memory on its device, and its
    KV per token (its plan budgets one sequence of the served context)."""
    device = next(iter(plan.placement.values()))
    budget = plan.budget(device)
    assert budget is not None, "a plan has a budget for every device it places on"
    kv = sum(b.kv_cache for b in plan.budgets)
    return DraftBudget(
        label=f"draft model {path.name}",
        device=device,
        weights=budget.weights,
        working=budget.activations,
        kv_per_token=kv // max(plan.workload.context, 1),
    )


def load_draft_model(path: Path, plan: Plan) -> DraftCopy:
    """The draft, loaded as its plan says through the one load (:func:`loaders.load_checkpoint`)."""
    from loaders import load_checkpoint

    result = load_checkpoint(path, device_map=plan, show_progress=False)
    result.model.eval()
    return DraftCopy(result.model, "model", plan.workload.dtype, result.resident_bytes, name=path.name)


@dataclass(frozen=True)
class Drafting:
    """The draft a server loads beside its target, planned before the target is: what the target's plan reserves
    for it, its scheme (``int4``/``int8``: a copy of the target; ``model``: ``--draft-model``), and for a draft
    model its directory and its own plan."""

    budget: DraftBudget
    scheme: str
    path: Path | None = None
    plan: Plan | None = None


def plan_drafting(
    settings: ServiceSettings, target: Path, target_tok: Any, inputs: PlanInputs, allowed_root_option: str
) -> Drafting | None:
    """The server's draft, planned on the box ``inputs`` resolved (None when it drafts without a model): for
    ``--draft-model``, its directory and vocabulary checked (before any weight is read) and its own plan made; for
    ``--speculate int4|int8``, the copy sized from the target's Skeleton. Budgeted for a resident target's draft
    count where none was asked; the target's plan may raise it (``with_draft_tokens``)."""
    tokens = draft_tokens(settings.speculate_tokens, None)
    if settings.draft_model is not None:
        from loaders import load_tokenizer

        path = draft_dir(settings, allowed_root_option)
        check_same_vocabulary(target, target_tok, path, load_tokenizer(path))
        plan = plan_draft(path, inputs)
        return Drafting(replace(draft_budget(path, plan), tokens=tokens), "model", path, plan)
    if settings.speculate in DRAFT_SCHEMES:
        return Drafting(replace(copy_budget(target, settings.speculate, inputs), tokens=tokens), settings.speculate)
    return None


def load_drafting(drafting: Drafting, target: Path, target_plan: Plan) -> DraftCopy:
    """Load the planned draft (its own plan, or the target quantized), with what the target's plan reserved for it
    and the plan's sentence on what that cost."""
    if drafting.path is not None and drafting.plan is not None:
        copy = load_draft_model(drafting.path, drafting.plan)
    else:
        copy = load_draft_copy(target, drafting.scheme, target_plan.workload.dtype)
    budget = target_plan.budget(drafting.budget.device)
    cost = next((r for r in target_plan.reasons if r.startswith("draft: ")), None)
    return replace(copy, reserved=budget.draft if budget is not None else 0, cost=cost)
