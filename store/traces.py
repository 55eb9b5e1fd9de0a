"""Kineto trace ingest: stream a profiler trace into ``traces`` / ``trace_events`` in batches.

The bytes are read by :mod:`graphdeck.store.trace_json`, which describes the input format, gzip
handling, the token stream, top-level metadata and the µs → ns units. This module resolves the
rank and writes the events ``batch_size`` at a time, one transaction per batch, so memory stays
flat as the file grows; then it finalises the trace, or deletes it when the ingest fails.

Four readings, tried in order on a seekable input (a file, an upload's spool), each giving the
same rows or giving up: the chunked path (events parsed by orjson a chunk at a time; NOTE:
[Chunked orjson reading] in :mod:`graphdeck.store.trace_fast`); the fast path (events built by
ijson's C parser; NOTE: [Fast path] there); on any surprise the token path (events built from
ijson tokens, the reading that classifies truncation and garbage); on a lexical error there, the
repair path (broken strings repaired and counted: ``stats["repaired_*"]``, NOTE: [String
repair] in :mod:`graphdeck.store.trace_json`). An unseekable stream takes the token path only.
``stats["repair_mode"]`` says whether the repairer ran. A reading that gives up part-way has its
rows deleted before the next one starts.

What is kept:

* ``X`` (complete) and ``i`` / ``I`` (instant) events become :class:`TraceEvent` rows, and so do
  the ``s`` / ``f`` ends of Kineto's forward→backward flows (category ``fwdbwd``; NOTE:
  [Forward-backward flows] in :mod:`graphdeck.store.trace_rows`). Every other phase (``M`` metadata, ``s``/``t``/``f`` flows, ``C`` counters, ``B``/``E``, ...) is
  counted in ``stats["by_ph"]``; process and thread names and labels from ``M`` events go into
  ``Trace.meta_json`` (``process_names``, ``process_labels``, ``thread_names`` keyed
  ``"pid/tid"``).
* Top-level keys other than ``traceEvents`` go into ``Trace.meta_json``; a value larger than
  :data:`~graphdeck.store.trace_json.META_MAX_TOKENS` JSON tokens is replaced by a marker and
  counted in ``stats["meta_dropped"]``.
* ``ts`` / ``dur`` as int64 nanoseconds (see ``NOTE: [Trace time base]``), ``pid`` / ``tid`` as
  strings; ``correlation`` is ``args["correlation"]``, else ``args["External id"]`` (or the 2021
  spelling ``"external id"``).

Errors (all leave nothing half-written: a failed ingest deletes its trace and events):

* :class:`~graphdeck.errors.BadInputError`: empty, not JSON, not gzip despite the gzip magic, no
  ``traceEvents`` array, no event in it; or, with ``strict=True``, any skipped event or any
  repaired string.
* :class:`~graphdeck.errors.TruncatedInputError`: the file ends mid-stream (a cut gzip member, or
  JSON that stops inside the events) or turns into garbage after some events. Without ``strict``
  every event parsed before the cut is kept, the trace's status is ``"truncated"`` and the error
  carries ``trace_id``, ``stats``, ``kept=True`` and ``num_events``; with ``strict`` nothing is
  kept (``kept=False``). Events in the same 64 KiB read as a syntax error may be lost; a clean cut
  (EOF) loses only the event it cuts through.
* A bad stretch between events (``{...}, oops, {...}``) is not a cut: the repair path drops the
  items of ``traceEvents`` that are not JSON values and reads on (NOTE: [Resynchronising] in
  :mod:`graphdeck.store.trace_json`), so every good event is kept, ``stats["corrupt_items"]``
  (and ``stats["corrupt"]``) count the dropped items, a warning is logged and the status stays
  ``"ok"``; with ``strict`` it is a :class:`~graphdeck.errors.BadInputError` ("is corrupt").
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import ijson
from sqlalchemy import delete, update
from sqlalchemy.engine import Engine

from graphdeck.errors import BadInputError, TruncatedInputError
from graphdeck.store.db import get_or_create_rank, get_or_create_run, retrying, write_session
from graphdeck.store.lite import fs_text
from graphdeck.store.schema import Run, Trace, TraceEvent
from graphdeck.store.trace_fast import (
    NoEventsHead,
    NotFast,
    chunked_events,
    fast_events,
    peek_base_time,
)
from graphdeck.store.trace_json import (  # noqa: F401  (limits re-exported under their old home)
    ARG_VALUE_MAX_CHARS,
    ARGS_MAX_CHARS,
    INT64_MAX,
    INT64_MIN,
    META_MAX_TOKENS,
    READ_SIZE,
    Reader,
    RepairingReader,
    ResyncReader,
    Scan,
    _json_default,
    as_int64,
    dump_args,
    dumps,
    lane_id,
    scan_events,
    to_ns,
)
# re-exported: MAX_LANE_NAMES, STORED_PH, summary_line (the CLI imports it from here)
from graphdeck.store.trace_rows import MAX_LANE_NAMES, STORED_PH, EventRows, gc_paused, summary_line  # noqa: F401
from graphdeck.store.trace_write import EventWriter
from graphdeck.store.writers import WRITER_KEY, stamp

log = logging.getLogger(__name__)

_RANK_IN_NAME = re.compile(r"(?<![a-z])rank[-_]?(\d+)", re.IGNORECASE)

# NOTE: [Trace time base]
# Kineto writes ``ts`` in µs on its own clock and, since 2023, ``baseTimeNanoseconds`` with
# ``epoch_ns = baseTimeNanoseconds + ts * 1000``. Kineto writes that key *after* traceEvents, so
# it is usually unknown while events stream by. Rows are written with the base when it was seen
# before the first event (then ``meta["ts_base_applied"] = "inline"``) or read from the end of a
# seekable file when the first event is reached without it (``"peek"``,
# :func:`~graphdeck.store.trace_fast.peek_base_time`),
# else relative to the trace clock and shifted by one ``UPDATE ... SET ts_ns = ts_ns + base`` in
# the transaction that finalises the trace (``"update"``; also what corrects a peek that turns out
# different from the parsed value). ``meta["ts_clock"]`` says what ``ts_ns`` means:
# ``"unix_epoch"`` or ``"trace"`` (no base, or the file was cut before it).


@dataclass
class IngestResult:
    """What :func:`ingest_trace` stored.

    Example::

        >>> ingest_trace(engine, "rank-0.json.gz", run_name="job")  # doctest: +SKIP
        IngestResult(trace_id=1, run_id=1, rank=0, status='ok', num_events=4811, stats={...})
    """

    trace_id: int
    run_id: int
    rank: int
    status: str  # "ok" | "truncated"
    num_events: int
    stats: dict[str, Any] = field(default_factory=dict)


#: Interned-string ids an ingest keeps in memory before it forgets them (bounded memory).
STRING_IDS_MAX = 200_000


def ingest_trace(
    engine: Engine,
    source: str | os.PathLike | BinaryIO,
    *,
    run_name: str,
    rank: int | None = None,
    name: str | None = None,
    strict: bool = False,
    batch_size: int = 5000,
    progress=None,
    duplicate: str = "refuse",
) -> IngestResult:
    """Stream one Kineto / Chrome trace into the store as a :class:`Trace` of run ``run_name``.

    Args:
        engine: a read/write store engine (:func:`graphdeck.store.db.open_engine`).
        source: a path, or a binary file object; JSON or gzip (told by the magic bytes ``1f 8b``,
            not by the name).
        run_name: the run (created if missing) the trace belongs to.
        rank: the rank when the trace has no ``distributedInfo.rank``; failing both, the rank is
            parsed from the file name (``rank-3``, ``rank_3``, ``rank3``), else 0.
            ``stats["rank_source"]`` says which: ``distributedInfo``, ``argument``, ``filename``,
            ``default``.
        name: the trace's name (default: the file's base name); also searched for the rank.
        strict: fail on any dropped event or truncation, keeping nothing.
        batch_size: events per write transaction.
        progress: called with the number of bytes read from the file so far after each batch
            (the CLI draws a progress bar with it).
        duplicate: the run already holds a trace of the same bytes (SHA-256, kept as
            ``content_sha256`` in the trace's meta): ``"refuse"`` (ConflictError, 409),
            ``"replace"`` (the older trace is deleted once this one is stored) or ``"allow"``
            (:mod:`graphdeck.store.trace_dedupe`).

    Returns:
        :class:`IngestResult`; ``stats`` counts ``events_total`` (items of ``traceEvents``),
        ``stored``, ``by_ph``, every ``skipped_*`` reason, ``truncated`` and more.

    Raises:
        BadInputError, TruncatedInputError: see the module docstring.
        ConflictError: ``duplicate="refuse"`` and the run holds these bytes already.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        with open(path, "rb") as fh:  # a name that is not UTF-8 is stored with \xNN escapes (fs_text)
            return _deduped(fh, engine, run_name, rank, fs_text(name or path.name), fs_text(path.name), strict,
                            batch_size, progress, duplicate)
    file_name = getattr(source, "name", None)
    file_name = fs_text(Path(file_name).name) if isinstance(file_name, str) else None
    return _deduped(source, engine, run_name, rank, fs_text(name or file_name or "trace"), file_name, strict,
                    batch_size, progress, duplicate)


def _deduped(fh, engine, run_name, rank, name, file_name, strict, batch_size, progress, duplicate) -> IngestResult:
    from graphdeck.store.trace_dedupe import check_duplicate, record_digest

    sha, replaces = check_duplicate(engine, run_name, fh, duplicate)
    try:
        result = _run(fh, engine, run_name, rank, name, file_name, strict, batch_size, progress)
    except TruncatedInputError as exc:
        if exc.details.get("kept") and exc.details.get("trace_id") is not None:
            record_digest(engine, exc.details["trace_id"], sha, replaces)
        raise
    record_digest(engine, result.trace_id, sha, replaces)
    return result


class _NeedsRepair(Exception):
    """The token path met a lexical error inside the JSON: read again through the repairer."""


class _NeedsSlowPath(Exception):
    """The C fast path could not read the input (NOTE: [Fast path]): read it again by tokens."""


def _run(fh, engine, run_name, rank, name, file_name, strict, batch_size, progress) -> IngestResult:
    """Chunked path, then fast path; on a lexical error in a seekable input, once more in repair
    mode (NOTE: [String repair] in :mod:`graphdeck.store.trace_json`)."""
    try:
        start = fh.tell() if fh.seekable() else None
    except (AttributeError, OSError):
        start = None
    try:
        if start is not None:
            peeked: list[int | None] = []

            def peek() -> int | None:  # asked only when the base did not come before the events; once
                if not peeked:
                    peeked.append(peek_base_time(fh, origin=start))
                return peeked[0]

            for fast in ("orjson", "ijson"):
                try:
                    ing = _Ingest(engine, run_name, rank, name, file_name, strict, batch_size, progress, fast=fast)
                    ing.peek = peek
                    return ing.run(fh)
                except _NeedsSlowPath as exc:
                    log.debug("%s: the %s reading gave up (%s)", name, fast, exc)
                    fh.seek(start)
                    if isinstance(exc.__cause__, NoEventsHead):  # the next fast reading would fail alike
                        break
        return _Ingest(engine, run_name, rank, name, file_name, strict, batch_size, progress,
                       repair=False, can_repair=start is not None).run(fh)
    except _NeedsRepair:
        fh.seek(start)
        return _Ingest(engine, run_name, rank, name, file_name, strict, batch_size, progress, repair=True).run(fh)


def _keep_collective_index(engine: Engine, trace_id: int, stats: dict, on_kernel=None) -> bool:
    """The trace's collectives and step times, computed once here (in the ingesting process) and
    kept in its ``stats_json`` (NOTE: [Collective index] in graphdeck.analysis.traces.collectives).
    Best effort: without it, the analyses read the events instead. ``on_kernel``: handed to
    ``build_index`` (each streamed kernel); returns whether its pass over the kernels ended."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.traces.collectives import INDEX_KEY, build_index

    streamed = False
    try:
        with Session(engine) as s:
            index = build_index(s, trace_id, on_kernel=on_kernel)
        streamed = True
        text = json.dumps({**stats, INDEX_KEY: index}, separators=(",", ":"))

        def write():
            with write_session(engine) as s:
                s.execute(update(Trace).where(Trace.id == trace_id).values(stats_json=text))

        retrying(write)
    except Exception:  # noqa: BLE001 - the trace is stored; only the shortcut is missing
        log.exception("trace %s: could not keep its collective index", trace_id)
    return streamed


# ---------------------------------------------------------------------------- rank


def _rank_from(meta: dict, rank_arg: int | None, names: list[str | None]) -> tuple[int, str, int | None]:
    """(rank, where it came from, world size) — distributedInfo, argument, filename, default."""
    info = meta.get("distributedInfo")
    world = None
    if isinstance(info, dict):
        world = as_int64(info.get("world_size"))
        r = as_int64(info.get("rank"))
        if r is not None and r >= 0:
            return r, "distributedInfo", world
    if rank_arg is not None:
        return int(rank_arg), "argument", world
    for text in names:
        m = _RANK_IN_NAME.search(text or "")
        if m:
            return int(m.group(1)), "filename", world
    return 0, "default", world


# ---------------------------------------------------------------------------- the ingest


class _Ingest(EventRows):
    def __init__(self, engine, run_name, rank_arg, name, file_name, strict, batch_size, progress=None,
                 repair=False, can_repair=False, fast=None):
        self.fast = fast  # None (tokens), "ijson" or "orjson"
        self.progress = progress
        self.repair = repair
        self.can_repair = can_repair
        self.engine = engine
        self.run_name = run_name
        self.rank_arg = rank_arg
        self.name = name
        self.file_name = file_name
        self.strict = strict
        self.batch_size = batch_size
        self.trace_id: int | None = None
        self.run_id: int | None = None
        self.batch: list[tuple] = []  # rows, see graphdeck.store.trace_write
        self.new_strings: set[str] = set()  # names and categories of this batch not yet interned
        self.unresolved: list[int] = []  # rows of this batch that hold one of them
        self.string_ids: dict[str, int] = {}  # interned by earlier batches
        self.lane_ids: dict[int | str, str] = {}  # pid / tid → lane_id()
        self.writer: EventWriter | None = None
        self.by_ph: Counter = Counter()
        self.skips: Counter = Counter()
        self.counts: Counter = Counter()
        self.events_total = 0
        self.stored = 0
        self.base_inline: int | None = None  # see NOTE: [Trace time base]
        self.peek = None  # () -> baseTimeNanoseconds read from the end of the file, or None
        self.base_from_peek = False
        self.min_ts: int | None = None
        self.max_end: int | None = None
        self.lanes: dict[str, dict[str, str]] = {"process_names": {}, "process_labels": {}, "thread_names": {}}
        self.st = Scan()

    # -- main loop

    def run(self, raw: BinaryIO) -> IngestResult:
        reader = self.reader = Reader(raw, fast_inflate=self.fast is not None)
        if self.repair:
            reader = self.repairer = RepairingReader(reader)
            reader = self.resync = ResyncReader(reader)  # NOTE: [Resynchronising] in trace_json
        cut: str | None = None
        try:
            cut = gc_paused(self._consume, reader)
            repaired = self.repairer.counts["repaired_strings"] if self.repair else 0
            if repaired and self.strict:
                raise BadInputError(f"trace {self.name!r} has {repaired} malformed strings (repaired: "
                                    f"{self.repairer.counts}); strict mode accepts only well-formed JSON",
                                    file=self.name, **self.repairer.counts)
            bad = self.resync.corrupt_items if self.repair else 0
            if bad and self.strict:
                raise BadInputError(f"trace {self.name!r} is corrupt: {bad} items of traceEvents are not JSON values "
                                    f"(the first at byte offset {self.resync.first_corrupt_offset}); strict mode "
                                    "accepts only well-formed JSON", file=self.name, corrupt_items=bad)
            if bad:
                log.warning("trace %r is corrupt: %d items of traceEvents are not JSON values (the first at byte "
                            "offset %s); skipped, every good event is kept", self.name, bad,
                            self.resync.first_corrupt_offset)
            if cut and (self.strict or self.stored == 0):
                raise self._truncated(cut, kept=False)
            self._validate_shape()
            result = self._finalize("truncated" if cut else "ok")
        except BaseException:
            self._discard()
            raise
        if cut:
            raise self._truncated(cut, kept=True)
        return result

    def _consume(self, reader: Reader) -> str | None:
        """Parse and write every batch; returns why the input was cut short, or None."""
        if self.fast == "orjson":
            try:
                for chunk in chunked_events(reader, self.st):
                    self._chunk(chunk)
                    if len(self.batch) >= self.batch_size:
                        self._flush()
                        if self.progress is not None:
                            self.progress(self.reader.file_bytes)
            except NotFast as exc:
                raise _NeedsSlowPath(str(exc)) from exc
            self._flush()
            return None
        if self.fast:
            try:
                for obj in fast_events(reader, self.st):
                    self._event(obj)
                    if len(self.batch) >= self.batch_size:
                        self._flush()
                        if self.progress is not None:
                            self.progress(self.reader.file_bytes)
            except (NotFast, ijson.JSONError, UnicodeDecodeError) as exc:
                raise _NeedsSlowPath(str(exc)) from exc
            self._flush()
            return None
        tokens = ijson.basic_parse(reader, buf_size=READ_SIZE)
        cut = None
        try:
            for obj in scan_events(tokens, self.st):
                self._event(obj)
                if len(self.batch) >= self.batch_size:
                    self._flush()
                    if self.progress is not None:
                        self.progress(self.reader.file_bytes)
        except ijson.JSONError as exc:
            cut = self._parse_error(exc, reader)
        except UnicodeDecodeError as exc:  # a lone low surrogate escape (``"\\udf0a"``): yajl unescapes
            # it to bytes that are not UTF-8; a lexical error of that string, repaired like the others
            cut = self._parse_error(ijson.JSONError(f"lexical error: a string escapes a lone surrogate ({exc.reason})"),
                                    reader)
        self._flush()
        return cut

    def _parse_error(self, exc: Exception, reader: Reader) -> str | None:
        """Classify a parser error: trailing garbage (None), a cut (its reason), or not JSON."""
        where = f"byte offset {reader.offset}"
        if reader.gzip:
            where += f" of the JSON text, {reader.file_bytes} of the gzip file"
        msg = exc.args[0] if exc.args else ""
        msg = msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)
        detail = (msg.strip().splitlines() or [type(exc).__name__])[0]
        if self.st.complete:
            self.counts["trailing_garbage"] = 1
            if self.strict:
                raise BadInputError(f"trace {self.name!r} has data after its JSON value ({where}): {detail}",
                                    file=self.name)
            return None
        if reader.offset == 0:
            why = reader.cut or "it is empty"
            raise BadInputError(f"trace {self.name!r} is not readable: {why}", file=self.name)
        lowered = detail.lower()
        if self.can_repair and not self.repair and self.st.form is not None and ("lexical error" in lowered or "parse error" in lowered) and not reader.cut:
            raise _NeedsRepair(detail)
        if reader.eof or reader.cut is not None or "premature" in lowered or "incomplete" in lowered:
            return f"({where}): {reader.cut or 'the JSON text ends early'}"
        if self.events_total == 0:
            raise BadInputError(f"trace {self.name!r} is not valid JSON ({where}): {detail}", file=self.name)
        self.counts["corrupt"] = 1
        return f"({where}): the JSON turns invalid: {detail}"

    def _validate_shape(self) -> None:
        st = self.st
        if st.form not in ("object", "array"):
            raise BadInputError(f"trace {self.name!r} is a JSON {st.form}, not a trace object", file=self.name)
        if not st.has_events:
            keys = ", ".join(st.keys[:12]) or "none"
            hint = ""
            if {"nodes", "schema"} <= set(st.keys):
                hint = " (it looks like a PyTorch execution trace, not a Kineto trace)"
            got = f"traceEvents is a {st.events_not_array}, not an array" if st.events_not_array else "has no traceEvents array"
            raise BadInputError(f"trace {self.name!r}: {got}; top-level keys: {keys}{hint}", file=self.name)
        junk = self.skips["skipped_not_object"] + self.skips["skipped_missing_ph"]
        if self.events_total and self.stored == 0 and junk == self.events_total:
            raise BadInputError(
                f"trace {self.name!r}: none of the {self.events_total} items of traceEvents is a trace event",
                file=self.name,
            )

    # -- one event

    # -- writing

    def _ensure_trace(self) -> None:
        if self.trace_id is not None:
            return
        rank, _, world = _rank_from(self.st.meta, self.rank_arg, [self.file_name, self.name])

        def create():
            with write_session(self.engine) as s:
                run = get_or_create_run(s, self.run_name, world_size=world)
                trace = Trace(run_id=run.id, rank=rank, name=self.name[:300], status="ingesting",
                              meta_json=json.dumps({WRITER_KEY: stamp()}))  # NOTE: [Writer stamps]
                s.add(trace)
                s.flush()
                return run.id, trace.id

        self.run_id, self.trace_id = retrying(create)

    def _flush(self) -> None:
        if not self.batch:
            return
        self._ensure_trace()
        if self.writer is None:
            self.writer = EventWriter(self.engine, self.trace_id, self.string_ids)
        self.writer.write(self.batch, self.new_strings, self.unresolved)
        self.batch, self.new_strings, self.unresolved = [], set(), []
        if len(self.string_ids) > STRING_IDS_MAX:
            # A trace of ever-new names (a unique name per event) would grow this cache, and the
            # per-batch copy of it, with the trace: forget it; later names are looked up again.
            self.string_ids.clear()

    def _stats(self, truncated: bool, rank_source: str) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "events_total": self.events_total,
            "stored": self.stored,
            "by_ph": dict(sorted(self.by_ph.items())),
            "skipped_bad_event": sum(self.skips.values()),
        }
        for reason in ("skipped_not_object", "skipped_missing_ph", "skipped_missing_ts", "skipped_bad_ts", "skipped_bad_dur"):
            stats[reason] = self.skips[reason]
        stats.update(
            truncated=int(truncated),
            corrupt=self.counts["corrupt"] + (self.resync.corrupt_items if self.repair else 0),
            corrupt_items=self.resync.corrupt_items if self.repair else 0,
            trailing_garbage=self.counts["trailing_garbage"],
            missing_dur=self.counts["missing_dur"],
            args_truncated=self.counts["args_truncated"],
            **{k: self.counts[k] for k in ("fwdbwd_flows", "fwdbwd_s", "fwdbwd_f") if self.counts[k]},
            big_int_as_string=self.st.big_ints,
            meta_dropped=self.st.meta_dropped,
            rank_source=rank_source,
            repair_mode=int(self.repair),
            **(self.repairer.counts if self.repair else dict.fromkeys(RepairingReader(None).counts, 0)),
            bytes_file=self.reader.file_bytes,
            bytes_json=self.reader.offset,
        )
        return stats

    def _finalize(self, status: str) -> IngestResult:
        self._ensure_trace()
        meta = dict(self.st.meta)
        rank, rank_source, world = _rank_from(meta, self.rank_arg, [self.file_name, self.name])
        stats = self._stats(status == "truncated", rank_source)
        base = as_int64(meta.get("baseTimeNanoseconds")) or 0
        applied = self.base_inline or 0
        shift = base - applied if self.stored > 0 else 0  # a base learnt late, or a wrong peek
        late_base = shift != 0
        start, end = self.min_ts, self.max_end
        if late_base and not (INT64_MIN <= start + shift and end + shift <= INT64_MAX):
            late_base, stats["base_time_not_applied"] = False, 1
        if late_base:
            start, end = start + shift, end + shift
        meta["ts_clock"] = "unix_epoch" if applied + (shift if late_base else 0) else "trace"
        meta["ts_base_applied"] = ("update" if late_base else "peek" if self.base_from_peek and applied
                                   else "inline" if applied else None)
        meta.update({k: v for k, v in self.lanes.items() if v})
        info = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
        backend = info.get("backend") if isinstance(info.get("backend"), str) else None
        host = meta.get("host_name") if isinstance(meta.get("host_name"), str) else None
        trace_id = self.trace_id

        def finish():
            with write_session(self.engine) as s:
                if late_base:
                    s.execute(update(TraceEvent).where(TraceEvent.trace_id == trace_id).values(ts_ns=TraceEvent.ts_ns + shift))
                run = s.get(Run, self.run_id)
                if world and not run.world_size:
                    run.world_size = world
                get_or_create_rank(s, run, rank, world_size=world or 1, backend=backend and backend[:32], hostname=host and host[:200])
                s.execute(
                    update(Trace).where(Trace.id == trace_id).values(
                        rank=rank, status=status, num_events=self.stored, start_ns=start, end_ns=end,
                        stats_json=json.dumps(stats), meta_json=dumps(meta),
                    )
                )

        retrying(finish)
        from graphdeck.analysis.traces.export_map import KernelTally, record_links  # NOTE: [Stored kernel links]
        from graphdeck.store.node_times import record as keep_node_times  # NOTE: [Node-time table]

        tally = KernelTally()  # the kernels are streamed once, for the index and the links alike
        tally.complete = _keep_collective_index(self.engine, trace_id, stats, tally)
        x_ids = self.writer.x_ids if self.writer is not None else None  # NOTE: [Fingerprint at write]
        # best effort, like the index
        by_kernel = record_links(self.engine, trace_id, full=True, tally=tally, fingerprint=x_ids)
        keep_node_times(self.engine, trace_id, by_kernel)  # the same mapping (None: the hook maps the trace itself)
        self.stats = stats
        return IngestResult(trace_id, self.run_id, rank, status, self.stored, stats)

    def _truncated(self, cut: str, *, kept: bool) -> TruncatedInputError:
        stats = getattr(self, "stats", None) or self._stats(True, _rank_from(self.st.meta, self.rank_arg, [self.file_name, self.name])[1])
        if kept:
            what = f"the {self.stored} events before the cut are kept (status 'truncated')"
        elif self.strict and self.stored:
            what = "nothing is kept (strict)"
        else:
            what = "no event came before the cut; nothing is kept"
        return TruncatedInputError(
            f"trace {self.name!r} is truncated after {self.stored} events {cut}; {what}",
            trace_id=self.trace_id if kept else None, stats=stats, kept=kept,
            num_events=self.stored if kept else 0, file=self.name,
        )

    def _discard(self) -> None:
        """Delete this ingest's trace and events (a failed ingest leaves nothing behind)."""
        if self.trace_id is None:
            return
        trace_id = self.trace_id

        def drop():
            with write_session(self.engine) as s:
                s.execute(delete(TraceEvent).where(TraceEvent.trace_id == trace_id))
                s.execute(delete(Trace).where(Trace.id == trace_id))

        try:
            retrying(drop)
        except Exception:  # keep the original error; the row stays "ingesting" and says so
            log.exception("could not delete trace %s after a failed ingest", trace_id)
        self.trace_id = None
