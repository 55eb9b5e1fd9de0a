"""Collectives across ranks: matching, clock alignment, who arrived last, stragglers.

# NOTE: [Rank clock alignment]
Each rank's trace has its own clock. Stage 1 (base time): Kineto writes ``ts`` relative to
``baseTimeNanoseconds`` (or as absolute µs since the epoch in older traces), and the ingest
stores absolute ns, so ranks start on a common (host wall-clock) axis, off by the hosts' clock
skew. Stage 2 (refine): a collective ends at (nearly) the same instant on every rank that
takes part — no rank's kernel finishes before the last one's data has arrived — so the offset of
rank r against the reference rank (the lowest) is the median over matched collectives of
``end_r - end_ref``, less the collectives where any rank diverges (another kind or element
count than most ranks run there: :func:`diverging`; such a kernel is not the same collective and
may end at another time; left out for every rank, so that all ranks' medians are over the same
collectives). Aligned times are ``ts - offset``. With no matched collective the offset
stays 0 and ``method`` says ``base_time``.

Matching: a communication kernel (per :class:`~graphdeck.analysis.traces.analyze.CommRule`)
belongs to a process group (``args["Process Group Name"]``, written by PyTorch >= 2.1 on NCCL
kernels; ``"?"`` when absent) and is the k-th communication kernel of that group on its rank
(k from 0 in start order): ``(group, k)`` identifies the same collective on every rank. Where
the group is absent the collective's kind (from ``args["Collective name"]`` or the kernel
name, e.g. ``SendRecv``) joins the key, so different kinds are never matched.

Per matched collective: ``arrive_ns`` (aligned kernel start) per rank, ``last_rank`` (who arrived
last), and per rank ``wait_ns`` = last arrival − own arrival (time spent waiting for peers) and
``transfer_ns`` = the rest of its kernel (moving data once all are there), so
``wait_ns + transfer_ns`` = the kernel's duration (``wait_ns`` is capped at it: point-to-point
kernels need not end together).
"""

from __future__ import annotations

import ast
import json
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import CommRule, TraceData
from graphdeck.analysis.traces.bandwidth import message_bytes
from graphdeck.errors import NotFoundError
from graphdeck.store.schema import Run, Trace

if TYPE_CHECKING:
    from graphdeck.analysis.traces.data import Ev

_KIND = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def _kind(name: str, args: dict) -> str:
    c = args.get("Collective name")
    if isinstance(c, str) and c:
        return c
    m = _KIND.search(name)
    return m.group(1) if m else name[:40]


def process_groups(meta: dict) -> dict:
    """A trace's ``distributedInfo`` read leniently: ``{"rank", "world_size", "backend",
    "nccl_version", "groups": [{"name", "desc", "size", "ranks": [int, ...]}]}``.

    Kineto writes ``pg_config[].ranks`` as a list, or as a string such as ``"[0, 1]"`` in some
    versions; ``nccl_version`` may be ``"unknown"``; ``distributedInfo`` may come after
    ``traceEvents`` (the ingest reads it on either side). Missing values are None."""
    info = meta.get("distributedInfo") if isinstance(meta, dict) else None
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except ValueError:
            try:
                info = ast.literal_eval(info)
            except (ValueError, SyntaxError):
                info = None
    if not isinstance(info, dict):
        return {"rank": None, "world_size": None, "backend": None, "nccl_version": None, "groups": []}
    groups = []
    for pg in info.get("pg_config") or []:
        if not isinstance(pg, dict):
            continue
        ranks = pg.get("ranks")
        if isinstance(ranks, str):
            ranks = [int(x) for x in re.findall(r"-?\d+", ranks)]
        groups.append({"name": None if pg.get("pg_name") is None else str(pg.get("pg_name")), "desc": pg.get("pg_desc"),
                       "size": pg.get("pg_size"), "ranks": [int(r) for r in ranks] if isinstance(ranks, list) else None})
    return {"rank": info.get("rank"), "world_size": info.get("world_size"), "backend": info.get("backend"),
            "nccl_version": info.get("nccl_version"), "groups": groups}


def _wait(late_ns: int, dur_ns: int) -> int:
    """Waiting part of a kernel: until the last peer arrived, at most the kernel's length."""
    return min(max(0, late_ns), dur_ns)


def rank_collectives(data: TraceData, rule: CommRule | None = None) -> list[dict]:
    """The communication kernels of one trace as ``{"key", "group", "kind", "seq", "start_ns",
    "end_ns", "dur_ns", "kernel", "step"}`` in start order (``key`` = ``(group, seq)`` or
    ``("?", kind, seq)``, see NOTE: [Rank clock alignment]), and its CPU-side collectives
    (``gloo:all_reduce``...; ``where = "cpu"``, NOTE: [CPU-side collectives])."""
    rule = rule or CommRule()
    steps = _step_spans(data)
    seq: Counter = Counter()
    out = [_comm_entry(k, data.launch_ts(k), steps, seq)
           for k in sorted((k for k in data.kernels if rule.is_comm(k.name)), key=lambda e: (e.ts, e.id))]
    return _with_cpu(data, out)


def _step_spans(data: TraceData) -> list[tuple[int, int, int]]:
    return [(s.ts, s.end, int(_STEP.match(s.name).group(1))) for s in data.steps()]


def _comm_entry(k, launch: int, steps: list[tuple[int, int, int]], seq: Counter) -> dict:
    """:func:`rank_collectives`' entry of communication kernel ``k`` launched at ``launch`` (ns);
    kernels must come in ``(ts, id)`` order (``seq`` counts per group)."""
    args = k.args_dict()
    group = args.get("Process Group Name")
    group = str(group) if group is not None else "?"
    kind = _kind(k.name, args)
    ident = (group,) if group != "?" else (group, kind)
    n = seq[ident]
    seq[ident] += 1
    step = next((num for s, e, num in steps if s <= launch < e), None)
    nelems = args.get("In msg nelems")
    return {"key": (*ident, n), "group": group, "kind": kind, "seq": n, "start_ns": k.ts, "end_ns": k.end,
            "dur_ns": k.dur, "kernel": k.name, "step": step,
            "nelems": nelems if isinstance(nelems, int) and not isinstance(nelems, bool) else None,
            "bytes": message_bytes(args)}


def _with_cpu(data: TraceData, out: list[dict]) -> list[dict]:
    from graphdeck.analysis.ranks.cpu_collectives import cpu_collectives  # NOTE: [CPU-side collectives]

    cpu = cpu_collectives(data, has_comm_kernels=bool(out))
    return sorted(out + cpu, key=lambda c: (c["start_ns"], c["key"])) if cpu else out


def run_traces(session: Session, run_id: int) -> dict[int, int]:
    """rank → the newest usable (``ok`` / ``truncated``) trace id of run ``run_id``."""
    rows = session.execute(select(Trace.rank, Trace.id).where(
        Trace.run_id == run_id, Trace.status.in_(("ok", "truncated"))).order_by(Trace.id)).all()
    return {rank: tid for rank, tid in rows}


# NOTE: [Collective index]
# What matching and alignment read of a trace — its collectives (rank_collectives) and its step
# times (step_times) — is a few hundred rows of a trace's tens of thousands of events. The ingest
# computes it once (store_index, in the ingesting process, so parallel ingests compute it in
# parallel) and keeps it in the trace's ``stats_json`` under ``collective_index`` (``v`` =
# INDEX_VERSION, the default CommRule): align_and_match of 1,024 ranks then reads 1,024 small
# JSON documents instead of ~50 M events. Traces without it (stores written before it, a newer
# version, a custom CommRule) are read from their events as before, through CollectiveData: only
# kernels, launch calls, profiler steps and CPU-side collective candidates, which gives the same
# collectives and step times. build_index streams the kernels, each with its launch time joined by
# the database (NOTE: [Bounded launch sweep] in launch_sweep.py): the ingest's memory does not grow
# with the trace; only the steps and the CPU-side candidates (rows a step or a collective) are
# loaded whole.
INDEX_KEY = "collective_index"
INDEX_VERSION = 2  # 2: each collective's "bytes" (NOTE: [Bus bandwidth]); older indexes are read again

_INDEX_SQL = (
    "SELECT e.id, n.value, COALESCE(c.value, ''), e.ts_ns, e.dur_ns, e.pid, e.tid, e.correlation, "
    "CASE WHEN c.value IN ({runtime}) THEN NULL ELSE e.args_json END FROM trace_events e "
    "JOIN strings n ON n.id = e.name_id LEFT JOIN strings c ON c.id = e.cat_id WHERE e.trace_id = :tid AND "
    "e.ph = 'X' AND ({kernels}e.name_id IN (SELECT s.id FROM strings s WHERE s.value LIKE 'gloo:%' OR s.value LIKE "
    "'mpi:%' OR s.value LIKE 'ucc:%' OR s.value = 'record_param_comms' OR s.value LIKE 'c10d::%' OR s.value LIKE "
    "'ProfilerStep#%')) ORDER BY e.ts_ns, e.id")  # ids first: the strings are not joined to every event


class CollectiveData(TraceData):
    """A :class:`TraceData` holding only what :func:`rank_collectives` and :func:`step_times`
    read (NOTE: [Collective index]): kernels (memcpy/memset left out), launch calls (without their
    args), profiler steps and CPU-side collective candidates. ``links`` give each kernel its
    launch call (``op`` and ``chain`` hold only the ranges loaded), so labels are not those of
    :class:`TraceData`; collectives, their steps and step times are the same. ``kernels=False``:
    only the profiler steps and CPU-side candidates (a few rows a collective and a step; the
    kernels are then streamed: NOTE: [Bounded launch sweep])."""

    def __init__(self, session: Session, trace_id: int, kernels: bool = True):  # noqa: D107 - no super(): it would load every event
        from graphdeck.analysis.traces.data import GPU_KERNEL_CATS, RUNTIME_CATS, Ev
        from graphdeck.analysis.traces.links import link_gpu_events

        cats, runtime = sorted(GPU_KERNEL_CATS | RUNTIME_CATS), sorted(RUNTIME_CATS)
        sql = _INDEX_SQL.format(kernels=f"e.cat_id IN (SELECT id FROM strings WHERE value IN ({','.join(f':c{i}' for i in range(len(cats)))})) OR "
                                if kernels else "",
                                runtime=",".join(f":r{i}" for i in range(len(runtime))))
        params = {"tid": trace_id, **({f"c{i}": c for i, c in enumerate(cats)} if kernels else {}),
                  **{f"r{i}": c for i, c in enumerate(runtime)}}
        self.trace_id = trace_id
        self.events = [Ev(*row) for row in session.execute(text(sql), params)]
        self.links = link_gpu_events(self.events) if kernels else {}
        self.gpu = self.kernels = [e for e in self.events if e.cat in GPU_KERNEL_CATS] if kernels else []
        self._session = session
        self._mapping = None


def build_index(session: Session, trace_id: int, rule: CommRule | None = None,
                on_kernel: Callable[[Ev], None] | None = None) -> dict:
    """``{"v": INDEX_VERSION, "collectives": [...], "steps": [...]}`` of one stored trace:
    :func:`rank_collectives` (``key`` as a list) and :func:`step_times`, read through
    :class:`CollectiveData` (NOTE: [Collective index]) with the kernels streamed, each with its
    launch time joined by the database (NOTE: [Bounded launch sweep]), so memory does not grow
    with the trace. Times in ns on the trace's own clock. ``on_kernel``: called with each streamed
    kernel (args read) in ``(ts, id)`` order, so another analysis of the kernels shares this pass
    (the ingest's kernel links: NOTE: [Stored kernel links])."""
    from graphdeck.analysis.traces.analyze import StepTimes
    from graphdeck.analysis.traces.launch_sweep import stream_kernels

    rule = rule or CommRule()
    data = CollectiveData(session, trace_id, kernels=False)
    spans = _step_spans(data)
    times, seq, out = StepTimes(data.steps()), Counter(), []
    for k, launch in stream_kernels(session, trace_id, args=True, launch=True):
        if on_kernel is not None:
            on_kernel(k)
        times.add(k, launch)
        if rule.is_comm(k.name):
            out.append(_comm_entry(k, launch, spans, seq))
    colls = [{**c, "key": list(c["key"])} for c in _with_cpu(data, out)]
    return {"v": INDEX_VERSION, "collectives": colls, "steps": times.rows()}


def store_index(session: Session, trace_id: int) -> dict:
    """Compute the trace's collective index with the default CommRule and keep it in its
    ``stats_json`` (``collective_index``); the caller commits. Returns the index."""
    trace = session.get(Trace, trace_id)
    index = build_index(session, trace_id)
    try:
        stats = json.loads(trace.stats_json) if trace.stats_json else {}
    except ValueError:
        stats = {}
    stats[INDEX_KEY] = index
    trace.stats_json = json.dumps(stats, separators=(",", ":"))
    return index


def _from_index(index: dict) -> tuple[list[dict], list[dict]]:
    colls = [{**c, "key": tuple(c["key"])} for c in index["collectives"]]
    return colls, index["steps"]


def trace_indexes(session: Session, traces: dict[int, int], rule: CommRule | None = None):
    """Yield ``(rank, collectives, step_times)`` for each ``rank → trace id`` of ``traces`` in
    rank order: the stored index where it is usable, else read from the events (NOTE:
    [Collective index]); one rank's events at a time, so memory does not grow with the ranks."""
    use_stored = rule is None or rule == CommRule()
    ranks = sorted(traces)
    for i in range(0, len(ranks), 256):
        part = ranks[i:i + 256]
        stored: dict[int, str | None] = {}
        if use_stored:
            stored = dict(session.execute(select(Trace.id, Trace.stats_json).where(
                Trace.id.in_([traces[r] for r in part]))).all())
        for r in part:
            index = None
            raw = stored.get(traces[r])
            if raw and INDEX_KEY in raw:
                try:
                    index = json.loads(raw).get(INDEX_KEY)
                except ValueError:
                    index = None
                if not isinstance(index, dict) or index.get("v") != INDEX_VERSION:
                    index = None
            if index is None:
                index = build_index(session, traces[r], rule)
            yield (r, *_from_index(index))


def _signature(c: dict) -> tuple:
    return (c["kind"], c.get("nelems"))


def diverging(per_rank: dict[int, list[dict]]) -> dict[tuple, set[int]]:
    """Collective key → the ranks whose collective there is not the one most ranks run (another
    kind or element count, :func:`_signature`, as :func:`align_and_match` calls a rank divergent);
    every rank of a key with no majority. ``per_rank``: rank → its collective-index entries
    (``key``, ``kind``, ``nelems``). Such a collective is not one collective across those ranks:
    it is neither linked by a flow nor used for clock offsets."""
    sigs: dict[tuple, dict[int, tuple]] = defaultdict(dict)
    for r, colls in per_rank.items():
        for c in colls:
            sigs[c["key"]][r] = _signature(c)
    apart: dict[tuple, set[int]] = {}
    for key, by_rank in sigs.items():
        counts = Counter(by_rank.values()).most_common()
        if len(counts) < 2:
            continue
        (top, n), (_second, n2) = counts[0], counts[1]
        apart[key] = set(by_rank) if n == n2 else {r for r, sig in by_rank.items() if sig != top}
    return apart


def _divergent(matched: dict[tuple, dict[int, dict]], counts: dict[str, Counter]) -> list[dict]:
    """Per rank, the first collective (lowest step, then sequence) where its kind or element count
    differs from what most ranks of that collective run; and ranks that issue fewer or more
    collectives of a group than most (``count``). Sorted by rank."""
    first: dict[int, dict] = {}
    for key in sorted(matched, key=lambda k: (k[-1], k)):
        parts = matched[key]
        sigs = Counter(_signature(c) for c in parts.values())
        if len(sigs) < 2:
            continue
        (expected, n_expected), = sigs.most_common(1)
        for r, c in sorted(parts.items()):
            if _signature(c) != expected and r not in first:
                first[r] = {"rank": r, "group": c["group"], "seq": c["seq"], "step": c["step"], "kind": c["kind"],
                            "nelems": c.get("nelems"), "expected_kind": expected[0], "expected_nelems": expected[1],
                            "agreeing_ranks": n_expected, "where": c.get("where", "gpu")}
    for group, per in counts.items():
        if len(set(per.values())) < 2:
            continue
        (mode, _n), = Counter(per.values()).most_common(1)
        for r, n in sorted(per.items()):
            if n != mode and r not in first:
                first[r] = {"rank": r, "group": group, "seq": min(n, mode), "step": None, "kind": None,
                            "nelems": None, "expected_kind": None, "expected_nelems": None, "count": n,
                            "expected_count": mode, "where": None}
    return [first[r] for r in sorted(first)]


def _divergent_text(d: dict) -> str:
    def what(kind, nelems):
        return f"{kind}" + (f" of {nelems:,} elements" if isinstance(nelems, int) else "")

    if d.get("count") is not None:
        return (f"rank {d['rank']} issued {d['count']} collectives of group {d['group']!r} where most ranks issued "
                f"{d['expected_count']}")
    step = f" (step {d['step']})" if d["step"] is not None else ""
    return (f"rank {d['rank']} diverges at collective #{d['seq']} of group {d['group']!r}{step}: "
            f"{what(d['kind'], d['nelems'])} where {d['agreeing_ranks']} ranks run "
            f"{what(d['expected_kind'], d['expected_nelems'])}")


def _expected_ranks(session: Session, run_id: int) -> set[int]:
    """The ranks a run should have: its ``world_size`` (when known) and every rank it recorded."""
    from graphdeck.store.schema import Rank

    run = session.get(Run, run_id)
    ranks = set(session.scalars(select(Rank.rank).where(Rank.run_id == run_id)))
    if run is not None and run.world_size:
        ranks |= set(range(int(run.world_size)))
    return ranks


def rank_spans(ranks: list[int], sep: str = ",", dash: str = "-") -> str:
    """Sorted ranks (or steps) as runs: ``[0, 1, 2, 5]`` → ``"0-2,5"`` (``sep`` between runs,
    ``dash`` inside one)."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}{dash}{ranks[j]}")
        i = j + 1
    return sep.join(out)


def align_and_match(session: Session, run_id: int, rule: CommRule | None = None,
                    traces: dict[int, int] | None = None) -> dict:
    """Match collectives across the ranks of run ``run_id``, estimate clock offsets and find
    stragglers.

    Returns ``{"ranks": {rank: trace_id}, "offsets": {rank: {"offset_ns", "method",
    "matched"}}, "collectives": [...], "stragglers": [...], "unmatched": {rank: n},
    "step_times": {rank: [...]}, "divergent": [...], "missing_ranks": [...], "verdict"}`` (step
    times per rank: :func:`~graphdeck.analysis.traces.analyze.step_times`, times on each rank's
    own clock).
    ``collectives`` entries: ``group``, ``kind``, ``seq``, ``step``, ``ranks`` (rank →
    ``arrive_ns``, ``end_ns``, ``wait_ns``, ``transfer_ns``), ``last_rank``, ``spread_ns``
    (last − first arrival), ``suspect`` (None, or why the match cannot be one collective: a rank
    ended before the last one arrived; for host-side (CPU) collectives, by more than the two ranks'
    offset ``spread_ns``: the median distance of their collective ends from their median offset,
    what a loaded host's scheduling puts on an end; such matches are listed but not used for stragglers). ``stragglers``: per step, each rank's summed lateness
    (arrival − first arrival) and how often it arrived last; ``straggler`` is the rank with the
    largest lateness (None with one rank). ``timing``: per rank, time in collectives, waiting,
    moving data and computing, and the straggler in words
    (:func:`graphdeck.analysis.ranks.cpu_collectives.rank_timing`). ``divergent``: per rank, the first
    collective whose kind or element count differs from most ranks' at the same (group, sequence)
    (or a different number of collectives in a group). ``missing_ranks``: ranks of the run
    (``world_size``, recorded ranks) without a usable trace; ``verdict`` is ``"INCOMPLETE"`` when
    there are any (the straggler may be among them), ``"DIVERGED"`` when ranks diverge, else
    ``"OK"``; ``timing["message"]`` says all three in words. Raises NotFoundError for an unknown
    run.
    """
    if session.get(Run, run_id) is None:
        raise NotFoundError(f"run {run_id} not found", resource="run", id=run_id)
    traces = traces or run_traces(session, run_id)
    per_rank: dict[int, list[dict]] = {}
    steps: dict[int, list[dict]] = {}
    for r, colls, st in trace_indexes(session, traces, rule):
        per_rank[r], steps[r] = colls, st
    by_key: dict[tuple, dict[int, dict]] = defaultdict(dict)
    counts: dict[str, Counter] = defaultdict(Counter)
    for r, colls in per_rank.items():
        for c in colls:
            by_key[c["key"]][r] = c
            counts[(c["group"], c.get("where", "gpu"))][r] += 1
    matched = {k: v for k, v in by_key.items() if len(v) > 1}
    ranks = sorted(per_rank)
    ref = ranks[0] if ranks else None
    apart = diverging(per_rank)  # not one collective across its ranks: no rank's offset from it
    ref_end = {k: v[ref]["end_ns"] for k, v in matched.items() if ref in v and k not in apart}
    diffs_of: dict[int, list[int]] = defaultdict(list)
    for k, v in matched.items():
        if k in ref_end:
            for r, c in v.items():
                diffs_of[r].append(c["end_ns"] - ref_end[k])
    offsets: dict[int, dict] = {}
    for r in ranks:
        diffs = diffs_of.get(r, [])
        if r == ref or not diffs:
            offsets[r] = {"offset_ns": 0, "method": "reference" if r == ref else "base_time", "matched": len(diffs)}
        else:
            med = int(statistics.median(diffs))
            # how far the ends that gave the median stray from it: the estimate's own uncertainty
            # (a rank descheduled as a collective ends records a later end)
            offsets[r] = {"offset_ns": med, "method": "collective_end_median", "matched": len(diffs),
                          "spread_ns": int(statistics.median(abs(d - med) for d in diffs))}
    collectives = []
    for key in sorted(matched, key=lambda k: min(c["start_ns"] - offsets[r]["offset_ns"] for r, c in matched[k].items())):
        parts = matched[key]
        arrive = {r: c["start_ns"] - offsets[r]["offset_ns"] for r, c in parts.items()}
        last_rank = max(sorted(arrive), key=lambda r: arrive[r])
        last = arrive[last_rank]
        any_c = next(iter(parts.values()))
        ends = {r: c["end_ns"] - offsets[r]["offset_ns"] for r, c in parts.items()}
        first_end = min(sorted(ends), key=lambda r: ends[r])
        # Every rank of one collective is inside it at a common instant: the last arrival comes
        # before the first end. A match that fails this is not one collective (a partial set of
        # ranks matched by sequence alone, e.g. point-to-point kernels of absent peers), or the
        # clocks are off by more than the offset estimate.
        # Host-side (CPU) collectives' ends are the ranks' threads' own clock readings, late by however
        # long the scheduler kept a thread off a core: there the clocks are known only to the offsets'
        # spread (the median distance of each rank's ends from its median offset), and a rank ending
        # within that of the last arrival is not evidence. GPU kernels' ends are the device's: no slack.
        slack = (sum(offsets[r].get("spread_ns", 0) for r in {first_end, last_rank})
                 if any_c.get("where") == "cpu" else 0)
        suspect = None
        if last > ends[first_end] + slack:
            from graphdeck.analysis.units import ns_text

            suspect = (f"rank {first_end} ended {ns_text(last - ends[first_end])} before rank {last_rank} "
                       f"arrived: not one collective, or clocks off by more than the estimated offset")
        collectives.append({
            "suspect": suspect,
            "group": any_c["group"], "kind": any_c["kind"], "seq": any_c["seq"],
            "step": next((c["step"] for c in parts.values() if c["step"] is not None), None),
            "last_rank": last_rank, "spread_ns": last - min(arrive.values()),
            "ranks": {r: {"arrive_ns": arrive[r], "end_ns": ends[r],
                          "wait_ns": _wait(last - arrive[r], c["dur_ns"]),
                          "transfer_ns": c["dur_ns"] - _wait(last - arrive[r], c["dur_ns"]),
                          "kernel": c["kernel"]} for r, c in sorted(parts.items())},
        })
    stragglers = []
    by_step: dict = defaultdict(list)
    for c in collectives:
        if c["suspect"] is None:
            by_step[c["step"]].append(c)
    for step in sorted(by_step, key=lambda s: (s is None, s or 0)):
        late: Counter = Counter()
        lasts: Counter = Counter()
        for c in by_step[step]:
            first = min(v["arrive_ns"] for v in c["ranks"].values())
            for r, v in c["ranks"].items():
                late[r] += v["arrive_ns"] - first
            lasts[c["last_rank"]] += 1
        straggler = max(sorted(late), key=lambda r: late[r]) if len(late) > 1 and any(late.values()) else None
        stragglers.append({"step": step, "collectives": len(by_step[step]), "lateness_ns": dict(sorted(late.items())),
                           "last_count": dict(sorted(lasts.items())), "straggler": straggler})
    unmatched = {r: sum(1 for c in colls if len(by_key[c["key"]]) < 2) for r, colls in per_rank.items()}
    divergent = _divergent(matched, {f"{g}" if w == "gpu" else f"{g} ({w})": n for (g, w), n in counts.items()})
    missing = sorted(_expected_ranks(session, run_id) - set(traces))
    out = {"ranks": traces, "reference_rank": ref, "offsets": offsets, "collectives": collectives,
           "suspect": sum(1 for c in collectives if c["suspect"]),
           "stragglers": stragglers, "unmatched": unmatched, "step_times": steps,
           "divergent": divergent, "missing_ranks": missing,
           "verdict": "INCOMPLETE" if missing else "DIVERGED" if divergent else "OK"}
    from graphdeck.analysis.ranks.cpu_collectives import rank_timing

    timing = rank_timing(out)
    notes = []
    if divergent:
        notes.append("diverged: " + "; ".join(_divergent_text(d) for d in divergent[:5])
                     + (f"; and {len(divergent) - 5} more ranks" if len(divergent) > 5 else ""))
    if missing:
        notes.append(f"INCOMPLETE: rank(s) {rank_spans(missing)} of the run have no usable trace: their collectives, "
                     f"lateness and waits are unknown (any of them may be the straggler)")
    timing["divergent"], timing["missing_ranks"], timing["verdict"] = divergent, missing, out["verdict"]
    if notes:
        # ``parts``: the same sentences one by one (check-ranks prints each as its own note line)
        timing["parts"] = ([timing["message"]] if timing.get("message") else []) + notes
        timing["message"] = "; ".join(timing["parts"])
    out["timing"] = timing
    return out
