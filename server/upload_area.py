"""On-disk state of resumable uploads, and the gzip inflation caps.

Layout under the server's data dir (every name is generated here; nothing a client sends is
ever used as a path — a client's file name is only a display name stored inside ``meta.json``)::

    <data_dir>/<upload id>/meta.json                 spec + state, replaced atomically
    <data_dir>/<upload id>/chunks/<index>.<sha256>   one file per received chunk
    <data_dir>/<upload id>/work/                     assembled / inflated / staged files

The upload id is ``sha256(kind, run, rank, size_bytes, sha256)[:32]`` in hex, so declaring the
same file again (a client that restarted, even with another chunk size) answers the same upload
with the chunks already there and the chunk size in force.
A chunk is streamed to a temp file in ``chunks/``, checked against its declared length and
sha256, then renamed into place: a killed server leaves at worst a temp file (ignored, removed
on the next write), never a partial chunk under a final name, and a retried chunk overwrites
nothing (it is already there with the same checksum, or it is a 409).

NOTE: [Private upload folder] The folder and every folder under it are ``0700`` and the files
``0600``, created with ``O_EXCL | O_NOFOLLOW``. :func:`private_dir` refuses a data dir made by
another user, writable by anyone else, or reached through a symlink or folder another user
controls (:class:`UnsafeFolderError`, naming the folder), so no other local user can plant a
symlink for the server to write through. A URL store's default folder is per store under the
user's data dir (:func:`default_data_dir`), not a predictable name in the shared temp dir.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pwd
import re
import shutil
import stat
import threading
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from graphdeck.errors import (
    BadInputError,
    ConflictError,
    NotFoundError,
    PayloadTooLargeError,
    StoreFullError,
    UnsafePathError,
)

log = logging.getLogger(__name__)

#: Largest chunk a client may declare (one PUT body).
MAX_CHUNK_BYTES = 64 * 1024 * 1024
MAX_CHUNKS = 100_000
#: The inflation ratio is checked only once this many bytes came out (small files may compress
#: extremely well and be harmless).
RATIO_FLOOR_BYTES = 64 * 1024 * 1024
COPY_BYTES = 1 << 20
UPLOAD_ID = re.compile(r"^[0-9a-f]{32}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class UploadSpec:
    """What a client declares when it opens an upload (``POST /api/uploads``)."""

    kind: str  # "trace" | "bundle"
    run: str
    rank: int | None
    size_bytes: int
    sha256: str
    chunk_bytes: int
    name: str | None = None
    strict: bool = False

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.size_bytes // self.chunk_bytes))

    def chunk_length(self, index: int) -> int:
        """Bytes chunk ``index`` must hold (the last one may be short)."""
        if not 0 <= index < self.num_chunks:
            raise NotFoundError(f"chunk {index} is out of range: this upload has chunks 0..{self.num_chunks - 1}",
                                resource="chunk", id=index)
        return min(self.chunk_bytes, self.size_bytes - index * self.chunk_bytes)

    def upload_id(self) -> str:
        # Not chunk_bytes: the same file declared with another chunk size is the same upload (the
        # answer carries the chunk size in force).
        key = json.dumps([self.kind, self.run, self.rank, self.size_bytes, self.sha256])
        return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class UnsafeFolderError(UnsafePathError):
    """A folder the server would write into is not private to it; the message names the folder
    and why (owner, mode, a symlink on the way). 403, exit 2: an upload is not retried."""


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _resolve_parent(path: Path, what: str) -> tuple[Path, list[str]]:
    """Walk ``path`` from ``/`` without trusting anything another user controls: every existing
    folder on the way must be owned by root or us and writable by no one else unless sticky (like
    ``/tmp``); a symlink on the way must be owned by root or us, and its target is walked the same
    way. Returns ``(the deepest existing folder, resolved; the names still missing below it)``."""
    uid = os.geteuid()
    pending, cur, hops = list(path.parts[1:]), Path("/"), 0
    while True:
        st = os.lstat(cur)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeFolderError(f"refusing the {what} {path}: {cur} on its way is not a folder")
        if st.st_uid not in (0, uid):
            raise UnsafeFolderError(f"refusing the {what} {path}: {cur} on its way is owned by {_owner(st.st_uid)}, "
                                    "who could swap what is below it")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeFolderError(f"refusing the {what} {path}: {cur} on its way is writable by group or others "
                                    f"(mode {oct(stat.S_IMODE(st.st_mode))}) and not sticky")
        while pending and pending[0] in ("", "."):
            pending.pop(0)
        if not pending:
            return cur, []
        part = pending.pop(0)
        if part == "..":
            cur = cur.parent
            continue
        nxt = cur / part
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return cur, [part, *pending]
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, uid):
                raise UnsafeFolderError(f"refusing the {what} {path}: {nxt} is a symbolic link owned by "
                                        f"{_owner(st.st_uid)}")
            hops += 1
            if hops > 40:
                raise UnsafeFolderError(f"refusing the {what} {path}: too many symbolic links on its way")
            target = Path(os.readlink(nxt))
            if target.is_absolute():
                cur, pending = Path("/"), [*target.parts[1:], *pending]
            else:
                pending = [*target.parts, *pending]
            continue
        cur = nxt


def private_dir(path: str | os.PathLike, *, mode: int = 0o700, what: str = "folder", tighten: bool = True) -> Path:
    """Make ``path`` a folder of ours that no other local user can write into or redirect, and
    return it (absolute, symlinks on the way resolved).

    The folders on the way are checked as :func:`_resolve_parent` says (missing ones are created
    ``0700``). ``path`` itself is created with ``mode`` by an exclusive ``mkdir``; when it exists
    it must be a real folder (not a symlink) owned by us and writable by no one else; ``tighten``
    then sets its mode to ``mode`` (an older ``0755`` one nobody else could write to).

    Raises:
        UnsafeFolderError: a symlink, not a folder, owned by another user, writable by group or
            others, or something on its way is, or it cannot be made (the message names the
            folder, ``what`` it is for and why).
    """
    path = Path(os.path.abspath(os.fspath(path)))
    if path == Path("/"):
        raise UnsafeFolderError(f"refusing / as the {what}")
    try:
        parent, missing = _resolve_parent(path.parent, what)
        for name in missing:
            parent = _make_dir(parent / name, 0o700, what, path)
        return _make_dir(parent / path.name, mode, what, path, tighten=tighten)
    except UnsafeFolderError:
        raise
    except OSError as exc:
        raise UnsafeFolderError(f"cannot make the {what} {path}: {exc.strerror} ({exc.filename})") from exc


def _make_dir(d: Path, mode: int, what: str, asked: Path, *, tighten: bool = True) -> Path:
    try:
        os.mkdir(d, mode)
        os.chmod(d, mode)  # past the umask (0711 for a folder others traverse)
    except FileExistsError:
        pass
    st = os.lstat(d)
    name = f"the {what} {asked}" if d == asked else f"the {what} {asked}: {d} on its way"
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFolderError(f"refusing {name}: it is a symbolic link (to {os.readlink(d)})")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolderError(f"refusing {name}: it is not a folder")
    if st.st_uid != os.geteuid():
        raise UnsafeFolderError(f"refusing {name}: it is owned by {_owner(st.st_uid)}, not by "
                                f"{_owner(os.geteuid())}; another user made it, so it may hold their symlinks "
                                "(remove it, or choose another folder)")
    if st.st_mode & 0o022:
        raise UnsafeFolderError(f"refusing {name}: it is writable by group or others (mode "
                                f"{oct(stat.S_IMODE(st.st_mode))}), so it may hold another user's symlinks "
                                "(check it, then chmod 700 it, or choose another folder)")
    if tighten and stat.S_IMODE(st.st_mode) != mode:
        os.chmod(d, mode)
    return d


def default_data_dir(store: str, environ: dict | None = None) -> Path:
    """The upload folder of the URL store ``store`` when none is given:
    ``$XDG_DATA_HOME/graphdeck/uploads/<16 hex>`` (``~/.local/share`` when the variable is unset
    or not absolute), named by a hash of the URL without its password, so two servers on two
    databases never share one. Only a path: :class:`UploadArea` creates it (private)."""
    from sqlalchemy.engine import make_url

    env = os.environ if environ is None else environ
    base = env.get("XDG_DATA_HOME", "")
    home = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share"
    try:
        u = make_url(store)
        key = repr((u.drivername, u.username, u.host, u.port, u.database, sorted(u.query.items())))
    except Exception:  # noqa: BLE001 - an unparsable URL fails later, at open_engine, with a message
        key = store
    return home / "graphdeck" / "uploads" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _create(path: Path):
    """A new file at ``path`` for writing: ``0600``, never an existing file or a symlink."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "wb")


def _read(path: Path):
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")


def _subdir(d: Path) -> Path:
    """``mkdir d`` (``0700``) unless it is there already as a real folder."""
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            raise UnsafeFolderError(f"refusing {d}: it is not a folder (a symbolic link?)") from None
    return d


@contextmanager
def disk_errors(what: str) -> Iterator[None]:
    """OSError ENOSPC/EDQUOT → :class:`StoreFullError` (507) naming ``what``."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            raise StoreFullError(f"the server's upload disk is full while {what}; nothing partial was kept") from exc
        raise


class UploadArea:
    """The uploads under ``root``; thread-safe per upload (one lock each).

    ``root`` is made private, or refused (NOTE: [Private upload folder]).

    Raises:
        UnsafeFolderError: ``root`` is not ours alone (:func:`private_dir`).
    """

    def __init__(self, root: Path):
        try:
            self.root = private_dir(root, what="upload folder")
        except UnsafeFolderError as exc:  # the client gets it too (403); the operator reads it here
            log.error("%s", exc.message)
            raise
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def lock(self, upload_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(upload_id, threading.Lock())

    def _dir(self, upload_id: str) -> Path:
        if not UPLOAD_ID.match(upload_id):  # belt and braces: the route's pattern already checks
            raise NotFoundError(f"no upload {upload_id[:40]!r}", resource="upload", id=upload_id[:40])
        return self.root / upload_id

    # -- expiry

    def sweep(self, ttl_s: float, *, now: float | None = None) -> list[str]:
        """Remove uploads whose files were last touched more than ``ttl_s`` ago (abandoned, failed
        or long done); returns their ids. An upload being worked on (its lock held) is kept."""
        now = time.time() if now is None else now
        removed = []
        for d in self.root.iterdir():
            if not UPLOAD_ID.match(d.name) or d.is_symlink() or not d.is_dir():
                continue
            try:
                touched = max(p.stat().st_mtime for p in (d, *d.iterdir()))
            except (OSError, ValueError):
                continue
            if now - touched <= ttl_s:
                continue
            lock = self.lock(d.name)
            if lock.acquire(blocking=False):
                try:
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(d.name)
                finally:
                    lock.release()
        return removed

    # -- meta

    def create(self, spec: UploadSpec) -> dict:
        """Open (or find again) the upload of ``spec``; returns its status (:meth:`status`)."""
        upload_id = spec.upload_id()
        d = self._dir(upload_id)
        with self.lock(upload_id), disk_errors("opening an upload"):
            if not (d / "meta.json").exists():
                _subdir(_subdir(d) / "chunks")
                free = shutil.disk_usage(self.root).free
                if free < 2 * spec.size_bytes:
                    raise StoreFullError(f"the server's upload disk has {free} bytes free; an upload of "
                                         f"{spec.size_bytes} bytes needs twice that while it is assembled")
                self._write_meta(upload_id, {"spec": asdict(spec), "state": "open", "result": None, "error": None})
        return self.status(upload_id)

    def meta(self, upload_id: str) -> dict:
        path = self._dir(upload_id) / "meta.json"
        try:
            with _read(path) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            raise NotFoundError(f"no upload {upload_id!r}", resource="upload", id=upload_id) from None

    def spec(self, upload_id: str) -> UploadSpec:
        return UploadSpec(**self.meta(upload_id)["spec"])

    def _write_meta(self, upload_id: str, meta: dict) -> None:
        d = self._dir(upload_id)
        tmp = d / f".meta-{uuid.uuid4().hex}.tmp"
        with _create(tmp) as f:
            f.write(json.dumps(meta).encode())
        os.replace(tmp, d / "meta.json")

    def set_state(self, upload_id: str, state: str, *, result: dict | None = None, error: dict | None = None) -> None:
        meta = self.meta(upload_id)
        meta.update(state=state, result=result, error=error)
        self._write_meta(upload_id, meta)

    def reopen(self, upload_id: str) -> None:
        """Back to ``open`` with no result or error (a done upload the store does not hold, or a
        failed one declared again); its chunks, if any are left, stay."""
        with disk_errors("reopening an upload"):
            _subdir(_subdir(self._dir(upload_id)) / "chunks")
            self.set_state(upload_id, "open")

    def status(self, upload_id: str) -> dict:
        """``{"id", "kind", "run", "rank", "name", "size_bytes", "sha256", "chunk_bytes", "num_chunks",
        "present": [index, ...], "missing": [...], "received_bytes", "state", "result", "error"}``;
        ``state`` is ``open``, ``done`` or ``failed``."""
        meta = self.meta(upload_id)
        spec = UploadSpec(**meta["spec"])
        present = sorted(self._chunks(upload_id))
        have = set(present)
        missing = [i for i in range(spec.num_chunks) if i not in have] if meta["state"] == "open" else []
        received = sum(spec.chunk_length(i) for i in present)
        return {"id": upload_id, **{k: v for k, v in asdict(spec).items()}, "num_chunks": spec.num_chunks,
                "present": present, "missing": missing, "received_bytes": received, "state": meta["state"],
                "result": meta["result"], "error": meta["error"]}

    # -- chunks

    def _chunks(self, upload_id: str) -> dict[int, str]:
        out = {}
        chunk_dir = self._dir(upload_id) / "chunks"
        if not chunk_dir.is_dir():
            return out
        for p in chunk_dir.iterdir():
            idx, _, sha = p.name.partition(".")
            if idx.isdigit() and SHA256_HEX.match(sha):
                out[int(idx)] = sha
        return out

    def existing_chunk(self, upload_id: str, index: int) -> str | None:
        return self._chunks(upload_id).get(index)

    async def put_chunk(self, upload_id: str, index: int, sha256: str, body: AsyncIterator[bytes]) -> bool:
        """Store chunk ``index`` from ``body`` if its length and sha256 match; ``False`` when the
        same chunk was already there (nothing written).

        Raises:
            ConflictError: chunk ``index`` is stored with another sha256, or the upload is finished.
            PayloadTooLargeError: the body is longer than the chunk.
            BadInputError: shorter, or its sha256 differs from the declared one.
            StoreFullError: the disk filled up (the partial chunk is removed).
        """
        meta = self.meta(upload_id)
        if meta["state"] != "open":
            raise ConflictError(f"upload {upload_id} is {meta['state']}; it takes no more chunks", state=meta["state"])
        spec = UploadSpec(**meta["spec"])
        expected = spec.chunk_length(index)
        have = self.existing_chunk(upload_id, index)
        if have == sha256:
            return False
        if have is not None:
            raise ConflictError(f"chunk {index} is already stored with sha256 {have}, not {sha256}", index=index)
        chunk_dir = self._dir(upload_id) / "chunks"
        tmp = chunk_dir / f".part-{uuid.uuid4().hex}"
        digest, size = hashlib.sha256(), 0
        try:
            with disk_errors(f"storing chunk {index}"), _create(tmp) as out:
                async for data in body:
                    size += len(data)
                    if size > expected:
                        raise PayloadTooLargeError(f"chunk {index} is larger than its {expected} bytes "
                                                   f"(chunk_bytes={spec.chunk_bytes})", limit_bytes=expected)
                    digest.update(data)
                    out.write(data)
            if size != expected:
                raise BadInputError(f"chunk {index} has {size} bytes; it must have {expected}", index=index)
            if digest.hexdigest() != sha256:
                raise BadInputError(f"chunk {index} does not match its sha256 (got {digest.hexdigest()}); resend it",
                                    index=index)
            os.replace(tmp, chunk_dir / f"{index:06d}.{sha256}")
        finally:
            tmp.unlink(missing_ok=True)
        return True

    # -- completion

    def assemble(self, upload_id: str) -> Path:
        """Concatenate the chunks into ``work/upload`` and check the whole sha256.

        Raises:
            ConflictError: chunks are missing (``missing`` lists them).
            BadInputError: the whole file's sha256 is not the declared one.
        """
        spec = self.spec(upload_id)
        chunks = self._chunks(upload_id)
        missing = [i for i in range(spec.num_chunks) if i not in chunks]
        if missing:
            raise ConflictError(f"{len(missing)} of {spec.num_chunks} chunks are missing; send them first",
                                missing=missing[:1000])
        work = self.work_dir(upload_id)
        out_path, tmp = work / "upload", work / f".upload-{uuid.uuid4().hex}"
        digest = hashlib.sha256()
        with disk_errors("assembling the upload"), _create(tmp) as out:
            for i in range(spec.num_chunks):
                with _read(self._dir(upload_id) / "chunks" / f"{i:06d}.{chunks[i]}") as f:
                    while data := f.read(COPY_BYTES):
                        digest.update(data)
                        out.write(data)
        if digest.hexdigest() != spec.sha256:
            tmp.unlink(missing_ok=True)
            raise BadInputError(f"the assembled upload's sha256 is {digest.hexdigest()}, not the declared {spec.sha256}")
        os.replace(tmp, out_path)
        return out_path

    def work_dir(self, upload_id: str) -> Path:
        return _subdir(self._dir(upload_id) / "work")

    def clean(self, upload_id: str) -> None:
        """Drop the chunks and work files of a finished upload (``meta.json`` stays, so a repeated
        complete answers the same result)."""
        d = self._dir(upload_id)
        shutil.rmtree(d / "chunks", ignore_errors=True)
        shutil.rmtree(d / "work", ignore_errors=True)


# ---------------------------------------------------------------------------- gzip caps, nesting

#: Refuse JSON whose brackets nest deeper than this (see :class:`DepthScan`): Kineto traces nest
#: a few levels; 990 levels in an event's args already overflow the stdlib JSON encoder's recursion.
MAX_JSON_DEPTH = 500


def _bracket_steps():
    import numpy as np

    lut = np.zeros(256, dtype=np.int8)
    lut[[ord("["), ord("{")]] = 1
    lut[[ord("]"), ord("}")]] = -1
    return lut


_BRACKET_STEP = _bracket_steps()


class DepthScan:
    """A write-only sink measuring the deepest JSON nesting of the bytes written to it: the
    running maximum of the count of ``[`` ``{`` minus ``]`` ``}`` (numpy, per byte), strings not
    excluded (brackets inside names count too; they are rare and balanced in real traces).

    NOTE: [Deep nesting] ijson's prefix-tracking parsers (``items``, which the trace ingest's fast
    path uses) keep one prefix string per open level, so memory grows with depth²: 100,000 ``[``
    (100 kB) need ~25 GB. Kineto traces nest a few levels; the server refuses more than
    :data:`MAX_JSON_DEPTH` before the ingest sees the bytes.
    """

    def __init__(self, limit: int = MAX_JSON_DEPTH):
        self.limit, self.depth, self.max_depth = limit, 0, 0

    def write(self, data: bytes) -> None:
        import numpy as np

        if not data:
            return
        step = _BRACKET_STEP[np.frombuffer(data, dtype=np.uint8)]
        step = step[np.flatnonzero(step)]  # brackets only (a few % of a trace's bytes)
        if not len(step):
            return
        running = np.cumsum(step, dtype=np.int64)
        self.max_depth = max(self.max_depth, self.depth + int(running.max()))
        self.depth += int(running[-1])
        if self.max_depth > self.limit:
            raise BadInputError(f"the JSON nests deeper than {self.limit} levels (counting '[' and '{{'); refused")


def check_json_depth(src: BinaryIO, limit: int = MAX_JSON_DEPTH) -> None:
    """Run :class:`DepthScan` over the plain (not gzip) stream ``src`` from where it is."""
    scan = DepthScan(limit)
    while data := src.read(COPY_BYTES):
        scan.write(data)


def is_gzip(path: Path) -> bool:
    with _read(path) as f:
        return f.read(2) == GZIP_MAGIC


def inflate_capped(src: BinaryIO, out: BinaryIO | None, *, compressed_bytes: int, max_bytes: int,
                   max_ratio: float) -> int:
    """Decompress the gzip stream ``src`` (concatenated members too) into ``out`` (or only count
    when ``out`` is None) and return the inflated size; stop at the caps.

    Raises:
        PayloadTooLargeError: more than ``max_bytes`` come out, or more than ``max_ratio`` ×
            ``compressed_bytes`` once :data:`RATIO_FLOOR_BYTES` came out (a gzip bomb); the
            message names the limit.
        BadInputError: the gzip data is corrupt.
    """
    ratio_cap = max(RATIO_FLOOR_BYTES, int(max_ratio * max(compressed_bytes, 1)))
    cap = min(max_bytes, ratio_cap)
    z = zlib.decompressobj(wbits=31)
    total = 0
    pending = b""
    while True:
        data = pending or src.read(COPY_BYTES)
        pending = b""
        if not data:
            break
        while True:
            # max_length bounds what one call may produce: a bomb never inflates unchecked.
            piece = z.decompress(data, COPY_BYTES)
            data = z.unconsumed_tail
            total += len(piece)
            if total > cap:
                which = (f"{max_bytes} decompressed bytes" if cap == max_bytes
                         else f"a decompression ratio of {max_ratio:g} ({cap} bytes from {compressed_bytes})")
                raise PayloadTooLargeError(f"the gzip upload inflates past the limit of {which}; refused as a "
                                           "possible gzip bomb", limit_bytes=cap)
            if out is not None and piece:
                out.write(piece)
            if z.eof:
                rest = z.unused_data  # past the end of this member (unconsumed_tail repeats it)
                z = zlib.decompressobj(wbits=31)
                data = b""
                if rest.strip(b"\x00"):
                    pending = rest
                break
            if not data and len(piece) < COPY_BYTES:
                break  # input used up and nothing held back: read more
    return total


def inflate_checked(path: Path, *, max_bytes: int, max_ratio: float, into: Path | None = None,
                    sink=None) -> int:
    """:func:`inflate_capped` over the file ``path``; writes the inflated bytes to ``into`` (made
    anew, ``0600``, never through a symlink) or ``sink`` (e.g. a :class:`DepthScan`) when given.
    Corrupt gzip data becomes :class:`BadInputError`; the other errors are
    :func:`inflate_capped`'s."""
    size = path.stat().st_size
    try:
        with _read(path) as src:
            if into is None:
                return inflate_capped(src, sink, compressed_bytes=size, max_bytes=max_bytes, max_ratio=max_ratio)
            into.unlink(missing_ok=True)  # a killed ingest's leftover
            with disk_errors("decompressing the upload"), _create(into) as out:
                return inflate_capped(src, out, compressed_bytes=size, max_bytes=max_bytes, max_ratio=max_ratio)
    except zlib.error as exc:
        raise BadInputError(f"the gzip data is corrupt ({exc})") from exc
