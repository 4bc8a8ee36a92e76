"""Anthropic's Messages request (``POST /v1/messages``), and its translation into the chat request every chat API
shares.

The body is read into :class:`MessagesRequest`; :func:`as_chat_request` rewrites it as a
:class:`~service.schemas.openai_requests.ChatCompletionRequest` (system prompt first, ``tool_use`` blocks as an
assistant's ``tool_calls``, ``tool_result`` blocks as ``tool`` messages, ``tool_choice`` ``any`` as ``required``),
so the chat template, the tool grammar, sampling and the limits are the ones chat completions uses. Fields with no
meaning here (``thinking``, ``mcp_servers``, ``container``...) are undeclared, so they are refused by name.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from service.errors import RequestValidationError
from service.schemas.openai_requests import ChatCompletionRequest
from service.schemas.validation import is_set, refuse_unknown, request_model_config


class AnthropicMessage(BaseModel):
    """One turn: text, or blocks (``text``, ``tool_use`` in an assistant's turn, ``tool_result`` in a user's)."""

    model_config = request_model_config()

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """Anthropic ``POST /v1/messages``."""

    model_config = request_model_config(
        {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
        {
            "model": "m",
            "max_tokens": 3,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "stream": True,
        },
    )

    model: str = Field(description="The served model's name (or an alias); others are 404 unless --accept-any-model.")
    max_tokens: int = Field(ge=1, description="Required, as in Anthropic's API: the most tokens to generate.")
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(
        None, description='Client tools: [{"name", "description", "input_schema"}].'
    )
    tool_choice: dict[str, Any] | None = Field(
        None, description='{"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}.'
    )
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description='{"user_id": ...}: logged with the request id.')


def _text_of(blocks: str | list[Any], where: str) -> str:
    """Text blocks' text (a ``tool_result``'s content or a system prompt); other blocks are refused."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise RequestValidationError(f"{where}[{j}]: only text blocks are supported here (got {kind!r}).")
        parts.append(block["text"])
    return "".join(parts)


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise RequestValidationError(f'{where}: a tool_use block needs "id" and "name".')
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise RequestValidationError(f"{where}.input must be an object.")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": json.dumps(args)}}


def _turn(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user's ``tool_result`` blocks become ``tool`` messages (before its
    text), an assistant's ``tool_use`` blocks its ``tool_calls``."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text, calls, results, thinking = [], [], [], []
    for j, block in enumerate(message.content):
        here = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_call(block, here))
        elif kind == "tool_result" and message.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise RequestValidationError(f'{here}: a tool_result block needs "tool_use_id".')
            content = _text_of(block.get("content") or "", f"{here}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        elif kind == "thinking" and message.role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        else:
            raise RequestValidationError(
                f"{here}: a {message.role} turn takes text"
                + (", tool_use and thinking" if message.role == "assistant" else " and tool_result")
                + f" blocks here (got {kind!r}); images and documents are not supported."
            )
    out = list(results)
    if text or calls or not results:
        entry: dict[str, Any] = {"role": message.role, "content": "".join(text)}
        if calls:
            entry["tool_calls"] = calls
        if thinking:
            entry["reasoning_content"] = "".join(thinking)
        out.append(entry)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise RequestValidationError(
                f"tools[{i}]: server tools ({tool.get('type')!r}) are not supported; send client tools "
                '{"name", "description", "input_schema"}.'
            )
        unknown = sorted(
            k for k, v in tool.items() if k not in ("type", "name", "description", "input_schema") and is_set(v)
        )
        if unknown:
            raise RequestValidationError(f"Unsupported parameter(s): {', '.join(f'tools[{i}].{k}' for k in unknown)}.")
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema", {"type": "object", "properties": {}})}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic's ``tool_choice`` as chat's, and ``parallel_tool_calls`` (from ``disable_parallel_tool_use``)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    unknown = sorted(
        k for k, v in choice.items() if k not in ("type", "name", "disable_parallel_tool_use") and is_set(v)
    )
    if unknown:
        raise RequestValidationError(f"Unsupported parameter(s): {', '.join('tool_choice.' + k for k in unknown)}.")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise RequestValidationError(
        'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}.'
    )


def as_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request this Messages request means (Anthropic's default temperature is 1, as OpenAI's)."""
    refuse_unknown(body)
    for i, message in enumerate(body.messages):
        refuse_unknown(message, f"messages[{i}].")
    if not body.messages:
        raise RequestValidationError("messages is empty; send at least one message.")
    unknown_meta = sorted(k for k, v in (body.metadata or {}).items() if k != "user_id" and is_set(v))
    if unknown_meta:
        raise RequestValidationError(f"Unsupported parameter(s): {', '.join('metadata.' + k for k in unknown_meta)}.")
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, message in enumerate(body.messages):
        messages.extend(_turn(message, f"messages[{i}]"))
    choice, parallel = _tool_choice(body.tool_choice)
    user = (body.metadata or {}).get("user_id")
    return ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": messages,
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences,
            "tools": _tools(body.tools),
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "user": user if isinstance(user, str) else None,
        },
        strict=False,
    )
