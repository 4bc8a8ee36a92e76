"""A bounded pool of grammar compiler processes whose workers are killed on timeout.

Why processes, and why this pool: xgrammar has no way to cancel a compilation, and a schema can take minutes. In a
thread it keeps burning CPU after its request was refused; in a process it stops the moment the process is killed.
``concurrent.futures.ProcessPoolExecutor`` cannot kill one stuck worker (terminating one breaks the whole pool),
so each worker here is one process with one socket, driven by one dispatcher thread of this pool: the thread sends
a job, waits at most the timeout for the answer, and kills the process (SIGKILL) when it does not come. A fresh
worker is started only when the next job needs one, so a refused grammar costs no CPU after its refusal.

Workers are started with ``subprocess`` (fork + exec of ``python -m service.engine.grammar.compile_worker``): a
fresh interpreter, as multiprocessing's ``spawn`` gives (the server has threads; it never forks without exec), but
without ``spawn`` re-importing the server's ``__main__`` in every worker. Each worker is handed the tokenizer's
``xgrammar.TokenizerInfo`` once, as JSON, and sends back each compiled grammar as ``CompiledGrammar.serialize_json``.

Waiting holds no thread other requests need: :meth:`CompilePool.submit` returns a future at once (the HTTP route
awaits it on the event loop), and it refuses at once (429) when ``workers + queue`` jobs are already taken.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from service.errors import OverloadedError

log = logging.getLogger(__name__)

#: Seconds a new worker may take to import xgrammar and read the tokenizer (not the request's timeout).
WORKER_START_S = 120.0


class CompileTimeout(Exception):
    """The job ran past the timeout; its worker was killed."""


class CompileRefused(Exception):
    """xgrammar refused the grammar (the reason is the message), or its worker died on it."""


class CompileWorker:
    """One compiler process and its end of the socket."""

    def __init__(self, tokenizer_info: str):
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[3])  # the folder holding the ``service`` package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.process = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [sys.executable, "-m", "service.engine.grammar.compile_worker", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(tokenizer_info.encode())
        if not self.conn.poll(WORKER_START_S) or self.conn.recv_bytes() != b"ready":
            self.kill()
            raise CompileRefused(f"the grammar compiler process did not start within {WORKER_START_S:g}s")

    @property
    def pid(self) -> int:
        return self.process.pid

    def compile(self, kind: str, value: str, timeout: float) -> str:
        """The serialized compiled grammar; :class:`CompileTimeout` (worker killed) past ``timeout`` seconds."""
        self.conn.send_bytes(json.dumps({"kind": kind, "value": value}).encode())
        try:
            if not self.conn.poll(timeout):
                raise CompileTimeout
            answer = self.conn.recv_bytes()
        except (EOFError, OSError):
            code = self.process.wait()
            raise CompileRefused(f"the grammar compiler process died on it (exit status {code})") from None
        if answer.startswith(b"ok"):
            return answer[2:].decode()
        raise CompileRefused(answer[3:].decode())

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class CompilePool:
    """``workers`` compiler processes behind a queue of at most ``waiting`` jobs.

    ``finish(serialized)`` turns a worker's answer into the future's result (deserializing, on the dispatcher
    thread). Processes start on the first job, and again after a kill only when a job needs one."""

    def __init__(
        self,
        tokenizer_info: Callable[[], str],
        finish: Callable[[str], Any],
        *,
        workers: int,
        waiting: int,
        timeout: float,
    ):
        self._info_fn, self._finish = tokenizer_info, finish
        self._info: str | None = None
        self.workers, self.queue_limit, self.timeout = max(1, workers), max(0, waiting), timeout
        self._jobs: queue.SimpleQueue[tuple[Future, str, str] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._taken = 0  # jobs queued or running
        self._threads: list[threading.Thread] = []
        self._live: dict[int, CompileWorker] = {}  # dispatcher index -> its process
        self._closed = False
        #: What happened to jobs: compiled, refused, timed_out, rejected (429).
        self.counts = {"compiled": 0, "refused": 0, "timed_out": 0, "rejected": 0}

    def submit(self, kind: str, value: str, field: str) -> Future:
        """A future of the compiled grammar; at once an :class:`OverloadedError` when the pool is full."""
        with self._lock:
            if self._closed:
                raise OverloadedError(f"{field}: the grammar compilers are shut down (the server is stopping).")
            if self._taken >= self.workers + self.queue_limit:
                self.counts["rejected"] += 1
                raise OverloadedError(
                    f"{field}: all {self.workers} grammar compiler(s) are busy and {self.queue_limit} more grammars "
                    "wait (--grammar-workers, --grammar-queue); retry later, or send a simpler schema.",
                    retry_after=max(1, round(self.timeout)),
                )
            self._taken += 1
            if not self._threads:
                for i in range(self.workers):
                    t = threading.Thread(target=self._dispatch, args=(i,), name=f"loadmaster-grammar-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
        future: Future = Future()
        self._jobs.put((future, kind, value))
        return future

    def pids(self) -> list[int]:
        """The compiler processes alive now."""
        with self._lock:
            return [w.pid for w in self._live.values()]

    def close(self) -> None:
        """Kill every worker and end the dispatchers; jobs still queued fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._live.values())
            self._live.clear()
        for _ in self._threads:
            self._jobs.put(None)
        for w in live:
            w.kill()

    def _dispatch(self, index: int) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            future, kind, value = job
            try:
                if self._closed:
                    future.set_exception(CompileRefused("the server is stopping"))
                elif future.set_running_or_notify_cancel():
                    self._run(index, future, kind, value)
            finally:
                with self._lock:
                    self._taken -= 1

    def _run(self, index: int, future: Future, kind: str, value: str) -> None:
        try:
            worker = self._worker(index)
            started = time.perf_counter()
            try:
                serialized = worker.compile(kind, value, self.timeout)
            except CompileTimeout:
                self._drop(index)
                log.warning("grammar compiler %d killed after %.1fs", worker.pid, time.perf_counter() - started)
                self.counts["timed_out"] += 1
                raise
            except CompileRefused:
                if worker.process.poll() is not None:
                    self._drop(index)
                self.counts["refused"] += 1
                raise
            result = self._finish(serialized)
            self.counts["compiled"] += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _worker(self, index: int) -> CompileWorker:
        with self._lock:
            worker = self._live.get(index)
        if worker is not None:
            return worker
        if self._info is None:
            self._info = self._info_fn()
        worker = CompileWorker(self._info)
        with self._lock:
            if self._closed:
                worker.kill()
                raise CompileRefused("the server is stopping")
            self._live[index] = worker
        log.info("grammar compiler process %d started", worker.pid)
        return worker

    def _drop(self, index: int) -> None:
        with self._lock:
            worker = self._live.pop(index, None)
        if worker is not None:
            worker.kill()
