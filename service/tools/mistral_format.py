"""Mistral's tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, one array of every call after
the marker (a special token in Mistral's tokenizers: such requests keep special tokens' text)."""

from __future__ import annotations

from service.tools.call_parser import ToolFormat

MISTRAL = ToolFormat(
    name="mistral",
    markers=("[TOOL_CALLS]",),
    args_keys=("arguments",),
    call_prefix="[TOOL_CALLS]",
    array=True,
)


def writes_mistral(template: str) -> bool:
    return "[TOOL_CALLS]" in template
