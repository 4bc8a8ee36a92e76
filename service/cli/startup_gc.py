"""Python's cyclic garbage collector, paused while the server starts.

Why: starting the server imports torch, transformers and FastAPI and builds the model, which creates a few million
objects that live as long as the process. Every burst of allocations triggers a collection, and each collection of
the older generations walks all of those objects again, none of which is garbage. On the 1B Llama in bf16 that
was about a fifth of process start to ready (``bench.ready``, side by side: 3.63 s before, 3.04 s paused).

So ``serve`` pauses the collector before its first heavy import. When the load ends (ready or failed) the objects
that the start made are frozen (``gc.freeze``: moved to a generation that collections skip, since they are never
freed anyway) and collection resumes, so that collections while serving walk only what serving allocates.
Reference counting, which frees almost everything, runs throughout.

The price: the few garbage cycles the start leaves are frozen with the rest and never freed. On the 1B that is
about 12,700 small objects (~8 MB: type annotations, closures, checkpoint header records; no tensor), measured
with ``gc.DEBUG_SAVEALL``. Collecting them first would cost 0.3 s of held GIL at ready (every object of the start
is still in the youngest generation, since no collection ran), on the first request's path.

The pause is for a fast start, so it is bounded: a load that takes longer than :data:`PAUSE_LIMIT_S` (a download
from the Hub, a big checkpoint from a cold disk, the demo model's first build) gets collection back then, so that
the garbage of a long load (and of the requests answered 503 meanwhile) is not kept.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

#: The longest pause, in seconds (a start that is not fast by then gains nothing more from it).
PAUSE_LIMIT_S = 30.0

_lock = threading.Lock()
_paused_by_us = False
_pauses = 0  # pauses so far: a limit's timer ends only the pause that started it


def pause_collection(limit_s: float = PAUSE_LIMIT_S) -> bool:
    """Pause the cyclic collector for the start, for ``limit_s`` seconds at most; returns whether this call paused
    it (it may already be off, in which case :func:`resume_collection` leaves it off)."""
    global _paused_by_us, _pauses
    with _lock:
        if not gc.isenabled() or _paused_by_us:
            return False
        gc.disable()
        _paused_by_us = True
        _pauses += 1
        this_pause = _pauses
    timer = threading.Timer(limit_s, resume_collection, kwargs={"pause": this_pause})
    timer.daemon = True
    timer.start()
    return True


def resume_collection(pause: int | None = None) -> bool:
    """End the pause (only if it is pause number ``pause``, when given): freeze the start's objects, collect again
    from here on. Returns whether a pause was ended (a second call, or one without a pause, does nothing)."""
    global _paused_by_us
    with _lock:
        if not _paused_by_us or (pause is not None and pause != _pauses):
            return False
        _paused_by_us = False
        gc.freeze()
        gc.enable()
    log.debug("garbage collection resumed; the objects of the start are frozen")
    return True


@contextmanager
def paused_during_start() -> Iterator[None]:
    """Pause collection for the block; it resumes when the load ends (the server's ``on_ready``/``on_failed``
    call :func:`resume_collection`) or, at the latest, when the block exits (a refused flag, a stopped server)."""
    pause_collection()
    try:
        yield
    finally:
        resume_collection()
