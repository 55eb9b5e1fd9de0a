"""Re-ingesting a graphdeck export (``graphdeck export-trace``): one trace per rank again.

# NOTE: [Export re-ingest]
An export (NOTE: [Trace export] in graphdeck/analysis/traces/export.py) holds many ranks in
one Chrome Trace Event Format file: ``pid`` = the rank, a ``process_name`` metadata event
``"rank N"`` opening each rank's events, times in µs since ``baseTimeNanoseconds`` (the first key)
on the clock-aligned time base, the flow pairs after every rank's events and a ``graphdeck`` key
after ``traceEvents`` (run, ranks, clock offsets). :func:`is_export` recognises it by its first
bytes: exactly what export writes first (``{"baseTimeNanoseconds":N,"displayTimeUnit":"ns",
"traceEvents":[{"ph":"M","name":"process_name","pid":R,"tid":0,"args":{"name":"rank R"}}``).

Ingested as one Kineto trace it would become one rank. :func:`ingest_export` instead reads the
file once (the chunked orjson reading of :mod:`graphdeck.store.trace_fast`, else ijson's), writes
each rank's events (by ``pid``) as they are to a per-rank JSON file in a temporary folder (what is
held in memory is at most :data:`SPILL_BYTES` of encoded events), then ingests each of those with
:func:`graphdeck.store.traces.ingest_trace` as rank ``pid`` — the same reader, checks, duplicate
refusal and indexes as any trace. Each per-rank file carries the export's ``baseTimeNanoseconds``
(so ``ts_ns`` is the aligned time, ns since the epoch when the source traces had one) and a
``graphdeck_export`` key, kept in the trace's ``meta_json``: the source file, the exported run and
run id, the rank and the clock offset export-trace applied to it (``offset_ns``, ``method``:
original time = stored time + ``offset_ns``). Temporary disk: about the export's JSON size.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import ijson
import orjson

from graphdeck.errors import BadInputError, UsageError
from graphdeck.store.trace_fast import NotFast, chunked_events, fast_events
from graphdeck.store.trace_json import INFLATE_ERRORS, Reader, Scan, _json_default

#: Encoded events held in memory before they are appended to the per-rank files.
SPILL_BYTES = 16 << 20
_HEAD = re.compile(rb'^\{"baseTimeNanoseconds":(-?\d+),"displayTimeUnit":"ns","traceEvents":\['
                   rb'\{"ph":"M","name":"process_name","pid":(\d+),"tid":0,"args":\{"name":"rank (\d+)"\}\}')


def is_export(path: str | os.PathLike) -> bool:
    """Whether the file (JSON or gzip) starts as a graphdeck export does (NOTE: [Export re-ingest])."""
    try:
        with open(path, "rb") as fh:
            reader = Reader(fh, fast_inflate=True)
            head = b""
            while len(head) < 512:
                data = reader.read(4096)
                if not data:
                    break
                head += data
    except (OSError, TypeError, *INFLATE_ERRORS):
        return False
    m = _HEAD.match(head)
    return m is not None and m.group(2) == m.group(3)


def _events(path: Path, st: Scan):
    """The export's events (dicts), read once; ``st.meta`` holds the keys around them after."""
    for fast in ("orjson", "ijson"):
        got = 0
        try:
            with open(path, "rb") as fh:
                reader = Reader(fh, fast_inflate=True)
                if fast == "orjson":
                    for chunk in chunked_events(reader, st):
                        for ev in chunk.events:
                            got += 1
                            yield ev
                else:
                    for ev in fast_events(reader, st):
                        got += 1
                        yield ev
            return
        except (NotFast, ijson.JSONError) as exc:
            if got:  # events were handed out already: no second reading from the start
                raise BadInputError(f"export {path.name!r} cannot be read to its end ({exc}); it may be cut",
                                    file=path.name) from exc
            st.__init__()
            last = exc
    raise BadInputError(f"export {path.name!r} cannot be read ({last}); it may be cut or corrupt",
                        file=path.name) from last


def split_export(path: str | os.PathLike, folder: str | os.PathLike) -> tuple[dict[int, Path], dict]:
    """Write each rank's events of the export ``path`` to ``folder/rank-R.json`` (one Kineto-style
    file per rank, NOTE: [Export re-ingest]). Returns (rank → file, the export's ``graphdeck`` key).

    Raises:
        BadInputError: not readable to its end, or an event whose ``pid`` is not a rank (an int >= 0).
    """
    path, folder = Path(path), Path(folder)
    st = Scan()
    pending: dict[int, list[bytes]] = defaultdict(list)
    started: set[int] = set()
    held = 0
    base = None

    def spill():
        nonlocal held
        for r, parts in pending.items():
            with open(folder / f"rank-{r}.json", "ab") as out:
                if r not in started:
                    started.add(r)
                    out.write(b'{"baseTimeNanoseconds":' + str(base).encode()
                              + b',"displayTimeUnit":"ns","traceEvents":[' + b",".join(parts))
                else:
                    out.write(b"," + b",".join(parts))
        pending.clear()
        held = 0

    for ev in _events(path, st):
        if base is None:
            base = int(st.meta.get("baseTimeNanoseconds") or 0)
        pid = ev.get("pid") if type(ev) is dict else None
        if type(pid) is not int or pid < 0:
            raise BadInputError(f"export {path.name!r}: an event's pid {pid!r} is not a rank", file=path.name)
        try:
            raw = orjson.dumps(ev)
        except TypeError:  # ijson's Decimal
            raw = orjson.dumps(ev, default=_json_default)
        pending[pid].append(raw)
        held += len(raw)
        if held >= SPILL_BYTES:
            spill()
    spill()
    info = st.meta.get("graphdeck") if isinstance(st.meta.get("graphdeck"), dict) else {}
    offsets = info.get("offsets") if isinstance(info.get("offsets"), dict) else {}
    files = {}
    for r in sorted(started):
        off = offsets.get(str(r)) if isinstance(offsets.get(str(r)), dict) else {}
        tail = {"source": path.name, "run": info.get("run"), "run_id": info.get("run_id"), "rank": r,
                "offset_ns": off.get("offset_ns"), "method": off.get("method"),
                "note": "times are export-trace's aligned clock: the rank's own time = ts + offset_ns"}
        with open(folder / f"rank-{r}.json", "ab") as out:
            out.write(b'],"graphdeck_export":' + orjson.dumps(tail, default=str) + b"}")
        files[r] = folder / f"rank-{r}.json"
    return files, info


def ingest_export(engine, path: str | os.PathLike, *, run_name: str, strict: bool = False,
                  duplicate: str = "refuse", progress=None, on_rank=None) -> list:
    """Ingest the graphdeck export ``path`` as one trace per rank of run ``run_name``
    (NOTE: [Export re-ingest]). ``progress(fraction)`` after the split and each rank;
    ``on_rank(result)`` after each rank's ingest. Returns the ranks' :class:`IngestResult` in rank
    order.

    Raises:
        BadInputError: see :func:`split_export`; UsageError: the export holds no event; and what
        :func:`graphdeck.store.traces.ingest_trace` raises for a rank's file (earlier ranks stay).
    """
    from graphdeck.store.traces import ingest_trace

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="graphdeck-export-") as tmp:
        files, _info = split_export(path, tmp)
        if not files:
            raise UsageError(f"export {path.name!r} holds no event", file=path.name)
        if progress is not None:
            progress(0.5)
        results = []
        for i, (r, f) in enumerate(sorted(files.items())):
            res = ingest_trace(engine, f, run_name=run_name, rank=r, name=f"{path.name} rank {r}", strict=strict,
                               duplicate=duplicate)
            f.unlink()
            results.append(res)
            if on_rank is not None:
                on_rank(res)
            if progress is not None:
                progress(0.5 + 0.5 * (i + 1) / len(files))
    return results
