"""Hermes' and Qwen's tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block a
call, anywhere in the output (text before the first block is content). Qwen2.5, Qwen3, Hermes 2/3 templates."""

from __future__ import annotations

from service.tools.call_parser import ToolFormat

HERMES = ToolFormat(
    name="hermes",
    markers=("<tool_call>",),
    args_keys=("arguments",),
    call_prefix="<tool_call>\n",
    call_suffix="\n</tool_call>",
)


def writes_hermes(template: str) -> bool:
    return "<tool_call>" in template
