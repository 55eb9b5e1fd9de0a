"""CPU-side collectives in Kineto traces (gloo and other CPU backends), and who waited for whom.

# NOTE: [CPU-side collectives]
A gloo process group runs each collective on one of its worker threads; the profiler shows it
as a range named after the backend and the collective (``gloo:all_reduce``, ``gloo:broadcast``,
``gloo:all_gather``... category ``user_annotation`` in torch 2.13, the same names the Flight
Recorder writes as ``profiling_name``). The range starts when the worker takes the collective up
and ends when the data is back, so on a rank that arrives early it holds the time spent
waiting for its peers: exactly what a GPU's NCCL kernel holds. These ranges are the CPU-side
collectives, read by :func:`cpu_collectives` in start order. Where a trace has none of them and
no communication kernels either (another CPU backend, an older profiler), the issuing calls
stand in: ``record_param_comms`` (its ``args["Collective name"]``) or, else, the dispatcher ops
``c10d::allreduce_``, ``c10d::broadcast_``... (these only enqueue, so they carry no wait time).

Process group: ``args["Process Group Name"]`` when the event has it; else the trace's only
process group (``distributedInfo.pg_config``) when it has exactly one; else ``"?"`` and the kind
joins the matching key, as for kernels (NOTE: [Rank clock alignment]). A CPU collective's key
carries ``"cpu"`` too, so a trace holding NCCL kernels and gloo ops of one group name never
matches the one against the other.

:func:`rank_timing` then reads :func:`graphdeck.analysis.traces.collectives.align_and_match`
(kernels and CPU collectives alike) per rank: time inside collectives, how much of it was
waiting for a later rank, the rest of each profiled step (compute), and names the straggler.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter

from sqlalchemy.orm import Session

from graphdeck.analysis.traces.data import CPU_OP_CATS, Ev, intersect_ns, total_ns, union_ns

#: Backends whose collectives run as profiler ranges named ``<backend>:<collective>``.
CPU_BACKENDS = ("gloo", "mpi", "ucc")
_BACKEND_OP = re.compile(r"^(?P<backend>" + "|".join(CPU_BACKENDS) + r"):(?P<kind>[a-z][a-z0-9_]*)$")
_DISPATCH_OP = re.compile(r"^c10d::(?P<kind>[a-z_]+?)_?$")
_NOT_COLLECTIVE = {"wait", "monitored_barrier", "_allgather_base_coalesced"}
_KIND_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all",
                 "alltoall_base": "all_to_all_single", "_allgather_base": "all_gather_into_tensor",
                 "_reduce_scatter_base": "reduce_scatter_tensor", "allreduce_coalesced": "all_reduce_coalesced",
                 "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced", "recv_any_source": "recv"}
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def normalise_kind(name: str) -> str:
    """``all_reduce`` for ``allreduce``/``allreduce_``/``all_reduce``; other names lower-cased.

    >>> [normalise_kind(k) for k in ("allreduce_", "all_reduce", "_allgather_base", "broadcast_")]
    ['all_reduce', 'all_reduce', 'all_gather_into_tensor', 'broadcast']
    """
    k = name.strip().lower()
    k = k[:-1] if k.endswith("_") else k
    return _KIND_ALIASES.get(k, k)


def cpu_collective_kind(ev: Ev) -> tuple[str, str] | None:
    """``(source, kind)`` of a CPU-side collective event, else None. ``source`` is the backend
    (``gloo``...), ``record_param_comms`` or ``c10d`` (a dispatcher op)."""
    m = _BACKEND_OP.match(ev.name)
    if m:
        return m.group("backend"), normalise_kind(m.group("kind"))
    if ev.cat not in CPU_OP_CATS:
        return None
    if ev.name == "record_param_comms":
        name = ev.args_dict().get("Collective name")
        return ("record_param_comms", normalise_kind(name)) if isinstance(name, str) and name else None
    m = _DISPATCH_OP.match(ev.name)
    if m and m.group("kind") not in _NOT_COLLECTIVE:
        return "c10d", normalise_kind(m.group("kind"))
    return None


def trace_groups(session: Session, trace_id: int) -> list[dict]:
    """The process groups of a stored trace (``distributedInfo``, read by
    :func:`graphdeck.analysis.traces.collectives.process_groups`); empty when it has none."""
    from graphdeck.analysis.traces.collectives import process_groups
    from graphdeck.store.schema import Trace

    trace = session.get(Trace, trace_id)
    try:
        meta = json.loads(trace.meta_json) if trace is not None and trace.meta_json else {}
    except ValueError:
        meta = {}
    return process_groups(meta)["groups"]


def cpu_collective_events(events: list[Ev], has_comm_kernels: bool = False) -> list[tuple[Ev, str, str]]:
    """``(event, source, kind)`` of the CPU-side collectives among ``events`` (NOTE: [CPU-side
    collectives]): the backend ranges when there are any; else, where the trace has no
    communication kernels (``has_comm_kernels``), ``record_param_comms`` or the ``c10d::`` ops."""
    found: dict[str, list[tuple[Ev, str, str]]] = {"backend": [], "record_param_comms": [], "c10d": []}
    for e in events:
        got = cpu_collective_kind(e)
        if got is not None:
            source, kind = got
            found[source if source in ("record_param_comms", "c10d") else "backend"].append((e, source, kind))
    if found["backend"] or has_comm_kernels:
        return found["backend"]
    return found["record_param_comms"] or found["c10d"]


def cpu_collectives(data, has_comm_kernels: bool = False) -> list[dict]:
    """The CPU-side collectives of one trace (``data``: a
    :class:`~graphdeck.analysis.traces.analyze.TraceData`) as
    :func:`~graphdeck.analysis.traces.collectives.rank_collectives` entries (``key``, ``group``,
    ``kind``, ``seq``, ``start_ns``, ``end_ns``, ``dur_ns``, ``kernel`` = the op's name,
    ``step``) plus ``where = "cpu"``, in start order."""
    from graphdeck.analysis.traces.bandwidth import message_bytes

    picked = cpu_collective_events(data.events, has_comm_kernels)
    if not picked:
        return []
    groups = trace_groups(data._session, data.trace_id)
    only = groups[0]["name"] if len(groups) == 1 and groups[0]["name"] is not None else None
    steps = [(s.ts, s.end, int(_STEP.match(s.name).group(1))) for s in data.steps()]
    seq: Counter = Counter()
    out = []
    for e, _source, kind in sorted(picked, key=lambda p: (p[0].ts, p[0].id)):
        args = e.args_dict() if e.args else {}
        name = args.get("Process Group Name")
        dims = args.get("Input Dims")  # the first input's element count: told apart by traces/collectives.py
        first = dims[0] if isinstance(dims, list) and dims and isinstance(dims[0], list) else None
        nelems = math.prod(first) if first and all(isinstance(d, int) for d in first) else None
        group = str(name) if name is not None else (only or "?")
        ident = (group, "cpu") if group != "?" else (group, "cpu", kind)
        n = seq[ident]
        seq[ident] += 1
        step = next((num for s, t, num in steps if s <= e.ts < t), None)
        out.append({"key": (*ident, n), "group": group, "kind": kind, "seq": n, "start_ns": e.ts, "end_ns": e.end,
                    "dur_ns": e.dur, "kernel": e.name, "step": step, "where": "cpu", "nelems": nelems,
                    "bytes": message_bytes(args)})
    return out


def cpu_overlap(data) -> dict | None:
    """Communication/computation overlap on the CPU, per step and for the whole trace, as
    :func:`graphdeck.analysis.traces.analyze.overlap` gives it for kernels: ``comm_busy_ns`` =
    union of the CPU-side collectives' ranges (worker threads), ``compute_busy_ns`` = union of
    the operators (``cpu_op``) on other threads that are not collective calls, ``overlap_ns`` their
    intersection and ``ratio`` = overlap / comm (None without collectives). None when the
    trace has no CPU-side collective. Times in ns."""
    picked = cpu_collective_events(data.events)
    if not picked:
        return None
    comm_ids = {e.id for e, _s, _k in picked}
    comm_threads = {(e.pid, e.tid) for e, source, _k in picked if source in CPU_BACKENDS}
    compute = [e for e in data.events if e.cat in CPU_OP_CATS and e.id not in comm_ids
               and (e.pid, e.tid) not in comm_threads and cpu_collective_kind(e) is None]

    def one(t0: int | None, t1: int | None) -> dict:
        def inside(e: Ev) -> bool:
            return t0 is None or t0 <= e.ts < t1
        comm = [e for e, _s, _k in picked if inside(e)]
        cu = union_ns((e.ts, e.end) for e in comm)
        pu = union_ns((e.ts, e.end) for e in compute if inside(e))
        comm_ns, both = total_ns(cu), intersect_ns(cu, pu)
        return {"comm_ops": len(comm), "comm_busy_ns": comm_ns, "compute_busy_ns": total_ns(pu), "overlap_ns": both,
                "ratio": both / comm_ns if comm_ns else None}

    return {"trace": one(None, None),
            "steps": [{"step": int(_STEP.match(s.name).group(1)), **one(s.ts, s.end)} for s in data.steps()]}


def _t(ns: int) -> str:
    """``"385.8 ms"``, ``"25.0 µs"``, seconds from 1 s up (NOTE: [Human durations])."""
    from graphdeck.analysis.units import ns_text

    return ns_text(ns, 1)


def rank_timing(matched: dict, min_wait_fraction: float = 0.2) -> dict:
    """Per rank, from :func:`~graphdeck.analysis.traces.collectives.align_and_match`'s result
    ``matched``: ``collectives`` (matched, not suspect), ``in_collectives_ns`` (summed
    durations), ``wait_ns`` (of that, waiting for a later rank), ``transfer_ns``, ``late_ns``
    (summed arrival − first arrival), ``last_count`` (collectives it arrived last at),
    ``step_ns`` (summed profiled step time, None without step ranges) and ``compute_ns`` = step −
    time in collectives. ``straggler``: the rank with the largest lateness, when the others' wait
    for it is at least ``min_wait_fraction`` of their time in collectives; ``message`` says so in
    words, with the numbers (ms, s from 1 s). All times in ns. Raises ValueError for a result without
    ``collectives``."""
    if not isinstance(matched, dict) or "collectives" not in matched:
        raise ValueError("rank_timing needs the result of align_and_match (a dict with 'collectives')")
    per: dict[int, dict] = {}
    ops: dict[int, Counter] = {}
    waits: dict[int, Counter] = {}
    for c in matched["collectives"]:
        if c.get("suspect"):
            continue
        first = min(v["arrive_ns"] for v in c["ranks"].values())
        for r, v in c["ranks"].items():
            p = per.setdefault(r, {"collectives": 0, "in_collectives_ns": 0, "wait_ns": 0, "transfer_ns": 0,
                                   "late_ns": 0, "last_count": 0})
            p["collectives"] += 1
            p["in_collectives_ns"] += v["wait_ns"] + v["transfer_ns"]
            p["wait_ns"] += v["wait_ns"]
            p["transfer_ns"] += v["transfer_ns"]
            p["late_ns"] += v["arrive_ns"] - first
            ops.setdefault(r, Counter())[v.get("kernel") or c["kind"]] += 1
            waits.setdefault(r, Counter())[v.get("kernel") or c["kind"]] += v["wait_ns"]
        per[c["last_rank"]]["last_count"] += 1
    for r, p in per.items():
        steps = [s["cpu_dur_ns"] for s in (matched.get("step_times") or {}).get(r, []) if s.get("cpu_dur_ns")]
        p["step_ns"] = sum(steps) if steps else None
        p["steps"] = len(steps)
        p["compute_ns"] = p["step_ns"] - p["in_collectives_ns"] if steps else None
        p["ops"] = dict(ops.get(r, {}))
        p["wait_by_op_ns"] = dict(waits.get(r, {}))
    out = {"ranks": dict(sorted(per.items())), "straggler": None, "message": None}
    if len(per) < 2:
        return out
    straggler = max(sorted(per), key=lambda r: per[r]["late_ns"])
    others = [r for r in per if r != straggler]
    waited = sum(per[r]["wait_ns"] for r in others)
    inside = sum(per[r]["in_collectives_ns"] for r in others)
    if per[straggler]["late_ns"] <= 0 or not inside or waited < min_wait_fraction * inside:
        return out
    out["straggler"] = straggler
    s = per[straggler]
    parts = []
    shown = others if len(others) <= 8 else sorted(others, key=lambda r: (-per[r]["wait_ns"], r))[:3]
    if len(shown) < len(others):  # a 1,024-rank run: the most-waiting ranks, and the rest summed
        parts.append(f"{len(others)} ranks waited {_t(waited)} for it in all (of {_t(inside)} in collectives)")
    for r in shown:
        p = per[r]
        by_op = sorted(p["wait_by_op_ns"].items(), key=lambda kv: (-kv[1], kv[0]))
        op = ", ".join(f"{_t(w)} inside {name} ({p['ops'][name]}x)" for name, w in by_op if w)
        share = f" ({p['wait_ns'] / p['step_ns']:.0%} of its {p['steps']} profiled steps)" if p["step_ns"] else ""
        parts.append(f"rank {r} waited {_t(p['wait_ns'])} for it{share}: {op}; {_t(p['transfer_ns'])} moving data")
    out["message"] = (f"straggler: rank {straggler} arrived last at {s['last_count']} of {s['collectives']} matched "
                      f"collectives, {_t(s['late_ns'])} late in total; " + "; ".join(parts))
    return out
