"""Rank skew at compile time: compile wall time, cache hits and recompiles compared across ranks.

# NOTE: [Compile skew]
Ranks meet at their first collective after compiling. A rank whose compile takes longer (a
cold Inductor cache where the others' is warm, a recompile on that rank only, a slower host)
arrives late, and every other rank waits inside that collective; past the process group's
timeout the job dies there, with nothing in the collective itself to explain why. Per rank,
from torch's compile records (``compilation_metrics``, ``bwd_compilation_metrics`` for the
backward compiled lazily at the first backward, and their ``*_runtime`` variants):

* ``compile_s``: summed ``duration_us`` (else ``entire_frame_compile_time_s``) of every record;
* ``before_first_collective_s``: the same over the records that start before the rank's first
  collective after its first compile. That collective's time comes from the rank's Kineto
  trace (first collective — kernel or CPU-side, NOTE: [CPU-side collectives] — starting after
  the first compile; its duration is the rank's wait there) when its window began before the
  first compile ended, else from the Flight Recorder's entries (``time_created_ns``) when the
  run holds a dump reaching back to sequence id 1; else it is unknown and the first compile of
  each frame (``f/0``, forward and backward) is counted (``basis`` says which);
* cache hits/misses (local + remote) of Inductor's FX graph cache and the AOTAutograd cache;
* ``recompiles``: forward compile ids ``f/c`` with ``c > 0``; ``failed`` compiles.

A finding: the slowest rank's ``before_first_collective_s`` exceeds the fastest's by at least
``min_skew_s`` and by a factor ``ratio``, and the ranks' first collectives are one collective (the
same group and sequence number where the evidence names them: a rank that compiled ahead, before
an earlier collective, is compared at the collective the job died in instead, NOTE: [Time
verdicts]). It names both times, the caches, the wait the trace
shows at that collective, and the timeout it risks: the process group's timeout recorded by the
capture (``graphdeck_process_groups``) when present, else torch's default for the backend
(``default_pg_timeout`` 30 min; NCCL 10 min).

Pure: reads the store, returns data.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.analysis.units import duration_text as _d
from graphdeck.errors import NotFoundError
from graphdeck.store.schema import CompileEvent, Rank, Run, Trace

METRIC_EVENTS = ("compilation_metrics", "bwd_compilation_metrics", "compilation_metrics_runtime",
                 "bwd_compilation_metrics_runtime")
PG_EVENT = "graphdeck_process_groups"  # capture/process_groups.py: {"groups": [{"name", "timeout_s", ...}]}
#: torch.distributed.constants: default_pg_timeout (gloo and others), default_pg_nccl_timeout.
DEFAULT_TIMEOUT_S = {"nccl": 600.0, None: 1800.0}
_CACHE_FIELDS = {"inductor_fx_graph": "inductor_fx_{where}_cache_{what}_count",
                 "aot_autograd": "aotautograd_{where}_cache_{what}_count"}
_CID = re.compile(r"^!?(\d+)/(\d+)")


@dataclass
class RankCompile:
    """One rank's compiles (times in seconds)."""

    rank: int
    records: int = 0
    frames: int = 0
    recompiles: int = 0
    failed: int = 0
    compile_s: float = 0.0
    before_first_collective_s: float = 0.0
    first_collective: str | None = None  # what it was and where it was read
    first_collective_wait_s: float | None = None  # this rank's time inside it (trace)
    first_collective_ns: int | None = None  # when it started (ns since the epoch, the rank's clock)
    first_collective_group: str | None = None  # its process group (trace; the FR entry has its own)
    first_collective_step: int | None = None  # the profiler's step holding it (trace)
    first_collective_seq: int | None = None  # its sequence number in its group (trace or flight recorder)
    basis: str = "initial compiles"  # "flight recorder" | "trace" | "initial compiles"
    cache: dict = field(default_factory=lambda: {k: {"hit": 0, "miss": 0} for k in _CACHE_FIELDS})

    def cache_text(self) -> str:
        names = {"inductor_fx_graph": "FX graph cache", "aot_autograd": "AOTAutograd cache"}
        return ", ".join(f"{names[k]} {v['hit']} hit(s) / {v['miss']} miss(es)" for k, v in self.cache.items())


@dataclass
class CompileSkew:
    run: str
    ranks: dict[int, RankCompile]
    slowest: int | None = None
    fastest: int | None = None
    skew_s: float = 0.0
    timeout_s: float | None = None
    timeout_source: str | None = None
    finding: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ranks"] = {str(r): asdict(v) for r, v in self.ranks.items()}
        return d


def _num(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def collective_timeout(session: Session, run_id: int) -> tuple[float, str]:
    """``(seconds, source)``: the default process group's timeout as the capture recorded it
    (a ``graphdeck_process_groups`` record), else torch's default for the ranks' backend."""
    for (payload,) in session.execute(select(CompileEvent.payload).where(
            CompileEvent.run_id == run_id, CompileEvent.name == PG_EVENT).order_by(CompileEvent.id.desc())):
        try:
            groups = json.loads(payload or "{}").get("groups") or []
        except (ValueError, AttributeError):
            continue
        timeouts = [g.get("timeout_s") for g in groups if isinstance(g, dict) and _num(g.get("timeout_s")) > 0]
        if timeouts:
            name = next(g.get("name") for g in groups if g.get("timeout_s") == timeouts[0])
            return float(timeouts[0]), f"the process group timeout recorded for group {name}"
    backends = set(session.scalars(select(Rank.backend).where(Rank.run_id == run_id)))
    backend = "nccl" if "nccl" in backends else next(iter(sorted(b for b in backends if b)), None)
    secs = DEFAULT_TIMEOUT_S.get(backend, DEFAULT_TIMEOUT_S[None])
    return secs, f"torch's default {backend or 'process group'} timeout (no timeout recorded)"


def _fr_first_ns(session: Session, run_id: int, rank: int, after_ns: int) -> tuple[int, str, str, int] | None:
    """First Flight Recorder entry of ``rank`` created after ``after_ns`` (ns since the epoch),
    when the stored dump reaches back to the first collective (a sequence id 1): ``(time ns, what,
    process group name, sequence id)``."""
    row = session.execute(select(CompileEvent.payload).where(
        CompileEvent.run_id == run_id, CompileEvent.rank == rank, CompileEvent.name == "flight_recorder")
        .order_by(CompileEvent.id.desc())).first()
    try:
        dump = json.loads(row[0]) if row is not None and row[0] else None
        entries, sigs = dump["entries"], dump.get("sigs") or []
        if not any(e[1] == 1 for e in entries):
            return None
        later = sorted((e[8], e[3]) for e in entries if e[8] and e[8] >= after_ns)
        if not later:
            return None
        t, sig = later[0]
        op = sigs[sig][0] if isinstance(sig, int) and 0 <= sig < len(sigs) else "collective"
        e = next(e for e in entries if e[8] == t)
        pgs = dump.get("pgs") or []
        group = str(pgs[e[0]][0]) if isinstance(e[0], int) and 0 <= e[0] < len(pgs) else str(e[0])
        return int(t), f"{op} (flight recorder)", group, e[1]
    except (TypeError, ValueError, KeyError, IndexError):
        return None


def _newest_trace(session: Session, run_id: int, rank: int) -> int | None:
    return session.scalar(select(Trace.id).where(Trace.run_id == run_id, Trace.rank == rank,
                                                 Trace.status.in_(("ok", "truncated"))).order_by(Trace.id.desc()))


def _trace_first(session: Session, run_id: int, rank: int, after_ns: int, compile_end_ns: int,
                 trace_id: int | None = -1) -> tuple[int, str, float, str, int | None, int] | None:
    """``(start ns, name, duration s, group, profiler step, sequence number)`` of the rank's first traced collective starting after
    ``after_ns``, when its newest usable trace (``trace_id``; -1: look it up) began before
    ``compile_end_ns``."""
    from graphdeck.analysis.traces.collectives import trace_indexes

    tid = _newest_trace(session, run_id, rank) if trace_id == -1 else trace_id
    if tid is None:
        return None
    start = session.scalar(select(Trace.start_ns).where(Trace.id == tid))
    if start is None or start > compile_end_ns:
        return None
    # The collectives indexed at ingest (NOTE: [Collective index]), not every event of the trace.
    _r, colls, _steps = next(trace_indexes(session, {rank: tid}))
    later = [c for c in colls if c["start_ns"] >= after_ns]
    if not later:
        return None
    c = later[0]
    return (c["start_ns"], f"{c['kernel']} #{c['seq']} of group {c['group']} (trace)", c["dur_ns"] / 1e9,
            c["group"], c.get("step"), c["seq"])


#: Fields of a compile record's metadata that :func:`_rank_compiles` reads, in :func:`_parse_metrics` order.
METRIC_FIELDS = ("compile_id", "duration_us", "entire_frame_compile_time_s", "start_time_us", "start_time",
                 "fail_type", *(pattern.format(where=w, what=what) for pattern in _CACHE_FIELDS.values()
                                for what in ("hit", "miss") for w in ("local", "remote")))


def fields_sql(fields: tuple[str, ...], sqlite: bool = True):
    """SQL: the JSON array (text) of ``fields`` of a compile record's metadata, read from its
    envelope (``{"<record name>": {...}}``) when it has one, else from its top level; NULL for
    metadata that is not JSON to SQLite (:func:`raw_fields` reads those). Only these fields
    leave SQLite: a record's metadata is ~40 KB of configs and stack traces. On another
    database (``sqlite`` False): the metadata itself, for :func:`field_values` to read."""
    from sqlalchemy import case, literal

    meta = CompileEvent.metadata_json
    if not sqlite:
        return meta
    envelope = literal("$.") + CompileEvent.name
    return case((func.json_valid(meta) == 1,
                 case((func.json_type(meta, envelope) == "object",
                       func.json_extract(meta, *(envelope + literal(f".{f}") for f in fields))),
                      else_=func.json_extract(meta, *(f"$.{f}" for f in fields)))),
                else_=None)


def field_values(name: str, text: str | None, fields: tuple[str, ...], sqlite: bool = True) -> list | None:
    """The values of ``fields`` from what :func:`fields_sql` selected (``text``) for a record
    named ``name``; None when SQLite found no JSON there (see :func:`raw_fields`)."""
    if not sqlite:
        m = _metrics(name, text)
        return [m.get(f) for f in fields]
    try:
        values = json.loads(text) if text else None
    except ValueError:
        return None
    return values if isinstance(values, list) and len(values) == len(fields) else None


def is_sqlite(session: Session) -> bool:
    """Whether the session's store is SQLite (``json_extract`` available to :func:`fields_sql`)."""
    return session.get_bind().dialect.name == "sqlite"


def raw_fields(session: Session, rows: list[tuple[int, str]], fields: tuple[str, ...]) -> dict[int, list]:
    """Row id → the values of ``fields`` for compile records ``rows`` (``(id, name)``) whose
    metadata SQLite does not take as JSON (Python's json may: a NaN, say), read by Python."""
    names = dict(rows)
    out: dict[int, list] = {}
    for start in range(0, len(rows), 500):
        for row_id, text in session.execute(select(CompileEvent.id, CompileEvent.metadata_json).where(
                CompileEvent.id.in_([r for r, _n in rows[start:start + 500]]))):
            m = _metrics(names[row_id], text)
            out[row_id] = [m.get(f) for f in fields]
    return out


def _metric_rows(session: Session, run_id: int, ranks: list[int] | None = None) -> dict[int, list[tuple]]:
    """rank → its ``(name, compile id, key, values)`` compile records (:data:`METRIC_EVENTS`), in
    id order: one query for the run (``ranks`` None) or for ``ranks``. ``values``: the record's
    :data:`METRIC_FIELDS` (:func:`fields_sql`), None when unreadable; ``key``: equal for equal
    values (the extracted text)."""
    where = [CompileEvent.run_id == run_id, CompileEvent.name.in_(METRIC_EVENTS)]
    if ranks is not None:
        where.append(CompileEvent.rank.in_(ranks))
    sqlite = is_sqlite(session)
    rows = session.connection().execute(
        select(CompileEvent.rank, CompileEvent.id, CompileEvent.name, CompileEvent.compile_id,
               fields_sql(METRIC_FIELDS, sqlite), CompileEvent.metadata_json.is_not(None))
        .where(*where).order_by(CompileEvent.id)).all()
    unread = [(row_id, name) for _r, row_id, name, _c, text, present in rows if text is None and present]
    fallback = raw_fields(session, unread, METRIC_FIELDS) if unread and sqlite else {}
    out: dict[int, list[tuple]] = {}
    for rank, row_id, name, cid, text, _present in rows:
        values = field_values(name, text, METRIC_FIELDS, sqlite) if text else fallback.get(row_id)
        out.setdefault(rank, []).append((name, cid, (name, text) if text else ("row", row_id), values))
    return out


def _metrics(name: str, metadata_json: str | None) -> dict:
    try:
        meta = json.loads(metadata_json or "{}")
    except ValueError:
        return {}
    inner = meta.get(name) if isinstance(meta, dict) else None
    return inner if isinstance(inner, dict) else (meta if isinstance(meta, dict) else {})


def _rank_compiles(session: Session, run_id: int, rank: int, rows: list[tuple], *, has_dump: bool = True,
                   trace_id: int | None = -1, parsed: dict | None = None) -> RankCompile:
    """One rank's compile times, caches and recompiles (NOTE: [Compile skew]) from its records
    ``rows`` (:func:`_metric_rows`). ``has_dump`` False / ``trace_id`` None: the caller knows the
    rank has no Flight Recorder dump / no usable trace (not looked up). ``parsed``: a memo of parsed metadata shared by the ranks of one run."""
    out = RankCompile(rank=rank)
    parsed = {} if parsed is None else parsed
    recs = []
    for name, cid, key, values in rows:
        if key not in parsed:
            parsed[key] = _parse_metrics(values)
        m_cid, dur, start_ns, failed, cache = parsed[key]
        cid = cid or m_cid
        recs.append((name, cid, dur, start_ns))
        out.records += 1
        out.compile_s += dur
        out.failed += failed
        for kind, counts in cache.items():
            for what, n in counts.items():
                out.cache[kind][what] += n
    ids = [_CID.match(c or "") for n, c, _d, _s in recs if n == "compilation_metrics"]
    out.frames = len({m.group(1) for m in ids if m})
    out.recompiles = len({(m.group(1), m.group(2)) for m in ids if m and int(m.group(2)) > 0})
    starts = [s for _n, _c, _d, s in recs if s]
    if starts and (has_dump or trace_id is not None):
        t0 = min(starts)
        first_end = min(s + int(d * 1e9) for _n, _c, d, s in recs if s == t0)
        fr = _fr_first_ns(session, run_id, rank, t0) if has_dump else None
        tr = _trace_first(session, run_id, rank, t0, first_end, trace_id) if trace_id is not None else None
        if fr or tr:
            t1, out.first_collective = (tr or fr)[:2]
            out.basis = "trace" if tr else "flight recorder"
            out.first_collective_wait_s = tr[2] if tr else None
            out.first_collective_ns = t1
            out.first_collective_group, out.first_collective_step = (tr[3], tr[4]) if tr else (fr[2], None)
            out.first_collective_seq = tr[5] if tr else fr[3]
            out.before_first_collective_s = sum(d for _n, _c, d, s in recs if s and s < t1)
            return out
    initial = [d for _n, c, d, _s in recs if (m := _CID.match(c or "")) and m.group(2) == "0"]
    out.before_first_collective_s = sum(initial)
    return out


def _parse_metrics(values: list | None) -> tuple:
    """``(compile id, duration s, start ns, failed 0/1, {cache kind: {"hit", "miss"}})`` of one
    compile record from its :data:`METRIC_FIELDS` values (:func:`_metric_rows`)."""
    m = dict(zip(METRIC_FIELDS, values)) if values else {}
    dur = _num(m.get("duration_us")) / 1e6 or _num(m.get("entire_frame_compile_time_s"))
    start_ns = int(_num(m.get("start_time_us")) * 1000) or int(_num(m.get("start_time")) * 1e9)
    cache = {kind: {what: sum(int(_num(m.get(pattern.format(where=w, what=what)))) for w in ("local", "remote"))
                    for what in ("hit", "miss")} for kind, pattern in _CACHE_FIELDS.items()}
    return m.get("compile_id"), dur, start_ns, 1 if m.get("fail_type") else 0, cache


def compile_skew(session: Session, run: Run, *, min_skew_s: float = 2.0, ratio: float = 1.5,
                 records: dict[int, list[tuple]] | None = None) -> CompileSkew:
    """Compare the ranks of ``run`` at compile time (NOTE: [Compile skew]); ``finding`` is set
    when the slowest rank's compile before the first collective exceeds the fastest's by
    ``min_skew_s`` seconds and by the factor ``ratio``. Ranks without compile records are left
    out. Raises NotFoundError for ``run`` None (a run the caller did not find) and ValueError for
    ``min_skew_s < 0`` or ``ratio < 1``. ``records``: the run's compile records as
    :func:`_metric_rows` gives them, when the caller read them already (check-ranks reads them
    with the compile sequences: :func:`graphdeck.analysis.ranks.core.compile_sequences`)."""
    if run is None:
        raise NotFoundError("compile_skew: no such run", resource="run", id=None)
    if min_skew_s < 0 or ratio < 1:
        raise ValueError(f"compile_skew: min_skew_s must be >= 0 and ratio >= 1 (got {min_skew_s}, {ratio})")
    # Read for every rank at once (a 1,024-rank run is not thousands of per-rank queries): the
    # compile records, which ranks hold a Flight Recorder dump, each rank's newest usable trace.
    rows = _metric_rows(session, run.id) if records is None else records
    ranks = sorted(rows)
    dumps = set(session.scalars(select(CompileEvent.rank).where(
        CompileEvent.run_id == run.id, CompileEvent.name == "flight_recorder").distinct()))
    traces = dict(session.execute(select(Trace.rank, func.max(Trace.id)).where(
        Trace.run_id == run.id, Trace.status.in_(("ok", "truncated"))).group_by(Trace.rank)).all())
    parsed: dict = {}
    out = CompileSkew(run=run.name, ranks={r: _rank_compiles(session, run.id, r, rows[r], has_dump=r in dumps,
                                                             trace_id=traces.get(r), parsed=parsed)
                                           for r in ranks})
    if len(ranks) < 2:
        return out
    key = {r: v.before_first_collective_s for r, v in out.ranks.items()}
    out.slowest = max(ranks, key=lambda r: (key[r], -r))
    out.fastest = min(ranks, key=lambda r: (key[r], r))
    slow, fast = out.ranks[out.slowest], out.ranks[out.fastest]
    out.skew_s = slow.before_first_collective_s - fast.before_first_collective_s
    out.timeout_s, out.timeout_source = collective_timeout(session, run.id)
    if out.skew_s < min_skew_s or slow.before_first_collective_s < ratio * fast.before_first_collective_s:
        return out
    if len({v.basis for v in out.ranks.values()}) == 1 and len(
            {(v.first_collective_group, v.first_collective_seq) for v in out.ranks.values()}) > 1:
        return out  # each rank's first collective after its first compile is another one: not one wait
    where = {"flight recorder": "its first collective", "trace": "its first collective",
             "initial compiles": "its first collective (first compile of each frame; no record of when the "
                                 "collective ran)"}

    def side(v: RankCompile) -> str:
        return (f"rank {v.rank} compiled {_d(v.before_first_collective_s, 1)} before {where[v.basis]} "
                f"({v.records} compile record(s), {v.recompiles} recompile(s), {v.failed} failed; {v.cache_text()})")

    waits = [f"rank {v.rank} waited {_d(v.first_collective_wait_s, 1)} inside {v.first_collective}"
             for v in out.ranks.values() if v.rank != out.slowest and v.first_collective_wait_s
             and v.first_collective_wait_s >= min_skew_s]
    share = out.skew_s / out.timeout_s if out.timeout_s else None
    out.finding = (
        f"compile skew: {side(slow)}; {side(fast)}. The other ranks wait about {_d(out.skew_s, 1)} for "
        f"rank {out.slowest} at that collective" + (f" ({'; '.join(waits)})" if waits else "")
        + f": {share:.0%} of the {out.timeout_s:.0f} s collective timeout ({out.timeout_source}); "
        f"a skew past it kills the job in that collective")
    return out
