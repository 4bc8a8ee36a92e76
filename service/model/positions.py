"""A model's own position limit, read from its ``config.json``: what ``/plan``, the served load, ``/info`` and the
page's what-if form all cap the context at, so that they state one limit.

It lives apart from the routes and from the loading thread because both need it; importing it from either one's
module tied the two together in a cycle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.errors import PlanError

#: Config keys that state the longest sequence a model's positions allow, across families.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def model_position_limit(source: dict[str, Any] | str | Path) -> int | None:
    """The model's position limit from a config dict, a ``config.json`` path or a model folder; None if unstated.

    Multimodal configs keep the language model's numbers under ``text_config``, which is read when present.
    """
    cfg: dict[str, Any] | None = None
    if isinstance(source, dict):
        cfg = source
    else:
        p = Path(source)
        cfg_path = p / "config.json" if p.is_dir() else p
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cfg = None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config") or cfg
    for key in POSITION_KEYS:
        value = text.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def loaded_position_limit(model: Any) -> int | None:
    """The limit of a loaded model, from its ``config`` (read as :func:`model_position_limit` reads a file)."""
    config = getattr(model, "config", None)
    as_dict = config.to_dict() if callable(getattr(config, "to_dict", None)) else None
    return model_position_limit(as_dict) if isinstance(as_dict, dict) else None


class ContextBeyondPositionsError(PlanError, ValueError):
    """A plan asked for a context the model's positions cannot reach."""


def planned_context(requested: int | None, default: int, positions: int | None, what: str = "context") -> int:
    """The context a plan is made for: ``requested`` if the model's ``positions`` reach it (refused otherwise, with
    both numbers), else ``default`` capped at the positions. ``what``: how the request spells it in the refusal."""
    if requested is None:
        return min(default, positions) if positions else default
    if positions and requested > positions:
        raise ContextBeyondPositionsError(
            f"{what} {requested} is more than the {positions} positions the model holds (max_position_embeddings "
            f"in its config.json); plan for a context of at most {positions}"
        )
    return requested


def served_positions(settings: Any) -> int | None:
    """The served model's positions before it has loaded, where they can be read now: the demo model's, or a local
    model folder's ``config.json`` (a Hub model's are known once it is downloaded)."""
    if settings.demo:
        from service.model.demo_model import DEMO_SPEC

        return int(DEMO_SPEC["max_position_embeddings"])
    if settings.model and not str(settings.model).startswith("hf://"):
        path = Path(settings.model).expanduser()
        if path.is_dir():
            return model_position_limit(path)
    return None


def served_context(settings: Any, positions: int | None) -> int:
    """The context the server plans for and admits: ``--context`` (refused beyond the positions), else
    ``--max-total-tokens`` capped at them."""
    return planned_context(settings.context, settings.max_total_tokens, positions, what="--context")
