"""What ``POST /v1/responses`` answers: the response object and its stream's events (documentation models, held
to the real answers by the schemathesis test, as :mod:`service.schemas.response_models`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from service.schemas.response_models import _Answer


class ResponseUsage(_Answer):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(_Answer):
    """A response: ``output`` holds ``reasoning``, ``message`` (``output_text`` parts) and ``function_call`` items;
    ``status`` is ``incomplete`` (``incomplete_details.reason: max_output_tokens``) when the token limit cut it."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"]
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None


class ResponseStreamEvent(_Answer):
    """One event of a stream (its SSE ``event:`` name is its ``type``), numbered by ``sequence_number``."""

    type: str = Field(
        description="response.created, response.in_progress, response.output_item.added, response.content_part.added, "
        "response.output_text.delta, response.function_call_arguments.delta, response.reasoning_text.delta, their "
        ".done events, response.output_item.done, response.completed or response.incomplete; error."
    )
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item_id: str | None = None
    item: dict[str, Any] | None = None
    content_index: int | None = None
    part: dict[str, Any] | None = None
    delta: str | None = None
    text: str | None = None
    logprobs: list[Any] | None = None
    name: str | None = None
    arguments: str | None = None
    message: str | None = None
    code: str | None = None
    param: str | None = None
