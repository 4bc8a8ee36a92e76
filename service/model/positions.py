"""A model's own position limit, read from its ``config.json``: what both ``/plan`` and the served load cap at.

It lives apart from the routes and from the loading thread because both need it; importing it from either one's
module tied the two together in a cycle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
