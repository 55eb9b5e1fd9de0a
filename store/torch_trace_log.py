"""Reading TORCH_TRACE structured logs as a stream of records.

# NOTE: [TORCH_TRACE format] (torch/_logging/_internal.py, ``trace_structured`` and
# ``TorchLogsFormatter``; the same facts tlparse's parser relies on). Each record is one glog
# line ``V1129 07:15:42.515000 18880 torch/_dynamo/output_graph.py:2841] {json envelope}``.
# The envelope has one record-kind key (``dynamo_output_graph``, ``artifact``, ``str``, ...)
# whose value is the kind's metadata, plus optional ``rank``, ``frame_id``,
# ``frame_compile_id``, ``attempt``, ``compiled_autograd_id`` and ``has_payload`` (the md5 hex
# digest of the payload). The payload follows as lines starting with a tab; joined with "\n"
# (tab removed) they are the exact text that was hashed. ``{"str": [path, id]}`` records intern
# file names that later ``stack`` frames reference as ``"filename": id``.

Lines are read as bytes (a payload line costs one tab test, one md5 update and one append), so
memory is bounded by the largest single payload, not the file.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # orjson parses envelopes ~3x faster; the standard library is the fallback
    import orjson as _orjson

    _loads = _orjson.loads
    _JSONError: tuple = (_orjson.JSONDecodeError, ValueError)
except ImportError:  # pragma: no cover
    _loads = json.loads
    _JSONError = (ValueError,)

#: ``V1129 07:15:42.515000 18880 path:line] `` (glog prefix; the level letter, month+day, time, pid,
#: source location). Rank-prefixed console copies (``[rank0]:V1129 ...``) are accepted too.
GLOG_RE = re.compile(rb"^(?:\[rank(\d+)\]:)?([VIWEFC])(\d{4}) (\d\d:\d\d:\d\d\.\d+) +(\d+) ([^\]]*)\] ")
#: Envelope keys that are not the record kind.
ENVELOPE_FIELDS = frozenset({"rank", "frame_id", "frame_compile_id", "attempt", "compiled_autograd_id",
                             "has_payload", "stack", "pid", "timestamp", "thread"})
#: ``dedicated_log_torch_trace_rank_3_abcd1234.log`` (torch's TORCH_TRACE file name; the suffix
#: after the rank is random and optional).
RANK_FILE_RE = re.compile(r"rank_(\d+)(?:_[^/\\]*)?\.log(?:\.gz)?$")
LOG_SUFFIXES = (".log", ".txt", ".log.gz", ".txt.gz")


def open_log(path: str | Path):
    """The log's bytes: ``*.gz`` files are decompressed as they are read."""
    path = Path(path)
    if path.name.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


def compile_id_of(envelope: dict) -> str | None:
    """The store's compile id: ``"4/0"``, with a nonzero attempt ``"4/0_1"``, with compiled autograd
    ``"!0/4/0"`` or (the compiled-autograd graph itself) ``"!0"``. Same as ``str(CompileId)`` that
    the capture agent records, plus tlparse's ``_attempt`` suffix. ``None`` when the record
    belongs to no compile."""
    frame, compile_ = envelope.get("frame_id"), envelope.get("frame_compile_id")
    ca = envelope.get("compiled_autograd_id")
    if frame is None and ca is None:
        return None
    base = f"{frame}/{compile_}" if frame is not None else None
    text = (f"!{ca}" + (f"/{base}" if base else "")) if ca is not None else base
    attempt = envelope.get("attempt")
    if attempt:
        text += f"_{attempt}"
    return text


def _position(fh) -> int:
    """Bytes of the file read so far (of the compressed file for ``*.gz``, as the progress bar
    counts file sizes)."""
    raw = getattr(fh, "fileobj", None)
    return raw.tell() if raw is not None else fh.tell()


def rank_from_filename(path: str | Path) -> int | None:
    m = RANK_FILE_RE.search(Path(path).name)
    return int(m.group(1)) if m else None


@dataclass
class Record:
    """One structured record. ``kind`` is the envelope key; ``name`` is the artifact's name for
    ``artifact`` records, else ``kind``; ``body`` is the kind's metadata; ``payload`` the text."""

    kind: str
    name: str
    body: Any
    envelope: dict
    compile_id: str | None
    rank: int | None
    payload: str | None
    line_no: int
    glog_time: str
    verified: bool = True  # False: the payload's md5 differs from ``has_payload`` (kept, counted "unverified")


@dataclass
class ReadStats:
    """Counters of one file (``lines``, ``records``, and every drop by reason)."""

    counts: Counter = field(default_factory=Counter)
    dropped: list[str] = field(default_factory=list)  # records lost, named ("line 12: artifact ...: why")
    unverified: list[str] = field(default_factory=list)  # records kept though their md5 failed, named alike

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def drop(self, key: str, line_no: int, env: dict | None, kind: str | None, *, into: list | None = None) -> None:
        """Count drop ``key`` and name the record (first 100 per file) in ``into`` (``dropped``)."""
        self.add(key)
        into = self.dropped if into is None else into
        if len(into) < 100:
            body = (env or {}).get(kind) if kind else None
            name = body.get("name") if isinstance(body, dict) and isinstance(body.get("name"), str) else kind
            cid = (f" compile {env.get('frame_id')}/{env.get('frame_compile_id')}"
                   if env and "frame_id" in env else "")
            into.append(f"line {line_no}: {name or 'record'}{cid}: {key}")


class LogReader:
    """Iterate the records of one log; counts drops into ``stats``.

    Counted drops: ``bad_line`` (text that is neither a glog line nor a payload line),
    ``bad_json`` (an envelope that does not parse, or parses to a non-object; its payload lines
    are skipped with it), ``truncated_payload`` (a record announced a payload and the file ended
    first or none followed), ``no_kind`` (an envelope with only envelope fields).
    Kept but counted: ``md5_mismatch`` (payload digest differs from ``has_payload``: the record is
    yielded with ``verified=False`` and named in ``stats.unverified``; tlparse reads such payloads
    too, and a graph whose text was edited by hand or re-encoded is still the best evidence there is).
    ``strings`` holds the interned file names seen so far (id → path).
    """

    def __init__(self, path: str | Path, stats: ReadStats):
        self.path = Path(path)
        self.stats = stats
        self.strings: dict[int, str] = {}
        self.bytes_read = 0

    def __iter__(self) -> Iterator[Record]:
        pending: tuple | None = None  # (envelope, kind, line_no, glog time, expected md5)
        lines: list[bytes] = []  # the pending record's raw payload lines, tab and newline kept
        with open_log(self.path) as fh:
            for line_no, raw in enumerate(fh, 1):
                if raw[:1] == b"\t":
                    if pending is not None:
                        lines.append(raw)
                    else:
                        self.stats.add("orphan_payload_lines")
                    continue
                if pending is not None and lines and not raw.strip():
                    lines.append(b"\t\n")  # a tab-only payload line whose tab an editor trimmed
                    continue
                if pending is not None:
                    rec = self._finish(pending, lines)
                    pending, lines = None, []
                    self.bytes_read = _position(fh)
                    if rec is not None:
                        yield rec
                if not raw.strip():
                    continue
                self.stats.add("lines")
                m = GLOG_RE.match(raw)
                if m is None:
                    self.stats.add("bad_line")
                    continue
                try:
                    env = _loads(raw[m.end():])
                except _JSONError:
                    env = None
                if not isinstance(env, dict):
                    self.stats.drop("bad_json", line_no, None, None)
                    continue
                kind = next((k for k in env if k not in ENVELOPE_FIELDS), None)
                if kind is None:
                    self.stats.add("no_kind")
                    continue
                if kind == "str":
                    self._intern(env["str"])
                    continue
                if m.group(1) is not None and "rank" not in env:
                    env["rank"] = int(m.group(1))
                glog_time = f"{m.group(3).decode()} {m.group(4).decode()}"
                if "has_payload" in env:
                    pending = (env, kind, line_no, glog_time, env["has_payload"])
                    continue
                yield self._record(env, kind, line_no, glog_time, None)
            if pending is not None:
                rec = self._finish(pending, lines)
                if rec is not None:
                    yield rec
            self.bytes_read = _position(fh)

    def _intern(self, value: Any) -> None:
        if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int):
            self.strings[value[1]] = str(value[0])
            self.stats.add("strings")
        else:
            self.stats.add("bad_json")

    def _finish(self, pending: tuple, lines: list[bytes]) -> Record | None:
        env, kind, line_no, glog_time, expected = pending
        if not lines:
            self.stats.drop("truncated_payload", line_no, env, kind)
            return None
        # "\tA\n\tB\n" -> "A\nB": one tab off each line, the last newline off (one C pass each)
        data = b"".join(lines)
        if lines[0].endswith(b"\r\n"):  # a log saved with CRLF line ends (torch wrote LF)
            data = data.replace(b"\r\n", b"\n")
        data = data.replace(b"\n\t", b"\n")[1:]
        if data.endswith(b"\n"):
            data = data[:-1]
        verified = True
        if isinstance(expected, str) and hashlib.md5(data, usedforsecurity=False).hexdigest() != expected:
            self.stats.drop("md5_mismatch", line_no, env, kind, into=self.stats.unverified)
            verified = False
        rec = self._record(env, kind, line_no, glog_time, data.decode("utf-8", errors="replace"))
        rec.verified = verified
        return rec

    def _record(self, env: dict, kind: str, line_no: int, glog_time: str, payload: str | None) -> Record:
        self.stats.add("records")
        body = env.get(kind)
        name = kind
        if kind == "artifact" and isinstance(body, dict) and isinstance(body.get("name"), str):
            name = body["name"]
        rank = env.get("rank")
        return Record(kind=kind, name=name, body=body, envelope=env, compile_id=compile_id_of(env),
                      rank=rank if isinstance(rank, int) else None, payload=payload, line_no=line_no,
                      glog_time=glog_time)

    def resolve_stack(self, stack: Any) -> Any:
        """Replace interned ``"filename": id`` in a list of frames by the file's path."""
        if not isinstance(stack, list):
            return stack
        out = []
        for frame in stack:
            if isinstance(frame, dict) and isinstance(frame.get("filename"), int):
                frame = {**frame, "filename": self.strings.get(frame["filename"], frame["filename"])}
            out.append(frame)
        return out


def discover(paths: list[str | Path]) -> tuple[list[Path], list[str]]:
    """Expand directories into their log files. Returns (files to read, skipped names).

    A directory contributes its ``*.log`` and ``*.txt`` files, gzipped or not (recursively,
    sorted); empty files
    and files whose first non-empty line is not a glog line are skipped (returned with the
    reason), so a folder mixing logs with other files imports cleanly.
    """
    files: list[Path] = []
    skipped: list[str] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            candidates = sorted(x for x in p.rglob("*") if x.is_file() and x.name.endswith(LOG_SUFFIXES))
            for c in candidates:
                why = _not_a_log(c)
                if why:
                    skipped.append(f"{c.name}: {why}")
                else:
                    files.append(c)
        else:  # a file named on the command line is checked too: a README is not a rank-0 log
            why = _not_a_log(p) if p.is_file() else None
            if why:
                skipped.append(f"{p.name}: {why}")
            else:
                files.append(p)
    return files, skipped


def _not_a_log(path: Path) -> str | None:
    if path.stat().st_size == 0:
        return "empty"
    with open_log(path) as fh:
        for raw in fh:
            if raw.strip():
                m = GLOG_RE.match(raw)
                return None if m and raw[m.end():].lstrip()[:1] == b"{" else "not a TORCH_TRACE log"
    return "empty"
