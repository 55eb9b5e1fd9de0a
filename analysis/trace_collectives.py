"""Collectives across ranks: matching, clock alignment, who arrived last, stragglers.

# NOTE: [Rank clock alignment]
Each rank's trace has its own clock. Stage 1 (base time): Kineto writes ``ts`` relative to
``baseTimeNanoseconds`` (or as absolute µs since the epoch in older traces), and the ingest
stores absolute ns, so ranks start on a common (host wall-clock) axis, off by the hosts' clock
skew. Stage 2 (refine): a collective ends at (nearly) the same instant on every rank that
takes part — no rank's kernel finishes before the last one's data has arrived — so the offset of
rank r against the reference rank (the lowest) is the median over matched collectives of
``end_r - end_ref``. Aligned times are ``ts - offset``. With no matched collective the offset
stays 0 and ``method`` says ``base_time``.

Matching: a communication kernel (per :class:`~graphdeck.analysis.trace_analysis.CommRule`)
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

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.trace_analysis import CommRule, TraceData, step_times
from graphdeck.errors import NotFoundError
from graphdeck.store.schema import Run, Trace

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
    steps = [(s.ts, s.end, int(_STEP.match(s.name).group(1))) for s in data.steps()]
    seq: Counter = Counter()
    out = []
    for k in sorted((k for k in data.kernels if rule.is_comm(k.name)), key=lambda e: (e.ts, e.id)):
        args = k.args_dict()
        group = args.get("Process Group Name")
        group = str(group) if group is not None else "?"
        kind = _kind(k.name, args)
        ident = (group,) if group != "?" else (group, kind)
        n = seq[ident]
        seq[ident] += 1
        launch = data.launch_ts(k)
        step = next((num for s, e, num in steps if s <= launch < e), None)
        out.append({"key": (*ident, n), "group": group, "kind": kind, "seq": n, "start_ns": k.ts, "end_ns": k.end,
                    "dur_ns": k.dur, "kernel": k.name, "step": step})
    from graphdeck.analysis.cpu_collectives import cpu_collectives  # NOTE: [CPU-side collectives]

    cpu = cpu_collectives(data, has_comm_kernels=bool(out))
    return sorted(out + cpu, key=lambda c: (c["start_ns"], c["key"])) if cpu else out


def run_traces(session: Session, run_id: int) -> dict[int, int]:
    """rank → the newest usable (``ok`` / ``truncated``) trace id of run ``run_id``."""
    rows = session.execute(select(Trace.rank, Trace.id).where(
        Trace.run_id == run_id, Trace.status.in_(("ok", "truncated"))).order_by(Trace.id)).all()
    return {rank: tid for rank, tid in rows}


def align_and_match(session: Session, run_id: int, rule: CommRule | None = None,
                    traces: dict[int, int] | None = None) -> dict:
    """Match collectives across the ranks of run ``run_id``, estimate clock offsets and find
    stragglers.

    Returns ``{"ranks": {rank: trace_id}, "offsets": {rank: {"offset_ns", "method",
    "matched"}}, "collectives": [...], "stragglers": [...], "unmatched": {rank: n},
    "step_times": {rank: [...]}}`` (step times per rank:
    :func:`~graphdeck.analysis.trace_analysis.step_times`, times on each rank's own clock).
    ``collectives`` entries: ``group``, ``kind``, ``seq``, ``step``, ``ranks`` (rank →
    ``arrive_ns``, ``end_ns``, ``wait_ns``, ``transfer_ns``), ``last_rank``, ``spread_ns``
    (last − first arrival), ``suspect`` (None, or why the match cannot be one collective: a rank
    ended before the last one arrived; such matches are listed but not used for stragglers). ``stragglers``: per step, each rank's summed lateness
    (arrival − first arrival) and how often it arrived last; ``straggler`` is the rank with the
    largest lateness (None with one rank). ``timing``: per rank, time in collectives, waiting,
    moving data and computing, and the straggler in words
    (:func:`graphdeck.analysis.cpu_collectives.rank_timing`). Raises NotFoundError for an unknown run.
    """
    if session.get(Run, run_id) is None:
        raise NotFoundError(f"run {run_id} not found", resource="run", id=run_id)
    traces = traces or run_traces(session, run_id)
    datas = {r: TraceData(session, tid) for r, tid in sorted(traces.items())}
    per_rank = {r: rank_collectives(d, rule) for r, d in datas.items()}
    steps = {r: step_times(d) for r, d in datas.items()}
    by_key: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r, colls in per_rank.items():
        for c in colls:
            by_key[c["key"]][r] = c
    matched = {k: v for k, v in by_key.items() if len(v) > 1}
    ranks = sorted(per_rank)
    ref = ranks[0] if ranks else None
    offsets: dict[int, dict] = {}
    for r in ranks:
        diffs = [v[r]["end_ns"] - v[ref]["end_ns"] for v in matched.values() if r in v and ref in v]
        if r == ref or not diffs:
            offsets[r] = {"offset_ns": 0, "method": "reference" if r == ref else "base_time", "matched": len(diffs)}
        else:
            offsets[r] = {"offset_ns": int(statistics.median(diffs)), "method": "collective_end_median",
                          "matched": len(diffs)}
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
        suspect = None
        if last > ends[first_end]:
            suspect = (f"rank {first_end} ended {(last - ends[first_end]) / 1e3:.1f} us before rank {last_rank} "
                       f"arrived: not one collective, or clocks off by more than the estimated offset")
        collectives.append({
            "suspect": suspect,
            "group": any_c["group"], "kind": any_c["kind"], "seq": any_c["seq"],
            "step": next((c["step"] for c in parts.values() if c["step"] is not None), None),
            "last_rank": last_rank, "spread_ns": last - min(arrive.values()),
            "ranks": {r: {"arrive_ns": arrive[r], "end_ns": c["end_ns"] - offsets[r]["offset_ns"],
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
    out = {"ranks": traces, "reference_rank": ref, "offsets": offsets, "collectives": collectives,
           "suspect": sum(1 for c in collectives if c["suspect"]),
           "stragglers": stragglers, "unmatched": unmatched, "step_times": steps}
    from graphdeck.analysis.cpu_collectives import rank_timing

    out["timing"] = rank_timing(out)
    return out
