"""What each route answers, as pydantic models: the OpenAPI document's response schemas.

The routes build their answers as plain dicts (and return them as ``JSONResponse``), so these models document the
answers rather than produce them; the schemathesis test (``tests/service/schemas/test_openapi_fuzz.py``) holds them to the
real responses by validating every answer it receives against them. Two models here are also the one definition
of the error envelopes that :func:`service.http.app.error_response` and the routes build: :class:`ErrorEnvelope`
(loadmaster's own routes) and :class:`OpenAIErrorEnvelope` (OpenAI's shape, under ``/v1``).

Optional keys that a route leaves out unless asked for (TGI ``details``, ``top_tokens``) are fields with a default,
so the schema does not require them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Answer(BaseModel):
    """Base of the response models: closed (an undocumented key is a mismatch the fuzz test reports)."""

    model_config = ConfigDict(extra="forbid")


# -- errors ------------------------------------------------------------------------------------------------------


class ErrorEnvelope(_Answer):
    """Every error of loadmaster's own routes (and a TGI stream's error event): the message says what was wrong and
    what to do; ``error_type`` is stable (``validation``, ``overloaded``, ``not_ready``, ``authentication``,
    ``payload_too_large``, ``unsupported_media_type``, ``plan_limit``, ``plan``, ``checkpoint``, ``generation``...)."""

    error: str = Field(description="What was wrong, and what to do about it.")
    error_type: str = Field(description="A stable machine-readable kind of error.")


class OpenAIErrorDetail(_Answer):
    message: str
    type: str = Field(
        description="OpenAI's kinds: invalid_request_error, not_found_error, authentication_error, rate_limit_error, "
        "service_unavailable_error, server_error."
    )
    param: str | None = None
    code: str | None = Field(None, description="e.g. model_not_found")


class OpenAIErrorEnvelope(_Answer):
    """Every error under ``/v1``, in OpenAI's shape (a request that fails validation is a 400 there, not a 422)."""

    error: OpenAIErrorDetail


def error_body(message: str, error_type: str) -> dict[str, Any]:
    """The error envelope of loadmaster's own routes, as a JSON-ready dict."""
    return ErrorEnvelope(error=message, error_type=error_type).model_dump()


#: loadmaster's error types as OpenAI names them (what its clients branch on); by status where the type is shared.
OPENAI_ERROR_TYPES = {
    "validation": "invalid_request_error",
    "authentication": "authentication_error",
    "overloaded": "rate_limit_error",
    "not_ready": "service_unavailable_error",
    "generation": "server_error",
}


def openai_error_type(error_type: str, status: int | None = None) -> str:
    """OpenAI's ``error.type`` for one of loadmaster's types: a 404 is ``not_found_error`` whatever its type."""
    if status == 404:
        return "not_found_error"
    return OPENAI_ERROR_TYPES.get(error_type, error_type)


def openai_error_body(
    message: str, error_type: str, code: str | None = None, status: int | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope, as a JSON-ready dict, with OpenAI's error type (:func:`openai_error_type`)."""
    detail = OpenAIErrorDetail(message=message, type=openai_error_type(error_type, status), code=code)
    return OpenAIErrorEnvelope(error=detail).model_dump()


# -- TGI ---------------------------------------------------------------------------------------------------------

FinishReason = Literal["length", "eos_token", "stop_sequence"]


class TGIToken(_Answer):
    id: int
    text: str
    logprob: float | None
    special: bool


class TGIPrefillToken(_Answer):
    id: int
    text: str
    logprob: float | None = Field(description="null for the first prompt token.")


class TGISequenceDetails(_Answer):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[TGIPrefillToken] = Field(description="The prompt's tokens with decoder_input_details, else [].")
    tokens: list[TGIToken]
    top_tokens: list[list[TGIToken]] | None = Field(None, description="With top_n_tokens: alternatives per token.")


class TGIBestOfSequence(TGISequenceDetails):
    generated_text: str


class TGIDetails(TGISequenceDetails):
    best_of_sequences: list[TGIBestOfSequence] | None = Field(None, description="With best_of > 1: the others.")


class TGIGenerateResponse(_Answer):
    """``POST /generate`` (and each item of ``POST /``'s list)."""

    generated_text: str
    details: TGIDetails | None = Field(None, description="With parameters.details=true.")


class TGIStreamDetails(_Answer):
    finish_reason: FinishReason
    generated_tokens: int
    input_length: int
    seed: int | None


class TGIStreamEvent(_Answer):
    """One ``data:`` event of ``POST /generate_stream``; the last one carries ``generated_text`` and ``details``.
    A failure mid-stream is one :class:`ErrorEnvelope` event instead."""

    index: int
    token: TGIToken
    generated_text: str | None
    details: TGIStreamDetails | None
    top_tokens: list[TGIToken] | None


class TokenCount(_Answer):
    """vLLM's ``POST /tokenize`` answer (for ``prompt`` or ``messages``)."""

    tokens: list[int]
    count: int
    max_model_len: int = Field(description="--max-total-tokens: the most tokens a sequence may hold here.")


class DetokenizeAnswer(_Answer):
    """``POST /detokenize``: the text of the token ids."""

    prompt: str


class TokenSpan(_Answer):
    """One token of ``POST /tokenize``: its id, and the span of the input it covers."""

    id: int
    text: str
    start: int
    stop: int


# -- health and info ---------------------------------------------------------------------------------------------


class HealthResponse(_Answer):
    status: Literal["ok"]


class LoadState(_Answer):
    """How far the model's load has come (``GET /health/ready``, and ``status`` in ``GET /info``)."""

    status: str = Field(description="The load phase (ready, loading, failed, ...) or draining / engine stopped.")
    progress: float = Field(ge=0, le=1)
    bytes_done: int
    bytes_total: int
    elapsed_s: float
    rate_bytes_per_s: int | None = None
    error: str | None = Field(None, description="Why the load failed.")
    error_type: str | None = None


class ServerLimits(_Answer):
    max_concurrent_requests: int
    max_batch_size: int = Field(
        description="Sequences of the full context (max_total_tokens) the KV pool holds at once: the plan's slots."
    )
    max_running_sequences: int | None = Field(
        None,
        description="Sequences decoded at once when they are shorter: up to --max-batch-size, while slots x the "
        "longest running sequence stays within kv_pool_tokens.",
    )
    kv_pool_tokens: int | None = Field(
        None, description="The KV pool the plan budgets, in tokens: max_batch_size x max_total_tokens."
    )
    max_input_tokens: int
    max_total_tokens: int
    default_max_new_tokens: int
    max_body_bytes: int


class KernelState(_Answer):
    available: bool
    reason: str


class KernelReport(_Answer):
    choice: str
    kernels: dict[str, KernelState | None]


class ThreadTryInfo(_Answer):
    """A try of one thread more or fewer (``loaders.native.cpu_threads.ThreadTry``)."""

    from_threads: int
    to_threads: int
    steps: int = Field(description="Pure decode steps the try was judged on.")
    time_ratio: float | None = Field(
        description="Median time of the try's steps over the same-width steps before it; None: no comparable step."
    )
    kept: bool


class CpuThreadsInfo(_Answer):
    """The CPU threads torch and the native kernels run on, and why (``planner.hardware.cpu_share``,
    ``loaders.native.cpu_threads``)."""

    threads: int = Field(description="Threads the engine runs on now.")
    ceiling: int = Field(description="The most it uses: --threads, else the affinity mask capped by the quota.")
    bound: str = Field(description="What set the ceiling: threads (--threads), quota or affinity.")
    reason: str
    affinity: int = Field(description="CPUs in the process's affinity mask.")
    quota: float | None = Field(None, description="The cgroup CPU quota in CPUs, if any.")
    quota_source: str | None = None
    adaptive: bool = Field(description="Whether the count drops below the ceiling while the CPU is contended.")
    wait_ratio: float | None = Field(
        None, description="Last measured run-queue wait of the process's threads per second they ran."
    )
    trying: bool = Field(False, description="Whether a try of another count is running now.")
    last_trial: ThreadTryInfo | None = Field(None, description="The last finished try of another count.")
    changes: int = Field(0, description="Times the count changed since the engine started.")
    prefill_tokens: int | None = Field(None, description="The engine's prefill budget per step now.")


class DevicePipelineInfo(_Answer):
    """The micro-batch schedule over this host's GPUs (``service.engine.multi_gpu_runner``)."""

    active: bool
    reason: str
    runs: int
    devices: list[str]
    layers: list[list[int]]
    micro_batches: int
    standin: bool


class DraftModelInfo(_Answer):
    """The draft model: ``--speculate int4|int8``'s (the served checkpoint loaded again, quantized, on the CPU) or
    ``--draft-model``'s (a smaller checkpoint with the same tokenizer, placed by its own plan)."""

    scheme: str = Field(
        description="int4 or int8: the native CPU quantization of the copy's linear layers; model: --draft-model."
    )
    dtype: str = Field(description="The activations it computes with.")
    bytes: int = Field(description="Bytes of weights and buffers it holds in memory.")
    name: str | None = Field(None, description="--draft-model: the draft checkpoint's directory name.")
    reserved_bytes: int | None = Field(
        None, description="Bytes the target's plan reserved on the draft's device for it (weights, working memory, KV)."
    )
    cost: str | None = Field(None, description="The plan's sentence on what the draft costs the target's residency.")


class SpeculationInfo(_Answer):
    """Speculative decoding (``service.engine.speculation.verification``): the mode, its limit and what it achieved so far."""

    mode: str = Field(
        description="off, ngram (prompt lookup), int4/int8 (the model's own weights quantized as the draft model), "
        "or model (--draft-model)."
    )
    draft_tokens: int = Field(
        description="Most draft tokens a row proposes per verify pass: --speculate-tokens, else 4, or 8 once the "
        "loaded model's plan streams its weights."
    )
    proposed: int = 0
    accepted: int = 0
    verify_passes: int = 0
    acceptance_rate: float | None = Field(None, description="Accepted over proposed draft tokens (none yet: null).")
    tokens_per_pass: float | None = Field(None, description="Tokens a verify pass produced on average.")
    predicted_tokens_per_s: float | None = Field(
        None,
        description="One stream's tokens/s with the draft model the plan predicts, redone at the acceptance "
        "measured so far (null without a draft model).",
    )
    predicted_at_acceptance: float | None = Field(
        None, description="The acceptance that prediction is at: measured, else the plan's stated default."
    )
    draft_model: DraftModelInfo | None = Field(
        None, description="The draft model (int4/int8 copy or --draft-model): what it holds and what it costs."
    )


class InfoResponse(_Answer):
    """``GET /info``: the version, load state and limits; with the model loaded, what was loaded and how."""

    version: str
    status: LoadState
    limits: ServerLimits
    model_id: str | None
    model_path: str | None = None
    architecture: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    device_map: dict[str, Any] | None = None
    plan: dict[str, Any] | None = Field(None, description="The plan in force, as POST /plan answers it.")
    memory: dict[str, Any] | None = Field(None, description="Per device: planned and measured bytes.")
    load_stats: Any = None
    cpu_kernels: KernelReport | None = None
    cpu_threads: CpuThreadsInfo | None = Field(None, description="CPU threads in use, their ceiling and why.")
    prefix_cache: bool = Field(True, description="Whether prompts reuse the KV of prefixes the cache holds.")
    pipeline: dict[str, Any] | None = Field(
        None, description="Served with --pipeline: every stage's rank, layers, memory planned and measured, busy time."
    )
    device_pipeline: DevicePipelineInfo | None = Field(
        None, description="Whether steps run in micro-batches over the GPUs of this host, over which runs, and why."
    )
    speculation: SpeculationInfo | None = Field(None, description="Speculative decoding: mode and acceptance.")


# -- /plan -------------------------------------------------------------------------------------------------------


class PlanDraft(_Answer):
    """Speculative decoding's draft model as the plan reserved room for it (``planner.types.DraftBudget``)."""

    label: str = Field(description="What drafts: 'int4 copy', 'int8 copy', or 'draft model NAME'.")
    device: int | str = Field(description="Where it is held, and where its bytes were reserved.")
    weights: int = Field(description="Its resident weights, bytes.")
    working: int = Field(description="The activations of its own forwards, bytes.")
    kv_per_token: int = Field(description="Its KV cache per token of one sequence, bytes (times slots x context).")
    tokens: int = Field(4, description="Most draft tokens a verify pass checks (--speculate-tokens).")


class PlanWorkload(_Answer):
    dtype: str
    quantization: str | None
    batch_size: int
    context: int
    cpu_quantization: str | None = None
    prefill_chunk: int | None = None
    draft: PlanDraft | None = Field(None, description="The draft model the plan reserves room for, if any.")


class PlanBudget(_Answer):
    device: int | str
    capacity: int
    weights: int
    kv_cache: int
    activations: int
    reserve: int
    blocks: list[str]
    draft: int = Field(0, description="Held for the draft model (weights, working memory, KV), inside the total.")
    total: int
    free: int


class PlanConcurrentRate(_Answer):
    sequences: int
    tokens_per_s: float = Field(description="Aggregate decode tokens/s with this many sequences decoding at once.")


class PlanPrediction(_Answer):
    load_seconds: float
    decode_tokens_per_s: float = Field(description="Decode tokens/s of the workload's batch, all rows together.")
    seconds_per_token_by_device: dict[str, float]
    cost_model: str
    lone_decode_tokens_per_s: float | None = Field(None, description="One stream alone on the same placement.")
    speculative_tokens_per_s: float | None = Field(
        None, description="One stream with the draft model, at speculative_acceptance (null without a draft)."
    )
    speculative_acceptance: float | None = Field(
        None, description="The share of draft tokens accepted that speculative_tokens_per_s assumes."
    )
    concurrent: list[PlanConcurrentRate] = Field(
        default_factory=list,
        description="Aggregate decode tokens/s with several short sequences decoding at once on the same placement.",
    )
    disk_cached: bool | None = Field(
        None,
        description="Whether the disk share stays in the page cache between tokens (null without a disk share).",
    )


class WhatIfAnswer(_Answer):
    question: Literal["max_context", "max_batch"]
    batch_size: int | None = None
    context: int | None = None
    max_context: int | None = None
    max_batch_size: int | None = None
    limit: int | None = None


class PlanResponse(_Answer):
    """``POST /plan``: the Plan JSON (``Plan.from_dict`` reads it back), with ``what_if`` when asked."""

    model: str
    architecture: str
    strategy: str
    workload: PlanWorkload
    device_map: dict[str, int | str]
    budgets: list[PlanBudget]
    offloaded_bytes: int
    prediction: PlanPrediction
    warnings: list[str]
    reasons: list[str]
    placement: dict[str, int | str]
    fingerprint: str | None
    revision: str | None
    cpu_compute: list[str] = Field(
        default_factory=list, description="Device-map keys on cpu that compute there (routed experts, CPU layers)."
    )
    kernels: dict[str, str] = Field(
        default_factory=dict,
        description="Device label (GPU 0, cpu, disk) -> the kernel its layers run on (linear_q8, bitsandbytes int8, ...).",
    )
    what_if: WhatIfAnswer | None = None


class NoPlanResponse(_Answer):
    """``POST /plan`` with ``what_if`` when nothing fits the request as given: no plan, and the what-if answer."""

    plan: None
    what_if: WhatIfAnswer


class ClusterPlanResponse(_Answer):
    """``POST /plan`` with ``hosts``: the ClusterPlan JSON (``ClusterPlan.from_dict`` reads it back); each stage
    holds its host's Plan."""

    model: str
    architecture: str
    workload: PlanWorkload
    micro_batches: int
    micro_batch_size: int
    inter_host_bandwidth: float
    stages: list[dict[str, Any]]
    hops: list[dict[str, Any]]
    prediction: dict[str, Any]
    reasons: list[str]
    fingerprint: str | None
    revision: str | None


# -- OpenAI ------------------------------------------------------------------------------------------------------

OpenAIFinish = Literal["length", "stop"]
ChatFinish = Literal["length", "stop", "tool_calls"]


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Answer):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinish


class CompletionResponse(_Answer):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinish | None


class CompletionChunk(_Answer):
    """One ``data:`` event of a streamed completion (then ``data: [DONE]``). With ``stream_options.include_usage``
    the last chunk has no choices and carries ``usage``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Answer):
    content: list[ChatTokenLogprob]


class FunctionCallOut(_Answer):
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model wrote them.")


class ToolCallOut(_Answer):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(_Answer):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(None, description="The model's thinking, for templates that think.")
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Answer):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish


class ChatCompletionResponse(_Answer):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Answer):
    name: str | None = None
    arguments: str


class ToolCallDelta(_Answer):
    """A piece of a streamed tool call: ``id``, ``type`` and the name come with its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish | None


class ChatCompletionChunk(_Answer):
    """One ``data:`` event of a streamed chat completion (then ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]
