"""The client side of ``/api/uploads``: send a trace or a capture store to a graphdeck server,
resuming after failures.

    >>> upload_store("http://dash:8765", "rank0.db", run="job", rank=0)  # doctest: +SKIP
    {'id': '5c0e…', 'state': 'done', 'result': {'kind': 'bundle', 'run_id': 3, ...}, ...}

The protocol is the server's (:mod:`graphdeck.server.routes.uploads`): declare the file (size,
sha256, chunk size), PUT the chunks the server says are missing, each with its sha256, then
complete. Every step is idempotent, so on a dropped connection, a 5xx, a 429/503 or a server
restart the client waits (exponential backoff with jitter, capped) and asks the server what it
already has; an answer that cannot change by retrying (4xx: bad token, too large, a bad file)
raises at once. The token is ``token`` or ``$GRAPHDECK_TOKEN``, sent as ``Authorization: Bearer``;
every request carries ``X-Graphdeck-Client: 1`` (the server refuses writes without it or a
token: a web page could send those).

A store is snapshotted with ``VACUUM INTO`` (one self-contained file, consistent even while a
WAL is open) and gzip-compressed before it is sent.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import random
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from graphdeck.errors import (
    BadInputError,
    ConflictError,
    GraphdeckError,
    NotFoundError,
    PayloadTooLargeError,
    StoreFullError,
    UsageError,
)
from graphdeck.store.lite import fs_text

TOKEN_ENV = "GRAPHDECK_TOKEN"
#: Sent on every request: the server takes writes only from clients that send it (or a token).
CLIENT_HEADER = "X-Graphdeck-Client"
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_ERRORS = {400: BadInputError, 401: UsageError, 403: UsageError, 404: NotFoundError, 409: ConflictError,
           413: PayloadTooLargeError, 422: BadInputError, 507: StoreFullError}


class UploadFailed(GraphdeckError):
    """The server stayed unreachable or kept failing for every attempt."""


class Uploader:
    """One server connection with the retry policy; ``attempts`` tries per request, sleeping
    ``backoff_s * 2**k`` (± 50 % jitter, at most ``max_backoff_s``) between them."""

    def __init__(self, url: str, *, token: str | None = None, attempts: int = 10, backoff_s: float = 0.5,
                 max_backoff_s: float = 20.0, timeout_s: float = 600.0, log: Callable[[str], None] | None = None):
        self.url = url.rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        # The server refuses writes a web page could send (graphdeck.server.auth, NOTE: [No simple writes]).
        headers = {CLIENT_HEADER: "1"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.client = httpx.Client(base_url=self.url, headers=headers,
                                   timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.attempts, self.backoff_s, self.max_backoff_s = attempts, backoff_s, max_backoff_s
        self.log = log or (lambda _msg: None)
        self.retries = 0

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        """The response of the first attempt that is not retryable; raises the error class of its
        status for a 4xx/507, :class:`UploadFailed` when every attempt failed."""
        last = None
        for attempt in range(self.attempts):
            try:
                resp = self.client.request(method, path, **kw)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code not in RETRY_STATUSES:
                    raise _error(resp)
                last = f"HTTP {resp.status_code}: {_message(resp)}"
            if attempt < self.attempts - 1:
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.5)
                self.retries += 1
                self.log(f"{method} {path} failed ({last}); retry {attempt + 1} in {delay:.1f}s")
                time.sleep(delay)
        raise UploadFailed(f"{method} {self.url}{path} failed {self.attempts} times; last: {last}")

    def upload(self, path: str | os.PathLike, *, kind: str, run: str, rank: int | None = None,
               name: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, strict: bool = False) -> dict:
        """Upload the file ``path`` as ``kind`` (``trace`` or ``bundle``) of run ``run``; returns the
        server's final upload status (``state == "done"``, ``result`` says what was stored).

        Raises:
            GraphdeckError: the server's answer (e.g. 401/403 token, 413 too large, 400 a bad file).
            UploadFailed: the server could not be reached or kept failing.
        """
        path = Path(path)
        size, digest = file_digest(path)
        if size == 0:
            raise BadInputError(f"{path} is empty")
        spec = {"kind": kind, "run": run, "rank": rank, "size_bytes": size, "sha256": digest,
                "chunk_bytes": chunk_bytes, "name": fs_text(name or path.name), "strict": strict}  # JSON: UTF-8 only
        status = self.request("POST", "/api/uploads", json=spec).json()
        upload_id = status["id"]
        for _round in range(self.attempts):
            if status["state"] != "open":
                break
            self._send(path, upload_id, status)
            try:
                return self.request("POST", f"/api/uploads/{upload_id}/complete").json()["upload"]
            except ConflictError:  # chunks missing (e.g. the server lost a half-written one): resend them
                status = self.request("GET", f"/api/uploads/{upload_id}").json()
        if status["state"] == "done":
            return status
        return self.request("POST", f"/api/uploads/{upload_id}/complete").json()["upload"]

    def _send(self, path: Path, upload_id: str, status: dict) -> None:
        chunk_bytes = status["chunk_bytes"]
        with open(path, "rb") as f:
            for index in status["missing"]:
                f.seek(index * chunk_bytes)
                data = f.read(chunk_bytes)
                self.request("PUT", f"/api/uploads/{upload_id}/chunks/{index}", content=data,
                             headers={"X-Chunk-Sha256": hashlib.sha256(data).hexdigest(),
                                      "Content-Type": "application/octet-stream"})


def file_digest(path: Path) -> tuple[int, str]:
    """``(size_bytes, sha256 hex)`` of the file ``path``, read in 1 MiB blocks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while data := f.read(1 << 20):
            h.update(data)
            size += len(data)
    return size, h.hexdigest()


def snapshot_store(store: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """A consistent single-file copy of the SQLite store ``store`` (``VACUUM INTO``; the WAL's
    committed pages included), gzip-compressed to ``dest``."""
    dest = Path(dest)
    raw = dest.with_name(dest.name + ".raw")
    raw.unlink(missing_ok=True)
    src = sqlite3.connect(f"file:{Path(store).resolve()}?mode=ro", uri=True)
    try:
        src.execute("VACUUM INTO ?", (str(raw),))
    except sqlite3.DatabaseError as exc:
        raw.unlink(missing_ok=True)
        raise BadInputError(f"{store} is not a readable SQLite capture store ({exc})") from exc
    finally:
        src.close()
    # mtime=0 and no file name in the gzip header: the same store gives the same bytes, hence the
    # same upload id, so uploading it again is recognised as a repeat.
    with open(raw, "rb") as fin, open(dest, "wb") as fdest, \
            gzip.GzipFile(filename="", mode="wb", fileobj=fdest, compresslevel=6, mtime=0) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    raw.unlink()
    return dest


def upload_trace(url: str, path: str | os.PathLike, *, run: str, rank: int | None = None,
                 name: str | None = None, token: str | None = None, **kw) -> dict:
    """Upload a Kineto trace file (``.json`` or ``.json.gz``); see :meth:`Uploader.upload`."""
    with Uploader(url, token=token, **_client_kw(kw)) as up:
        return up.upload(path, kind="trace", run=run, rank=rank, name=name, **kw)


def upload_store(url: str, store: str | os.PathLike, *, run: str, rank: int | None = None,
                 token: str | None = None, **kw) -> dict:
    """Snapshot the SQLite capture store ``store`` (:func:`snapshot_store`) and upload it as a
    bundle merged into run ``run``; see :meth:`Uploader.upload`."""
    with tempfile.TemporaryDirectory(prefix="graphdeck-upload-") as tmp:
        bundle = snapshot_store(store, Path(tmp) / "bundle.db.gz")
        with Uploader(url, token=token, **_client_kw(kw)) as up:
            return up.upload(bundle, kind="bundle", run=run, rank=rank, name=Path(store).name, **kw)


def _client_kw(kw: dict) -> dict:
    return {k: kw.pop(k) for k in ("attempts", "backoff_s", "max_backoff_s", "timeout_s", "log") if k in kw}


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    return str(body.get("error", body))[:500] if isinstance(body, dict) else str(body)[:300]


def _error(resp: httpx.Response) -> GraphdeckError:
    cls = _ERRORS.get(resp.status_code, GraphdeckError)
    try:
        details = resp.json()
    except ValueError:
        details = {}
    extra = {k: v for k, v in details.items() if k not in ("ok", "error", "status")} if isinstance(details, dict) else {}
    return cls(f"server answered {resp.status_code}: {_message(resp)}", http_status=resp.status_code, **extra)
