"""What ``POST /v1/messages`` answers, in Anthropic's shapes: the message, its stream's events, its errors.

As :mod:`service.schemas.response_models`, these document the answers the route builds as dicts (the schemathesis
test holds them to the real responses); :func:`anthropic_error_body` is the one definition of the error envelope.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from service.schemas.response_models import _Answer

#: Anthropic's error types by HTTP status (what its client raises on); 503 is its ``overloaded_error``.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicErrorDetail(_Answer):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, rate_limit_error...")
    message: str


class AnthropicErrorEnvelope(_Answer):
    """Every error of ``/v1/messages`` (and a stream's ``error`` event), in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return AnthropicErrorEnvelope(type="error", error=AnthropicErrorDetail(type=kind, message=message)).model_dump()


class TextBlock(_Answer):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Answer):
    type: Literal["thinking"]
    thinking: str
    signature: str = Field(description="Empty: this server signs nothing.")


class ToolUseBlock(_Answer):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(_Answer):
    input_tokens: int
    output_tokens: int


class AnthropicMessageResponse(_Answer):
    """The assistant's message. ``stop_reason``: end_turn, max_tokens, stop_sequence (``stop_sequence`` says
    which) or tool_use."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextBlock | ThinkingBlock | ToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicStreamEvent(_Answer):
    """One event of a stream (its SSE ``event:`` name is its ``type``): message_start, content_block_start,
    content_block_delta (text_delta, input_json_delta, thinking_delta), content_block_stop, message_delta,
    message_stop, ping, or error."""

    type: Literal[
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "ping",
    ]
    message: dict[str, Any] | None = None
    index: int | None = None
    content_block: dict[str, Any] | None = None
    delta: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
