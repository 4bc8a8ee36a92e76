"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``: checked, turned into what the chat
template receives, and (``required`` or a named function) into the grammar the output must follow.

The format is the template's own (:func:`tool_format`): a template with no ``tools`` in it cannot show the model
its tools, so a request with tools is a 400 naming the reason. ``--tool-call-parser`` overrides the choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from service.engine.structured_output import GrammarSpec
from service.errors import RequestValidationError
from service.tools.call_parser import ToolFormat
from service.tools.harmony_format import HARMONY, writes_harmony
from service.tools.hermes_format import HERMES, writes_hermes
from service.tools.llama3_format import LLAMA3_JSON, writes_llama3_json
from service.tools.mistral_format import MISTRAL, writes_mistral

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, HARMONY)}
#: Most tools one request may declare.
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools come to: the tools for the template, the format, the names a call may take, and
    the grammar spec when ``tool_choice`` requires a call (``None`` for ``auto``)."""

    tools: list[dict[str, Any]]
    fmt: ToolFormat
    names: frozenset[str]
    grammar: GrammarSpec | None
    choice: str  # "auto" | "required" | "named"


def tool_format(template: str | None, parser: str | None = None) -> ToolFormat:
    """The format this model writes calls in: ``parser`` (``--tool-call-parser``) or the one its template shows."""
    if parser:
        if parser not in FORMATS:
            raise RequestValidationError(f"Unknown tool-call parser {parser!r}; use one of {', '.join(FORMATS)}.")
        return FORMATS[parser]
    if not template or "tools" not in template:
        raise RequestValidationError(
            "tools: this model's chat template takes no tools, so the model cannot be shown them; send the request "
            "without tools, or serve a model whose template renders tools (or a template via its tokenizer)."
        )
    shown = ((HARMONY, writes_harmony), (MISTRAL, writes_mistral), (HERMES, writes_hermes))
    for fmt, writes in (*shown, (LLAMA3_JSON, writes_llama3_json)):
        if writes(template):
            return fmt
    raise RequestValidationError(
        "tools: this model's chat template renders tools but in no format this server parses (hermes "
        "<tool_call>, llama3_json, mistral [TOOL_CALLS], harmony <|channel|>); start the server with "
        "--tool-call-parser."
    )


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Function tools as OpenAI sends them: ``{"type": "function", "function": {"name", "parameters"?}}``."""
    if len(tools) > MAX_TOOLS:
        raise RequestValidationError(f"At most {MAX_TOOLS} tools are allowed (got {len(tools)}).")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise RequestValidationError(f'{where} must be {{"type": "function", "function": {{...}}}}.')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise RequestValidationError(f"{where}.function.name must be a non-empty string of at most 64 characters.")
        if name in seen:
            raise RequestValidationError(f"{where}.function.name {name!r} is declared twice.")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestValidationError(f"{where}.function.parameters must be a JSON schema object.")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def choice_of(tool_choice: Any, names: set[str]) -> tuple[str, str | None]:
    """``tool_choice`` as (mode, function name): ``none``, ``auto``, ``required`` or ``named``."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise RequestValidationError(f"tool_choice names function {name!r}, which is not among the tools.")
        return "named", name
    raise RequestValidationError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.'
    )


def _call_schema(fmt: ToolFormat, tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    key = fmt.args_keys[0]
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, key: fn["parameters"]},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _header_options(fmt: ToolFormat, tools: list[dict[str, Any]]) -> GrammarSpec:
    """A format that names the function in the call's header (harmony): one alternative per tool, its own header
    then JSON of its own parameters, so the name and the arguments always belong together."""
    options = [
        {
            "prefix": fmt.call_prefix.replace("{name}", t["function"]["name"]),
            "schema": t["function"]["parameters"],
            "suffix": fmt.call_suffix,
        }
        for t in tools
    ]
    return GrammarSpec("wrapped_json", json.dumps({"options": options}), "tool_choice")


def call_grammar(fmt: ToolFormat, tools: list[dict[str, Any]]) -> GrammarSpec:
    """The grammar of the call a ``required`` or named ``tool_choice`` asks for: exactly one call of one of
    ``tools`` (in Mistral's array too), so that a model cannot run on adding calls; ``auto`` parses any number."""
    if fmt.name_in_header:
        return _header_options(fmt, tools)
    options = [_call_schema(fmt, t) for t in tools]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt.array:
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    value = {"prefix": fmt.call_prefix, "schema": schema, "suffix": fmt.call_suffix}
    return GrammarSpec("wrapped_json", json.dumps(value), "tool_choice")


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, parallel: bool | None, template: str | None, parser: str | None
) -> ToolPlan | None:
    """``None`` when the request uses no tools (none sent, or ``tool_choice: "none"``)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise RequestValidationError("tool_choice requires tools; send the tools it may call.")
        return None
    checked = check_tools(tools)
    names = {t["function"]["name"] for t in checked}
    mode, name = choice_of(tool_choice, names)
    if mode == "none":
        return None
    fmt = tool_format(template, parser)
    grammar = None
    if mode == "required":
        grammar = call_grammar(fmt, checked)
    elif mode == "named":
        grammar = call_grammar(fmt, [t for t in checked if t["function"]["name"] == name])
    return ToolPlan(tools=checked, fmt=fmt, names=frozenset(names), grammar=grammar, choice=mode)
