"""Llama 3.1-3.3's JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``; several calls separated by ``;``). Only output that opens with the call is one."""

from __future__ import annotations

from service.tools.call_parser import ToolFormat

LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    markers=("<|python_tag|>", "{"),
    at_start_only=True,
    args_keys=("parameters", "arguments"),
)


def writes_llama3_json(template: str) -> bool:
    return '"parameters"' in template or "<|python_tag|>" in template or "ipython" in template
