"""The ``loadmaster`` command: ``serve``, ``demo``, the lead's ``plan`` / ``estimate``, and ``env``.

Flags map one to one onto :class:`~service.settings.ServiceSettings` fields; a flag not given leaves the field to
its ``LOADMASTER_*`` environment variable, then to its default. Bad input exits 2 with one line, no traceback.

``plan`` and ``estimate`` must start fast (a cold ``loadmaster plan`` is meant to take well under two seconds), so
this module imports nothing heavy at the top: pydantic-settings alone costs more than a second to import here, and
torch, transformers, FastAPI and uvicorn more still. ``serve`` imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from planner.errors import LoadmasterError, PlanError
from service.cli import startup_gc

if TYPE_CHECKING:
    from service.settings import ServiceSettings

log = logging.getLogger("service")

#: Flags of ``serve`` besides the planner's: (flag, type, help). Each is the settings field of the same name.
SERVE_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("--host", str, "address to listen on (default 127.0.0.1; 0.0.0.0 in Docker)"),
    ("--port", int, "port to listen on (default 8080)"),
    (
        "--served-model-name",
        str,
        "name reported by /info and /v1/models; more names after commas are aliases (default: the directory's name)",
    ),
    (
        "--responses-store-size",
        int,
        "responses /v1/responses keeps for previous_response_id, least recently used dropped first (default 256)",
    ),
    ("--max-concurrent-requests", int, "requests queued + running; more get 429 (default 128)"),
    ("--max-batch-size", int, "sequences decoded together per step (default 32)"),
    ("--max-input-tokens", int, "longest prompt in tokens (default min(1024, max-total-tokens - 1))"),
    ("--max-total-tokens", int, "prompt + generated tokens per request (default 2048)"),
    ("--default-max-new-tokens", int, "new tokens when a request names none (default 100)"),
    ("--max-body-bytes", int, "largest request body (default 1 MiB)"),
    ("--grace-period", float, "seconds SIGTERM waits for in-flight requests (default 30)"),
    ("--weights-watch-interval", float, "seconds between checks that the weight files are unchanged (default 2)"),
    ("--header-timeout", float, "seconds a connection has to send a whole request head; then closed (default 30)"),
    ("--body-timeout", float, "seconds a request body may pause between reads; then closed (default 30)"),
    ("--sse-ping-interval", float, "seconds between keep-alive comments on an idle event stream; 0: none (default 15)"),
    ("--grammar-timeout", float, "seconds one request's response_format/grammar may take to compile (default 10)"),
    ("--grammar-workers", int, "grammar compiler processes (default 1 up to 3 CPUs, else CPUs/4, at most 4)"),
    ("--grammar-queue", int, "grammars that may wait for a compiler; more get 429 at once (default 8)"),
    ("--grammar-cache", int, "compiled grammars kept by schema hash (default 256)"),
    ("--plan-max-layers", int, "most layers a model sent to /plan may have (default 1024)"),
    ("--plan-max-hidden-size", int, "largest hidden/intermediate/vocab size /plan takes (default 131072)"),
    ("--plan-max-tensors", int, "most tensors a model sent to /plan may have (default 200000)"),
    ("--plan-timeout", float, "seconds one /plan may compute before it is abandoned (default 30)"),
    ("--plan-workers", int, "/plan computations at once; more get 429 (default 2)"),
    ("--log-level", str, "critical, error, warning, info, debug or trace (default info)"),
    (
        "--threads",
        int,
        "CPU threads, fixed (default: the CPUs of the affinity mask and cgroup quota, fewer while contended)",
    ),
    (
        "--cpu-kernels",
        str,
        "auto, native or torch: bf16/fp32 linear layers on the CPU through the native kernels "
        "(default auto: where they build)",
    ),
    (
        "--cpu-quantized-dir",
        str,
        "folder to save --cpu-quantization's weights in as safetensors (and a GPTQ/AWQ/compressed-tensors "
        "checkpoint's repacked layers), so the next load maps them instead of quantizing again",
    ),
)


def _add_serve_flags(parser: argparse.ArgumentParser, with_model: bool) -> None:
    from service.cli.plan_command import add_planner_flags

    if with_model:
        parser.add_argument(
            "model",
            nargs="?",
            default=None,
            help="model directory or Hub id org/name[@revision] (or set LOADMASTER_MODEL)",
        )
        parser.add_argument(
            "--demo", action="store_true", default=None, help="build (once, cached) and serve the embedded demo model"
        )
    add_planner_flags(parser)
    g = parser.add_argument_group("server")
    for flag, typ, help_text in SERVE_FLAGS:
        g.add_argument(flag, type=typ, default=None, help=help_text)
    g.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of prompt prefixes the cache holds (default on; --no-prefix-cache prefills every prompt "
        "whole, or LOADMASTER_PREFIX_CACHE=false)",
    )
    g.add_argument(
        "--speculate",
        default=None,
        metavar="{off,ngram,int4,int8}",  # checked by the settings: a bad value is one line, exit 2
        help="speculative decoding: draft tokens and verify them in one forward. ngram drafts by prompt lookup; "
        "int4/int8 load the model's own weights a second time, quantized and resident on the CPU, and draft with "
        "that copy (about 1/8 or 1/4 of fp32; for a model streamed from disk, not one placed on a GPU). Default "
        "off; greedy output is unchanged, sampled output keeps its distribution",
    )
    g.add_argument(
        "--speculate-tokens",
        type=int,
        default=None,
        help="most draft tokens a request proposes per pass (default 4, or 8 where the plan streams the weights)",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        metavar="DIR",
        help="draft with this smaller checkpoint (safetensors + config + the target's tokenizer): placed by the "
        "planner beside the target, resident, its KV budgeted; refused with --speculate and --pipeline",
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="accepted key (Authorization: Bearer or x-api-key), repeatable (or LOADMASTER_API_KEY=k1,k2); health "
        "stays open",
    )
    g.add_argument(
        "--accept-any-model",
        action="store_true",
        default=None,
        help="answer requests whatever 'model' they name (default: 404 model_not_found for other names)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral"],
        default=None,
        help="how the model writes tool calls (default: read from its chat template)",
    )
    g.add_argument(
        "--model-root",
        action="append",
        default=None,
        help="directory /plan may read models from, repeatable (or LOADMASTER_MODEL_ROOT=a,b)",
    )
    g.add_argument(
        "--allowed-root",
        action="append",
        default=None,
        help="directory the model's files may resolve into (symlinks followed), repeatable (or "
        "LOADMASTER_ALLOWED_ROOT=a,b); default: the served model's own directory",
    )
    g.add_argument(
        "--allow-hub-plan",
        action="store_true",
        default=None,
        help="let /plan take Hub ids org/name[@rev]: it then makes outbound requests to the Hub "
        "(or LOADMASTER_ALLOW_HUB_PLAN=1)",
    )
    _add_pipeline_flags(parser)
    # The planner flags' own defaults would hide the environment: unset means "not given" here.
    parser.set_defaults(strategy=None, batch_size=None, complete=None)


def _add_pipeline_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("pipeline (one stage per rank, under torchrun; docs/pipeline.md)")
    p.add_argument(
        "--pipeline",
        action="store_true",
        default=None,
        help="serve as one rank of a pipeline: run every rank with the same flags under torchrun; rank 0 serves HTTP",
    )
    p.add_argument("--pipeline-timeout", type=float, default=None, help="seconds a rank may stay silent (default 30)")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="groups a batch is split into: over the ranks (default: ranks), or without --pipeline over the GPUs "
        "of this host that hold the decoder layers (default: 2 per GPU)",
    )
    p.add_argument("--inter-host-bandwidth", default=None, help="link between hosts for the prediction, e.g. 100Gb")


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> ServiceSettings:
    """Settings from the flags that were given; the rest come from ``LOADMASTER_*`` or the defaults."""
    from service.settings import ServiceSettings

    values = {
        name: getattr(args, name) for name in ServiceSettings.model_fields if getattr(args, name, None) is not None
    }
    values.update(overrides)
    return ServiceSettings(**values)


def _configure_logging(level: str) -> None:
    """Every record on one line, whatever a request put in it (:mod:`service.log_text`); uvicorn's own loggers
    propagate here too (``log_config=None`` below), so they are escaped the same way."""
    from service import log_text

    log_text.install(getattr(logging, level.upper(), logging.INFO))


def curl_example(settings: ServiceSettings) -> str:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    # never the key itself: the log is read by more people than the key is meant for
    auth = " -H 'Authorization: Bearer <your key>'" if settings.api_key else ""
    return (
        f"curl -s http://{host}:{settings.port}/generate{auth} -H 'Content-Type: application/json' "
        '-d \'{"inputs": "Once upon a time", "parameters": {"max_new_tokens": 30}}\''
    )


#: Seconds a thread holds the GIL before another that waits for it is let in (Python's default: 0.005).
SWITCH_INTERVAL_S = 0.001


def _set_threads(requested: int | None) -> None:
    """torch's thread count for the load and every thread started after it (the engine's own adapts below it):
    ``--threads``, else the CPUs of the affinity mask capped by the cgroup quota (``/info`` says which)."""
    import torch

    from planner.hardware.cpu_share import cpu_share

    share = cpu_share(requested)
    torch.set_num_threads(share.threads)
    log.info("CPU threads: %s", share.reason)


def serve(settings: ServiceSettings, loader: Any = None, prepare: Any = None) -> int:
    """Run the server until SIGTERM/SIGINT; in-flight requests get ``grace_period`` seconds to finish.

    ``loader`` replaces the one-process load (a pipeline's rank 0 loads its stage); ``prepare(app)`` runs on the app
    before it serves."""
    from service.cli.startup_imports import skip_triton_without_cuda

    skip_triton_without_cuda()  # before anything imports transformers' models, which would import Triton
    import uvicorn

    from service.http.app import create_app
    from service.http.connection_guard import guarded_protocol
    from service.model.background_load import check_model_source

    _configure_logging(settings.log_level)
    # Worker threads (body parsing, tokenization, detokenization) hold the GIL in bursts; the event loop waits up to
    # the switch interval for each handover, so a shorter one keeps /health and streams answering while they run.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    check_model_source(settings)  # a missing directory or an unservable Hub id is a usage error now, not later
    settings.check_plan_flags()  # so are unreadable planner flags
    _set_threads(settings.threads)  # after the usage checks: a usage error stays one line on stderr
    app = create_app(settings, loader=loader)
    if prepare is not None:
        prepare(app)
    runtime = app.state.runtime
    failed_load: list[str] = []

    class DrainingServer(uvicorn.Server):
        """Marks the service as draining the moment a stop signal arrives (readiness 503, no new requests).

        At the end of the grace period the engine is stopped, which ends every open request with a ``not_ready``
        error: streams get it as their last event and plain requests as a JSON 503. Uvicorn's own deadline is a
        little later, so those answers are written before it cancels what is left."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not runtime.draining:
                runtime.draining = True
                timer = threading.Timer(settings.grace_period, runtime.end_grace_period)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutdown; a drained SIGTERM is a clean exit (status 0)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list) and sig == signal.SIGTERM:
                captured[:] = [s for s in captured if s != signal.SIGTERM]

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=settings.hard_stop_s,
        access_log=False,
        http=guarded_protocol(settings.header_timeout, settings.body_timeout),
        log_config=None,  # uvicorn's records reach the root logger's escaping formatter
    )
    server = DrainingServer(config)

    def on_failed(message: str) -> None:
        # As TGI and vLLM do: a server whose model cannot load exits non-zero, so its supervisor sees it.
        failed_load.append(message)
        server.should_exit = True

    runtime.host.on_failed(on_failed)
    # the start's garbage collector pause (run_serve, run_demo) ends when the load does, either way
    runtime.host.on_ready(lambda _loaded: startup_gc.resume_collection())
    runtime.host.on_failed(lambda _message: startup_gc.resume_collection())
    log.info(
        "listening on http://%s:%d (model loads in the background; GET /health/ready)", settings.host, settings.port
    )
    log.info("try: %s", curl_example(settings))
    server.run()
    if not failed_load:
        return 0
    # a model that does not fit the memory it was given is the operator's to change (flags, box): a usage error,
    # exit 2 as for a bad flag; anything else that stopped the load, 1
    return 2 if runtime.host.state.error_type == PlanError.error_type else 1


def run_serve(args: argparse.Namespace) -> int:
    with startup_gc.paused_during_start():
        return _run_serve(args)


def _run_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if settings.pipeline:  # one rank of a pipeline under torchrun (service/pipeline/launch.py)
        from service.pipeline import launch

        _configure_logging(settings.log_level)
        rank, world = launch.join_group(settings)
        if rank != 0:
            startup_gc.resume_collection()  # a stage rank runs its own load and loop, both on this thread
            return launch.serve_stage_rank(settings, rank, world)
        rank0 = launch.Rank0(world)
        return rank0.finish(serve(settings, loader=rank0.load, prepare=rank0.prepare))
    if settings.inter_host_bandwidth is not None:
        raise ValueError("--inter-host-bandwidth applies to a pipeline: add --pipeline")
    # --micro-batches alone splits steps over this host's GPUs; the engine refuses it at load if the plan does not
    # put the decoder layers on several (service/engine/multi_gpu_runner.py)
    return serve(settings)


def run_demo(args: argparse.Namespace) -> int:
    with startup_gc.paused_during_start():
        return _run_demo(args)


def _run_demo(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, demo=True)
    if settings.pipeline or settings.micro_batches is not None or settings.inter_host_bandwidth is not None:
        raise ValueError(
            "the demo serves one process; for a pipeline run 'loadmaster serve DIR --pipeline' under torchrun"
        )
    return serve(settings)


def build_parser() -> argparse.ArgumentParser:
    from service.cli import env_command, plan_command

    parser = argparse.ArgumentParser(
        prog="loadmaster", description="Plan device maps, load big models, and serve them over HTTP."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    s = sub.add_parser(
        "serve",
        help="serve a model over HTTP (TGI and OpenAI routes, /plan, /metrics)",
        description="Serve a model. Every flag is also an environment variable LOADMASTER_<FLAG>.",
    )
    _add_serve_flags(s, with_model=True)
    s.set_defaults(func=run_serve)
    d = sub.add_parser(
        "demo", help="build (once) and serve the embedded demo model", description="Same as 'serve --demo'."
    )
    _add_serve_flags(d, with_model=False)
    d.set_defaults(func=run_demo)
    plan_command.register(sub)
    env_command.register(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    pydantic = sys.modules.get("pydantic")  # a pydantic error can only come from a run that imported pydantic
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ())) or "settings"
            parts.append(f"{where}: {err.get('msg')}")
        return "invalid settings: " + "; ".join(parts)
    return " ".join(str(exc).split())


def main(argv: list[str] | None = None) -> int:
    from service.cli import import_table

    import_table.install()  # before any command imports transformers: its import table from the cache
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (LoadmasterError, ValueError, OSError) as exc:
        sys.stderr.write(f"loadmaster: error: {_one_line(exc)}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
