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
``min_skew_s`` and by a factor ``ratio``. It names both times, the caches, the wait the trace
shows at that collective, and the timeout it risks: the process group's timeout recorded by the
capture (``graphdeck_process_groups``) when present, else torch's default for the backend
(``default_pg_timeout`` 30 min; NCCL 10 min).

Pure: reads the store, returns data.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

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


def _metrics(name: str, metadata_json: str | None) -> dict:
    try:
        meta = json.loads(metadata_json or "{}")
    except ValueError:
        return {}
    inner = meta.get(name) if isinstance(meta, dict) else None
    return inner if isinstance(inner, dict) else (meta if isinstance(meta, dict) else {})


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


def _fr_first_ns(session: Session, run_id: int, rank: int, after_ns: int) -> tuple[int, str] | None:
    """First Flight Recorder entry of ``rank`` created after ``after_ns`` (ns since the epoch),
    when the stored dump reaches back to the first collective (a sequence id 1)."""
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
        return int(t), f"{op} (flight recorder)"
    except (TypeError, ValueError, KeyError, IndexError):
        return None


def _trace_first(session: Session, run_id: int, rank: int, after_ns: int, compile_end_ns: int
                 ) -> tuple[int, str, float] | None:
    """``(start ns, name, duration s)`` of the rank's first traced collective starting after
    ``after_ns``, when its newest usable trace began before ``compile_end_ns``."""
    from graphdeck.analysis.trace_analysis import TraceData
    from graphdeck.analysis.trace_collectives import rank_collectives

    tid = session.scalar(select(Trace.id).where(Trace.run_id == run_id, Trace.rank == rank,
                                                Trace.status.in_(("ok", "truncated"))).order_by(Trace.id.desc()))
    if tid is None:
        return None
    data = TraceData(session, tid)
    if not data.events or min(e.ts for e in data.events) > compile_end_ns:
        return None
    later = [c for c in rank_collectives(data) if c["start_ns"] >= after_ns]
    if not later:
        return None
    c = later[0]
    return c["start_ns"], f"{c['kernel']} #{c['seq']} of group {c['group']} (trace)", c["dur_ns"] / 1e9


def rank_compiles(session: Session, run_id: int, rank: int) -> RankCompile:
    """One rank's compile times, caches and recompiles (NOTE: [Compile skew])."""
    out = RankCompile(rank=rank)
    recs = []
    for name, cid, meta_json in session.execute(
            select(CompileEvent.name, CompileEvent.compile_id, CompileEvent.metadata_json)
            .where(CompileEvent.run_id == run_id, CompileEvent.rank == rank, CompileEvent.name.in_(METRIC_EVENTS))
            .order_by(CompileEvent.id)):
        m = _metrics(name, meta_json)
        cid = cid or m.get("compile_id")
        dur = _num(m.get("duration_us")) / 1e6 or _num(m.get("entire_frame_compile_time_s"))
        start_ns = int(_num(m.get("start_time_us")) * 1000) or int(_num(m.get("start_time")) * 1e9)
        recs.append((name, cid, dur, start_ns))
        out.records += 1
        out.compile_s += dur
        if m.get("fail_type"):
            out.failed += 1
        for kind, pattern in _CACHE_FIELDS.items():
            for what in ("hit", "miss"):
                out.cache[kind][what] += sum(int(_num(m.get(pattern.format(where=w, what=what))))
                                             for w in ("local", "remote"))
    ids = [_CID.match(c or "") for n, c, _d, _s in recs if n == "compilation_metrics"]
    out.frames = len({m.group(1) for m in ids if m})
    out.recompiles = len({(m.group(1), m.group(2)) for m in ids if m and int(m.group(2)) > 0})
    starts = [s for _n, _c, _d, s in recs if s]
    if starts:
        t0 = min(starts)
        first_end = min(s + int(d * 1e9) for _n, _c, d, s in recs if s == t0)
        fr = _fr_first_ns(session, run_id, rank, t0)
        tr = _trace_first(session, run_id, rank, t0, first_end)
        if fr or tr:
            t1, out.first_collective = (tr or fr)[:2]
            out.basis = "trace" if tr else "flight recorder"
            out.first_collective_wait_s = tr[2] if tr else None
            out.before_first_collective_s = sum(d for _n, _c, d, s in recs if s and s < t1)
            return out
    initial = [d for _n, c, d, _s in recs if (m := _CID.match(c or "")) and m.group(2) == "0"]
    out.before_first_collective_s = sum(initial)
    return out


def compile_skew(session: Session, run: Run, *, min_skew_s: float = 2.0, ratio: float = 1.5) -> CompileSkew:
    """Compare the ranks of ``run`` at compile time (NOTE: [Compile skew]); ``finding`` is set
    when the slowest rank's compile before the first collective exceeds the fastest's by
    ``min_skew_s`` seconds and by the factor ``ratio``. Ranks without compile records are left
    out. Raises NotFoundError for ``run`` None (a run the caller did not find) and ValueError for
    ``min_skew_s < 0`` or ``ratio < 1``."""
    if run is None:
        raise NotFoundError("compile_skew: no such run", resource="run", id=None)
    if min_skew_s < 0 or ratio < 1:
        raise ValueError(f"compile_skew: min_skew_s must be >= 0 and ratio >= 1 (got {min_skew_s}, {ratio})")
    ranks = sorted(set(session.scalars(select(CompileEvent.rank).where(
        CompileEvent.run_id == run.id, CompileEvent.name.in_(METRIC_EVENTS)).distinct())))
    out = CompileSkew(run=run.name, ranks={r: rank_compiles(session, run.id, r) for r in ranks})
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
    where = {"flight recorder": "its first collective", "trace": "its first collective",
             "initial compiles": "its first collective (first compile of each frame; no record of when the "
                                 "collective ran)"}

    def side(v: RankCompile) -> str:
        return (f"rank {v.rank} compiled {v.before_first_collective_s:.1f} s before {where[v.basis]} "
                f"({v.records} compile record(s), {v.recompiles} recompile(s), {v.failed} failed; {v.cache_text()})")

    waits = [f"rank {v.rank} waited {v.first_collective_wait_s:.1f} s inside {v.first_collective}"
             for v in out.ranks.values() if v.rank != out.slowest and v.first_collective_wait_s
             and v.first_collective_wait_s >= min_skew_s]
    share = out.skew_s / out.timeout_s if out.timeout_s else None
    out.finding = (
        f"compile skew: {side(slow)}; {side(fast)}. The other ranks wait about {out.skew_s:.1f} s for "
        f"rank {out.slowest} at that collective" + (f" ({'; '.join(waits)})" if waits else "")
        + f": {share:.0%} of the {out.timeout_s:.0f} s collective timeout ({out.timeout_source}); "
        f"a skew past it kills the job in that collective")
    return out
