"""What one ``/plan`` request may cost: limits on the model it describes, and a worker it cannot hold hostage.

An inline config (or a config.json under the model roots) is checked before anything is built from it: its layer
count and its hidden, intermediate and vocabulary sizes must be under the server's limits (422 naming the limit),
and the skeleton built from it must have at most ``plan_max_tensors`` tensors (413). The build and the search then
run on a daemon thread of their own: the request waits for it at most ``plan_timeout`` seconds, and stops waiting
when its client leaves or the server starts to drain. A thread cannot be killed, so an abandoned one runs on to its
end, but it holds one of ``plan_workers`` slots until then; with every slot taken, ``/plan`` answers 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from starlette.requests import Request

from planner.types import Skeleton
from service.errors import OverloadedError, RequestValidationError
from service.model.model_paths import path_error_reason
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Config keys that count layers, in the spellings transformers' configs use.
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "num_encoder_layers")
#: Config keys that size a dimension of a weight.
SIZE_KEYS = (
    "hidden_size",
    "n_embd",
    "d_model",
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "moe_intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
#: Largest config.json read from a model directory before it is parsed.
MAX_CONFIG_BYTES = 4 << 20
#: How often the wait looks at the server's draining flag.
POLL_S = 0.1


class PlanLimitError(RequestValidationError):
    """The model described to ``/plan`` is larger than this server plans for."""

    error_type = "plan_limit"
    status_code = 422


class PlanTooLargeError(PlanLimitError):
    """The model has more tensors than ``plan_max_tensors``."""

    status_code = 413


class PlanTimeoutError(PlanLimitError):
    """Planning took longer than ``plan_timeout``."""


class PlanAbandoned(Exception):
    """The client left, or the server is draining: nobody waits for this plan any more."""


def _numbers(config: Any, keys: tuple[str, ...], depth: int = 0) -> list[tuple[str, Any]]:
    """(key, value) for every ``keys`` entry in ``config`` and in the sub-configs it nests (text_config, ...)."""
    found: list[tuple[str, Any]] = []
    if depth > 4 or not isinstance(config, Mapping):
        return found
    for key, value in config.items():
        if key in keys:
            found.append((str(key), value))
        elif isinstance(value, Mapping):
            found.extend(_numbers(value, keys, depth + 1))
    return found


def check_config(config: Mapping[str, Any], settings: ServiceSettings) -> None:
    """Refuse a config whose layer count or weight sizes are over the limits, or that are not counts at all."""
    checks = (
        (LAYER_KEYS, settings.plan_max_layers, "plan_max_layers"),
        (SIZE_KEYS, settings.plan_max_hidden_size, "plan_max_hidden_size"),
    )
    for keys, limit, name in checks:
        for key, value in _numbers(config, keys):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise RequestValidationError(f"config {key} must be a whole number (got {value!r}).")
            if value < 0:
                raise RequestValidationError(f"config {key} must be >= 0 (got {value}).")
            if value > limit:
                raise PlanLimitError(
                    f"config {key}={value} is over this server's limit of {limit} ({name}; "
                    f"--{name.replace('_', '-')} raises it)."
                )


def check_model_dir(path: Path, settings: ServiceSettings) -> None:
    """The same limits for a model directory's config.json, read (boundedly) before the planner builds it."""
    config = path / "config.json"
    if not config.is_file():
        return  # the planner says what is missing
    try:
        if config.stat().st_size > MAX_CONFIG_BYTES:
            raise PlanLimitError(f"{config.name} is larger than {MAX_CONFIG_BYTES} bytes; this is not a model config.")
        data = json.loads(config.read_text(encoding="utf-8"))
    except OSError as exc:  # unreadable, or gone since is_file()
        raise RequestValidationError(
            f"{config.name} in that directory cannot be read: {path_error_reason(exc)}."
        ) from None
    except (ValueError, RecursionError) as exc:
        raise RequestValidationError(
            f"{config.name} in that directory is not valid JSON ({exc}); not a model."
        ) from None
    if not isinstance(data, dict):
        raise RequestValidationError(f"{config.name} in that directory is not a JSON object; not a model.")
    check_config(data, settings)


def check_skeleton(skeleton: Skeleton, settings: ServiceSettings) -> None:
    count = sum(len(block.tensors) for block in skeleton.blocks)
    if count > settings.plan_max_tensors:
        raise PlanTooLargeError(
            f"the model has {count} tensors, over this server's limit of {settings.plan_max_tensors} "
            "(plan_max_tensors; --plan-max-tensors raises it)."
        )


class PlanWorkers:
    """Runs plans on daemon threads, at most ``size`` at once, each abandonable by the request that started it."""

    def __init__(self, size: int):
        self._slots = threading.BoundedSemaphore(size)
        self.size = size

    async def run(self, fn: Callable[[], T], *, timeout: float, request: Request, abandon: Callable[[], bool]) -> T:
        """``fn()``'s result; :class:`PlanTimeoutError` after ``timeout`` seconds; :class:`PlanAbandoned` when the
        client disconnects or ``abandon()`` turns true. The thread is left to finish on its own in both cases."""
        if not self._slots.acquire(blocking=False):
            raise OverloadedError(
                f"The planner is busy with {self.size} plan(s); retry after the Retry-After delay.", retry_after=2
            )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        def work() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request, which maps it
                error = exc
            finally:
                self._slots.release()
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop is gone (the server stopped): nobody is waiting
                pass

        threading.Thread(target=work, name="loadmaster-plan", daemon=True).start()
        watcher = asyncio.ensure_future(_gone(request, abandon))
        try:
            finished, _ = await asyncio.wait({done, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if done in finished:
            return done.result()
        done.add_done_callback(_swallow)  # the abandoned thread's outcome is nobody's business now
        if watcher in finished:
            raise PlanAbandoned()
        raise PlanTimeoutError(
            f"planning took longer than {timeout:g} s (plan_timeout) and was abandoned; plan a smaller model or "
            "give fewer devices."
        )


def _swallow(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _gone(request: Request, abandon: Callable[[], bool]) -> None:
    """Return when the client disconnects or ``abandon()`` (the server draining) turns true."""
    while not abandon():
        try:
            message = await asyncio.wait_for(request.receive(), timeout=POLL_S)
        except asyncio.TimeoutError:
            continue
        if message.get("type") == "http.disconnect":
            return
