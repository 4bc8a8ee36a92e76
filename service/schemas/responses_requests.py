"""OpenAI's Responses request (``POST /v1/responses``), and its translation into the chat request every chat API
shares.

``input`` is a string or a list of items: messages (``input_text``/``output_text`` parts), ``function_call`` and
``function_call_output``. :func:`input_items` normalises it into items (which the response store keeps, so a
``previous_response_id`` continues the same list); :func:`as_chat_request` renders items, ``instructions`` and the
flat function tools as a :class:`~service.schemas.openai_requests.ChatCompletionRequest`, so the template, the tool
grammar, sampling and limits are chat completions' own. Built-in tools (``web_search``, ``file_search``...) and
fields with no meaning here (``reasoning``, ``include``, ``background``...) are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.errors import RequestValidationError
from service.schemas.openai_requests import ChatCompletionRequest
from service.schemas.validation import is_set, refuse_unknown, request_model_config

#: The item types of ``input`` taken here (``reasoning`` items are taken and left out of the prompt).
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
#: Message roles of ``input``.
ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(BaseModel):
    """OpenAI ``POST /v1/responses``."""

    model_config = request_model_config(
        {"input": "Hello", "max_output_tokens": 3},
        {"input": [{"role": "user", "content": "Hi"}], "instructions": "Be brief.", "max_output_tokens": 3},
        {"input": "Hi", "max_output_tokens": 3, "stream": True, "store": False},
    )

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(
        None, description='Function tools, flat: [{"type": "function", "name", "description", "parameters"}].'
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "name": ...}.'
    )
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = Field(True, description="Keep the response for previous_response_id (in memory, bounded).")
    previous_response_id: str | None = Field(None, description="Continue after a stored response of this server.")
    metadata: dict[str, str] | None = Field(None, description="Echoed back in the response.")
    user: str | None = Field(None, description="An end-user id; logged with the request id.")
    text: dict[str, Any] | None = Field(
        None, description='{"format": {"type": "text" | "json_object" | "json_schema", "schema": {...}}}'
    )
    truncation: Literal["disabled"] | None = Field(None, description='Only "disabled": prompts are never cut.')
    ignore_eos: bool = Field(
        False,
        description="vLLM's extension: generate max_output_tokens whatever the model ends with (guidellm sends it "
        "for fixed-length runs).",
    )


def _text_parts(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestValidationError(f"{where} must be a string or a list of text parts.")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestValidationError(
                f"{where}[{j}]: only input_text and output_text parts are supported (got {kind!r})."
            )
        parts.append(part["text"])
    return "".join(parts)


def _item(item: Any, where: str) -> dict[str, Any]:
    """One ``input`` item, checked and normalised (a message's content as text)."""
    if not isinstance(item, dict):
        raise RequestValidationError(f"{where} must be an object.")
    kind = item.get("type", "message")
    if kind not in INPUT_ITEM_TYPES:
        raise RequestValidationError(
            f"{where}: input items of type {kind!r} are not supported; send messages, function_call and "
            "function_call_output items."
        )
    if kind == "message":
        if item.get("role") not in ROLES:
            raise RequestValidationError(f"{where}.role must be one of {', '.join(ROLES)} (got {item.get('role')!r}).")
        return {
            "type": "message",
            "role": item["role"],
            "content": _text_parts(item.get("content"), f"{where}.content"),
        }
    if kind == "function_call":
        fields = ("call_id", "name", "arguments")
        if not all(isinstance(item.get(k), str) for k in fields):
            raise RequestValidationError(f'{where}: a function_call item needs string "call_id", "name", "arguments".')
        return {"type": kind, **{k: item[k] for k in fields}}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise RequestValidationError(f'{where}: a function_call_output item needs the "call_id" it answers.')
        return {
            "type": kind,
            "call_id": item["call_id"],
            "output": _text_parts(item.get("output", ""), f"{where}.output"),
        }
    return {"type": "reasoning"}


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as normalised items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    if not body.input:
        raise RequestValidationError("input is empty; send a string or at least one item.")
    return [_item(item, f"input[{i}]") for i, item in enumerate(body.input)]


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Items as chat messages: ``instructions`` as the system message, consecutive ``function_call`` items as one
    assistant message's ``tool_calls`` (joined to the assistant message just before them), outputs as ``tool``
    messages. Reasoning items add nothing to the prompt."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item["type"] == "message":
            out.append({"role": item["role"], "content": item["content"]})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif item["type"] == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not out:
        raise RequestValidationError("input holds no message to answer.")
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise RequestValidationError(
                f"tools[{i}]: built-in tools ({kind!r}) are not supported here; send function tools "
                '{"type": "function", "name", "parameters"}.'
            )
        known = ("type", "name", "description", "parameters", "strict")
        unknown = sorted(k for k, v in tool.items() if k not in known and is_set(v))
        if unknown:
            raise RequestValidationError(f"Unsupported parameter(s): {', '.join(f'tools[{i}].{k}' for k in unknown)}.")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestValidationError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}; '
        f"{choice.get('type')!r} is not supported here."
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if not text:
        return None
    unknown = sorted(k for k, v in text.items() if k != "format" and is_set(v))
    if unknown:
        raise RequestValidationError(f"Unsupported parameter(s): {', '.join('text.' + k for k in unknown)}.")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise RequestValidationError('text.format must be {"type": "text" | "json_object" | "json_schema", ...}.')
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return {"type": fmt.get("type")}


def as_chat_request(body: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that answers ``items`` (the stored conversation, then this request's input)."""
    refuse_unknown(body)
    return ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": chat_messages(items, body.instructions),
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": _tools(body.tools),
            "tool_choice": _tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": _response_format(body.text),
            "user": body.user,
            "ignore_eos": body.ignore_eos,
        },
        strict=False,
    )
