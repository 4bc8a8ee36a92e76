"""The service's configuration: one pydantic-settings model read from flags and ``LOADMASTER_*`` variables.

Every ``loadmaster serve`` flag is a field here, so ``--max-batch-size 8`` and ``LOADMASTER_MAX_BATCH_SIZE=8`` are
the same setting; flags given on the command line win over the environment, which wins over the defaults.
List settings (``api_key``, ``model_root``, ``max_memory``) accept a comma-separated string in the environment.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from planner.errors import PlanError
from planner.placement.inputs import PlanInputs
from planner.placement.quantization_choice import NATIVE_ON_CPU
from planner.placement.sizing import normalize_quantization
from planner.types import PREFILL_CHUNK

CommaList = Annotated[list[str], NoDecode]

#: Seconds between the end of the grace period (open requests get their error) and uvicorn's hard stop.
GRACE_MARGIN_S = 2.0


def _bitsandbytes_on_cpu(quantization: str | None) -> bool:
    """Whether ``--quantization`` stays bitsandbytes where no GPU computes (its int8 and that name's aliases are the
    CPU's native int8: :mod:`planner.placement.quantization_choice`). An unknown name is left for
    :meth:`ServiceSettings.check_plan_flags` to refuse with its message."""
    try:
        quant = normalize_quantization(quantization)
    except PlanError:
        return False
    return quant is not None and quant not in NATIVE_ON_CPU


class ServiceSettings(BaseSettings):
    """What ``loadmaster serve`` runs: the model, how it is planned, the HTTP listener and the limits."""

    model_config = SettingsConfigDict(env_prefix="LOADMASTER_", extra="ignore", validate_default=True)

    # The model to serve and how it is placed.
    model: str | None = Field(
        None,
        description="Model directory (sharded safetensors + config + tokenizer), or a "
        "Hub id org/name[@revision] fetched into the Hub cache (HF_HOME).",
    )
    demo: bool = Field(False, description="Build (once, cached) and serve the embedded demo model.")
    served_model_name: str | None = Field(
        None,
        description="Name reported by /info and /v1/models; more names after commas are aliases the OpenAI and "
        "Anthropic routes accept in 'model' (default: the model folder's name).",
    )
    accept_any_model: bool = Field(
        False, description="Serve requests whatever 'model' they name (default: 404 model_not_found for others)."
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "harmony"] | None = Field(
        None, description="How the model writes tool calls (default: read from its chat template)."
    )
    responses_store_size: int = Field(
        256,
        ge=0,
        description="Responses kept in memory for /v1/responses' previous_response_id (least recently used go "
        "first; 0: none kept).",
    )
    max_memory: CommaList = Field(default_factory=list, description="Per-device limits, DEV=SIZE (e.g. 0=20GiB).")
    gpus: str | None = Field(None, description="Declared GPUs NxSIZE, to plan for hardware that is not here.")
    strategy: str = Field("auto", description="auto, balanced, balanced_low_0, sequential, or a JSON map / @file.")
    complete: bool = Field(False, description="Let the planner place modules a custom map leaves out.")
    dtype: str | None = None
    quantization: str | None = None
    batch_size: int | None = Field(None, ge=1, description="Planned batch size (default: max_batch_size).")
    context: int | None = Field(None, ge=1, description="Planned context length (default: max_total_tokens).")
    gpu_reserve: str | None = Field(None, description="Held back per GPU for the CUDA context (default 512MiB).")
    offload_folder: str | None = None
    bandwidth: CommaList = Field(default_factory=list, description="Cost-model rates KIND=RATE (gpu=3.3TB, ...).")

    # The listener.
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    api_key: CommaList = Field(
        default_factory=list, description="API keys (Bearer or x-api-key); when set, all but /health* need one."
    )
    model_root: CommaList = Field(default_factory=list, description="Directories /plan may read models from.")
    allow_hub_plan: bool = Field(
        False, description="Let /plan read Hub ids (config + shard headers: outbound requests to HF_ENDPOINT)."
    )
    allowed_root: CommaList = Field(
        default_factory=list,
        description="Directories the served model's files (and /plan's, besides --model-root) may resolve into "
        "(default: the served model's own directory).",
    )
    grace_period: float = Field(30.0, ge=0, description="Seconds SIGTERM waits for in-flight requests.")
    weights_watch_interval: float = Field(
        2.0,
        ge=0,
        description="Seconds between checks that the served weight files are unchanged; a change stops the server "
        "(503, exit 1) (0: no checks).",
    )
    header_timeout: float = Field(
        30.0, ge=0, description="Seconds a connection has to send a complete request head, else it is closed (0: none)."
    )
    body_timeout: float = Field(
        30.0, ge=0, description="Seconds a request body may pause between reads, else it is closed (0: none)."
    )
    sse_ping_interval: float = Field(
        15.0, ge=0, description="Seconds between keep-alive comments on an idle event stream (0: none)."
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info", description="critical, error, warning, info, debug or trace."
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads, fixed (default: the affinity mask's CPUs capped by the cgroup quota, fewer while "
        "the CPU is contended).",
    )
    cpu_kernels: Literal["auto", "native", "torch"] = Field(
        "auto", description="bf16/fp32 decode on the CPU: native kernels where they build (auto), always, or never."
    )
    cpu_quantization: Literal["int8", "int4"] | None = Field(
        None, description="Weight-only int8/int4 for CPU and disk layers, quantized at load (GPU: quantization)."
    )
    cpu_quantized_dir: str | None = Field(
        None,
        description="Where --cpu-quantization saves its weights (safetensors) for the next load to map, and a "
        "GPTQ/AWQ/compressed-tensors checkpoint its repacked layers.",
    )

    # A pipeline: one stage per torchrun rank (service/pipeline/launch.py).
    pipeline: bool = Field(False, description="Serve as one rank of a pipeline under torchrun (rank 0 serves HTTP).")
    pipeline_timeout: float = Field(30.0, gt=0, description="Seconds a pipeline rank may stay silent.")
    micro_batches: int | None = Field(
        None,
        ge=1,
        description="Groups a pipelined batch is split into: over --pipeline ranks, or over the GPUs of this host "
        "when the plan puts the decoder layers on several (default 2 per GPU run).",
    )
    inter_host_bandwidth: str | None = Field(None, description="Link between pipeline hosts (prediction), e.g. 100Gb.")

    #: Test only, no flag: split the decoder layers into this many stand-in device runs that all compute on the
    #: CPU, so the device pipeline serves on a machine without GPUs (service/engine/multi_gpu_runner.py).
    standin_device_runs: int | None = Field(
        None, ge=2, description="TEST ONLY: serve through the device pipeline over N stand-in runs on the CPU."
    )

    # Limits.
    max_concurrent_requests: int = Field(128, ge=1, description="Queued + running requests; more get 429.")
    max_batch_size: int = Field(32, ge=1, description="Sequences decoded together in one step.")
    prefix_cache: bool = Field(
        True, description="Reuse the KV of prompt prefixes the cache's slots hold (false: prefill every prompt whole)."
    )
    # Speculative decoding (service/engine/speculation/verification.py).
    speculate: Literal["off", "ngram", "int4", "int8"] = Field(
        "off",
        description="Draft tokens and verify them in one forward: ngram (prompt lookup), int4/int8 (the model's own "
        "weights quantized at load and kept on the CPU as the draft model; needs a CPU/disk plan), or off.",
    )
    speculate_tokens: int | None = Field(
        None,
        ge=1,
        le=16,
        description="Most draft tokens a row proposes per verify pass (default: 4, or 8 where the plan streams the "
        "model's weights: planner.placement.speculative_rate.draft_tokens).",
    )
    draft_model: str | None = Field(
        None,
        description="A smaller checkpoint with the target's tokenizer (directory: safetensors + config + tokenizer) "
        "that drafts for it; placed by the planner beside the target, resident, its KV budgeted. Implies model "
        "drafting: --speculate stays off.",
    )
    max_input_tokens: int | None = Field(None, ge=1, description="Longest prompt (default min(1024, total - 1)).")
    max_total_tokens: int = Field(2048, ge=2, description="Prompt + generated tokens of one request.")
    default_max_new_tokens: int = Field(100, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    grammar_timeout: float = Field(
        10.0, gt=0, description="Seconds compiling one request's response_format / grammar may take (422 beyond)."
    )
    grammar_workers: int | None = Field(
        None,
        ge=1,
        description="Grammar compiler processes (default: 1 up to 3 CPUs, else a quarter of the CPUs, at most 4).",
    )
    grammar_queue: int = Field(8, ge=0, description="Grammars that may wait for a compiler; more get 429 at once.")
    grammar_cache: int = Field(256, ge=0, description="Compiled grammars kept by schema hash (a repeat costs nothing).")

    # Limits of /plan: what one anonymous request may make the planner build and search.
    plan_max_layers: int = Field(1024, ge=1, description="Most layers (num_hidden_layers and the like) /plan takes.")
    plan_max_hidden_size: int = Field(1 << 17, ge=1, description="Largest hidden/intermediate/vocab size /plan takes.")
    plan_max_tensors: int = Field(200_000, ge=1, description="Most tensors in a model /plan takes.")
    plan_timeout: float = Field(30.0, gt=0, description="Seconds one /plan may compute before it is abandoned (422).")
    plan_workers: int = Field(2, ge=1, description="/plan computations running at once; more wait for a free one.")

    @field_validator("api_key", "model_root", "allowed_root", "max_memory", "bandwidth", mode="before")
    @classmethod
    def _split_commas(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return []
        if isinstance(value, (str, list, tuple)):
            items = [value] if isinstance(value, str) else list(value)
            parts = [part.strip() for item in items for part in str(item).split(",")]
            if info.field_name == "api_key" and any(not part for part in parts):
                # An empty key must never mean "no authentication": that is a typo or an unset secret.
                raise ValueError(
                    "an API key is empty or blank; give a real key, or leave --api-key / LOADMASTER_API_KEY unset "
                    "to serve without authentication"
                )
            return [part for part in parts if part]
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_standins(self) -> ServiceSettings:
        if self.standin_device_runs is not None and self.pipeline:
            raise ValueError(
                "standin_device_runs (LOADMASTER_STANDIN_DEVICE_RUNS, test only) splits one process's layers; "
                "unset it to serve with --pipeline"
            )
        return self

    @model_validator(mode="after")
    def _check_speculation(self) -> ServiceSettings:
        if self.speculate != "off" and self.pipeline:
            raise ValueError(
                "--speculate does not apply to a --pipeline (its ranks run one token a row); serve without "
                "--speculate, or serve one process"
            )
        if self.draft_model is not None:
            self._check_draft_model(self.draft_model)
        if self.speculate in ("int4", "int8"):
            # the copy drafts on the CPU's native kernels: a target on GPUs decodes faster than it drafts
            bnb = _bitsandbytes_on_cpu(self.quantization)
            gpu_flag = "--gpus" if self.gpus else "--quantization" if bnb else None
            if gpu_flag:
                raise ValueError(
                    f"--speculate {self.speculate} drafts with a CPU-resident quantized copy of the model, for a "
                    f"model served from the CPU and disk; {gpu_flag} places it on GPUs, which decode faster than "
                    "that copy drafts: use --speculate ngram or off there"
                )
        return self

    def _check_draft_model(self, draft: str) -> None:
        """``--draft-model`` is its own draft kind: refused beside another (``--speculate``) and in a pipeline."""
        if self.speculate != "off":
            raise ValueError(
                f"--draft-model drafts with the model it names; --speculate {self.speculate} drafts another way. "
                "Give one of them: --draft-model DIR alone, or --speculate without --draft-model"
            )
        if self.pipeline:
            raise ValueError(
                "--draft-model does not apply to a --pipeline (its ranks run one token a row); serve without "
                "--draft-model, or serve one process"
            )
        if not draft.strip():
            raise ValueError("--draft-model is empty; give the draft model's directory, or leave it unset")

    @property
    def speculation_mode(self) -> Literal["off", "ngram", "int4", "int8", "model"]:
        """How the engine drafts: ``model`` with ``--draft-model``, else ``--speculate``'s mode."""
        return "model" if self.draft_model is not None else self.speculate

    @model_validator(mode="after")
    def _check_limits(self) -> ServiceSettings:
        if self.max_input_tokens is None:
            self.max_input_tokens = min(1024, self.max_total_tokens - 1)
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(
                f"max_input_tokens ({self.max_input_tokens}) must be below max_total_tokens "
                f"({self.max_total_tokens}), or no token could be generated; raise --max-total-tokens."
            )
        return self

    def served_names(self) -> list[str]:
        """``--served-model-name``'s names: the first is reported, the rest are aliases."""
        return [part.strip() for part in (self.served_model_name or "").split(",") if part.strip()]

    @property
    def hard_stop_s(self) -> float:
        """Seconds from SIGTERM to uvicorn's hard stop: the grace period, plus a margin in which the error answers
        of the requests still open at its end are written."""
        return self.grace_period + GRACE_MARGIN_S

    def plan_inputs(self) -> PlanInputs:
        """The planning settings, read by the same parser as ``loadmaster plan``'s flags (and so with its messages).
        Batch and context default to what the server allows; activations are budgeted for the engine's real step
        (its prefill chunk and decode rows), not a whole-batch prefill it never runs."""
        return PlanInputs.from_text(
            max_memory=self.max_memory or None,
            gpus=self.gpus,
            strategy=self.strategy,
            dtype=self.dtype,
            quantization=self.quantization,
            batch_size=self.planned_batch_size(),
            context=self.planned_context(),
            gpu_reserve=self.gpu_reserve,
            offload_folder=self.offload_folder,
            bandwidth=self.bandwidth or None,
            complete=self.complete,
            cpu_quantization=self.cpu_quantization,
            prefill_chunk=PREFILL_CHUNK,
        )

    def check_plan_flags(self) -> PlanInputs:
        """The planning settings, every one read now (sizes, strategy, dtype, quantization), so that a bad value
        stops ``serve`` at start with its message instead of failing the load later."""
        from planner.hardware.units import parse_size
        from planner.placement.sizing import normalize_dtype, normalize_quantization
        from planner.placement.solve import check_strategy_name

        inputs = self.plan_inputs()
        for size in (inputs.max_memory or {}).values():
            parse_size(size)
        if self.gpu_reserve is not None:
            parse_size(self.gpu_reserve)
        if self.gpus:
            from planner.hardware.device_inventory import parse_gpus

            parse_gpus(self.gpus)
        check_strategy_name(inputs.checked_strategy())
        normalize_dtype(inputs.dtype, "float32")
        normalize_quantization(inputs.quantization)
        return inputs

    def planned_batch_size(self) -> int:
        return self.batch_size or self.max_batch_size

    def planned_context(self) -> int:
        return self.context or self.max_total_tokens
