"""A local HTTP server speaking the part of the Hugging Face Hub's API that huggingface_hub uses to plan and fetch
a model, so the real client can be tested with no Hub reachable.

Routes (as huggingface_hub 1.x/2.x calls them; ``HF_ENDPOINT`` points the client here):

* ``GET /api/models/{org}/{name}[/revision/{rev}][?blobs=true]`` — model info: ``sha`` (the commit) and
  ``siblings`` (file names and sizes). An unknown repository is 401 ``X-Error-Code: RepoNotFound`` (what the Hub
  answers an anonymous caller), an unknown revision 404 ``RevisionNotFound``.
* ``HEAD|GET /{org}/{name}/resolve/{rev}/{file}`` — ``X-Repo-Commit``, ``ETag``, ``Content-Length``; GET honours
  ``Range: bytes=a-b`` / ``bytes=a-`` with 206 and ``Content-Range``. Gated repositories answer 401 ``GatedRepo``
  without a token and 403 ``GatedRepo`` with a token they do not accept; unknown files are 404 ``EntryNotFound``.

Every response body byte is counted (in total and per file), every request is logged with its Range header, and a
test can make the next GET of a file stop after some bytes (stall until released, then drop the connection), which
is how a download is interrupted.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHUNK = 1 << 20


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, Path]
    commit: str
    branches: dict[str, str]
    gated: bool = False
    tokens: frozenset[str] = frozenset()
    etags: dict[str, str] = field(default_factory=dict)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    sent: int = 0


@dataclass
class _Stall:
    after: int
    release: threading.Event = field(default_factory=threading.Event)
    reached: threading.Event = field(default_factory=threading.Event)


class FakeHub:
    """The server and its repositories. ``url`` is what ``HF_ENDPOINT`` should be."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.stalls: dict[tuple[str, str], _Stall] = {}
        hub = self

        class Handler(_Handler):
            fake = hub

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # huggingface_hub opens shard connections in parallel

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-hub", daemon=True)

    def start(self) -> FakeHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        for s in self.stalls.values():
            s.release.set()
        self.server.shutdown()
        self.server.server_close()

    def add_repo(
        self, repo_id: str, files: dict[str, Path], *, gated: bool = False, tokens: tuple[str, ...] = ()
    ) -> FakeRepo:
        commit = hashlib.sha1(f"{repo_id}:{sorted(files)}".encode()).hexdigest()
        repo = FakeRepo(repo_id, dict(files), commit, {"main": commit}, gated, frozenset(tokens))
        for name, path in files.items():
            st = path.stat()  # identity of the content, without hashing hundreds of MB
            repo.etags[name] = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
        self.repos[repo_id] = repo
        return repo

    def stall_next_get(self, repo_id: str, filename: str, after: int) -> _Stall:
        """The next GET of this file sends ``after`` bytes, then waits for ``release`` and drops the connection."""
        stall = _Stall(after)
        self.stalls[(repo_id, filename)] = stall
        return stall

    # -- what was served ------------------------------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        with self.lock:
            return sum(r.sent for r in self.requests)

    def gets(self, filename: str | None = None) -> list[Request]:
        with self.lock:
            return [
                r
                for r in self.requests
                if r.method == "GET" and "/resolve/" in r.path and (filename is None or r.path.endswith("/" + filename))
            ]

    def files_fetched(self) -> set[str]:
        return {r.path.rsplit("/", 1)[1] for r in self.gets() if r.status in (200, 206)}

    def bytes_of(self, filename: str) -> int:
        return sum(r.sent for r in self.gets(filename))

    def mark(self) -> int:
        with self.lock:
            return len(self.requests)

    def since(self, mark: int) -> list[Request]:
        with self.lock:
            return list(self.requests[mark:])


_API_RE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_RESOLVE_RE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    # -- plumbing ---------------------------------------------------------------------------------------------------
    def _record(self, method: str, status: int) -> Request:
        req = Request(method, unquote(urlsplit(self.path).path), self.headers.get("Range"), status)
        with self.fake.lock:
            self.fake.requests.append(req)
        return req

    def _send(
        self, req: Request, status: int, body: bytes = b"", headers: dict[str, str] | None = None, method: str = "GET"
    ) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method == "GET" and body:
            self.wfile.write(body)
            req.sent += len(body)

    def _error(self, method: str, status: int, code: str, message: str) -> None:
        req = self._record(method, status)
        body = json.dumps({"error": message}).encode()
        self._send(
            req,
            status,
            body,
            {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"},
            method,
        )

    def _repo(self, method: str, repo_id: str) -> FakeRepo | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(method, 401, "RepoNotFound", "Repository not found")
        return repo

    def _commit(self, method: str, repo: FakeRepo, rev: str | None) -> str | None:
        rev = unquote(rev) if rev else "main"
        if rev in repo.branches:
            return repo.branches[rev]
        if rev == repo.commit:
            return rev
        self._error(method, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return None

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path
        m = _API_RE.match(path)
        if m and method == "GET":
            return self._model_info(m["repo"], m["rev"])
        m = _RESOLVE_RE.match(path)
        if m:
            return self._resolve(method, m["repo"], m["rev"], unquote(m["file"]))
        self._error(method, 404, "NotFound", f"no route {path}")

    def _model_info(self, repo_id: str, rev: str | None) -> None:
        repo = self._repo("GET", repo_id)
        if repo is None:
            return
        commit = self._commit("GET", repo, rev)
        if commit is None:
            return
        siblings = [
            {"rfilename": n, "size": p.stat().st_size, "blobId": repo.etags[n][:40]}
            for n, p in sorted(repo.files.items())
        ]
        doc = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "siblings": siblings,
            "tags": [],
        }
        req = self._record("GET", 200)
        self._send(req, 200, json.dumps(doc).encode(), {"Content-Type": "application/json"})

    def _resolve(self, method: str, repo_id: str, rev: str, filename: str) -> None:
        repo = self._repo(method, repo_id)
        if repo is None:
            return
        commit = self._commit(method, repo, rev)
        if commit is None:
            return
        if repo.gated:
            auth = self.headers.get("Authorization", "")
            token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
            if not token:
                return self._error(method, 401, "GatedRepo", "Access to model is restricted; you must be authenticated")
            if token not in repo.tokens:
                return self._error(
                    method, 403, "GatedRepo", "Access to model is restricted and you are not in the authorized list"
                )
        path = repo.files.get(filename)
        if path is None:
            return self._error(method, 404, "EntryNotFound", f"{filename} does not exist at {commit}")
        size = path.stat().st_size
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{repo.etags[filename]}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        begin, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng and method == "GET":
            m = _RANGE_RE.match(rng.strip())
            if m:
                begin = int(m[1])
                end = min(int(m[2]), size - 1) if m[2] else size - 1
                status = 206
                headers["Content-Range"] = f"bytes {begin}-{end}/{size}"
        req = self._record(method, status)
        length = max(0, end - begin + 1)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length if method == "GET" else size))
        self.end_headers()
        if method != "GET":
            return
        stall = self.fake.stalls.pop((repo_id, filename), None)
        with open(path, "rb") as f:
            f.seek(begin)
            left = length
            while left > 0:
                limit = left if stall is None else min(left, stall.after - req.sent)
                if stall is not None and limit <= 0:
                    stall.reached.set()
                    stall.release.wait(60)
                    self.close_connection = True
                    return
                data = f.read(min(CHUNK, limit))
                if not data:
                    break
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    return
                req.sent += len(data)
                left -= len(data)
