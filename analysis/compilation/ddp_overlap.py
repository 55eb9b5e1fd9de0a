"""Compiled DDP whose gradient all-reduces cannot overlap the backward (issue 35 item 4), read from
the graphs; its cost measured from the rank's trace where one exists.

# NOTE: [DDP overlap by construction]
DDP all-reduces a gradient bucket once the autograd hooks of all its parameters have fired. A
compiled backward graph hands every gradient it computes to autograd at once, when the whole
graph has run: a bucket whose gradients come from that graph cannot start its all-reduce before
the graph ends. DDPOptimizer (``torch._dynamo.config.optimize_ddp``, on by default) therefore
splits a compiled DDP module's graph at bucket boundaries — one forward/backward graph per
bucket — so bucket k's all-reduce runs while the backward of the buckets before it computes.
Without that split (``optimize_ddp=False``, or DDPOptimizer not compiling the frame) one
backward graph feeds several buckets and their communication overlaps none of its compute.

Evidence, per rank, all recorded by the capture:

* DDP's reducer buckets — the newest ``graphdeck_comm_groups`` record
  (:func:`graphdeck.analysis.traces.comm_map.load_record`): which parameters each bucket holds;
* each ``aot_backward`` graph and the parameters whose gradient it returns (``graph_io``
  ``grad`` rows with a gradient);
* how the graph it belongs to was compiled (its ``meta_json``): ``ddp`` = compiled by
  DDPOptimizer (a ``ddp_partition`` graph, or a frame it kept whole because its own estimate
  found one bucket's worth of parameters: not reported, DDPOptimizer's bucketing is the
  overlap DDP gets), ``optimize_ddp`` = Dynamo's mode while a DDP forward was compiled
  (``no_optimization`` for ``False``; ``python_reducer*`` traces the reducer into the backward
  under compiled autograd, which overlaps by itself: not reported; ``ddp_optimizer`` on a graph
  not marked as DDPOptimizer's means the capture did not see DDPOptimizer on the stack — a torch
  it does not know — not that the split is missing: not reported either).

A backward graph that DDPOptimizer did not compile and whose gradients fill two or more reducer
buckets is a finding (:class:`NoOverlap`). A run without a bucket record (not DDP, an older
capture, a TORCH_TRACE import) gives none: a performance note claims nothing without its
evidence. It is a WARN of ``check-compile`` (and so of the run overview's ``compile`` line),
never a FAIL: the job computes the right thing, only slower.

Measured: on the lowest finding rank with a usable trace, the communication/computation overlap
of :func:`graphdeck.analysis.traces.analyze.overlap` — GPU communication kernels when the
trace has any, else the CPU-side collectives (gloo) — as the share of communication time that
overlapped compute, and the communication time left exposed per profiled step (ns).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.units import ns_text
from graphdeck.store.schema import CompileEvent, Graph, GraphIO, Run

#: Dynamo's ``optimize_ddp`` modes under which the capture's graphs are not DDPOptimizer's, and
#: what the user set to get them.
MODE_WORDS = {"no_optimization": "torch._dynamo.config.optimize_ddp=False"}


@dataclass
class NoOverlap:
    """One compiled frame whose backward feeds several DDP buckets at once, on ``ranks``.

    ``graph``: the Dynamo graph's name (``graph 4/0``); ``compile_id``; ``frame``: its frame
    (``forward (model.py:12)``) or None; ``graph_ids``: rank → the ``aot_backward`` graph's id;
    ``buckets``: how many reducer buckets its gradients fill, of ``total_buckets``;
    ``params``: parameters whose gradient it returns; ``mode``: Dynamo's ``optimize_ddp`` mode
    recorded at compile time (None: not recorded); ``cause`` / ``fix``: in words; ``measured``:
    ``{"rank", "trace_id", "where": "gpu"|"cpu", "ratio", "comm_busy_ns", "overlap_ns",
    "exposed_ns_per_step", "steps"}`` or ``{"rank", "trace_id", "error"}``, None without a trace;
    ``message``: the one sentence every surface shows."""

    graph: str
    compile_id: str | None
    frame: str | None
    ranks: list[int]
    graph_ids: dict[int, int]
    buckets: int
    total_buckets: int
    params: int
    mode: str | None
    cause: str
    fix: str
    measured: dict | None = None
    message: str = ""
    trace_link: str | None = field(default=None)


def _meta(text: str | None) -> dict:
    try:
        m = json.loads(text or "{}")
    except ValueError:
        return {}
    return m if isinstance(m, dict) else {}


def _buckets(session: Session, run_id: int, rank: int) -> dict[str, int]:
    """fqn → a bucket number unique on the rank (several DDP wrappers numbered one after the other)."""
    from graphdeck.analysis.traces.comm_map import load_record

    out: dict[str, int] = {}
    n = 0
    for ddp in (load_record(session, run_id, rank) or {}).get("ddp") or []:
        for b in ddp.get("buckets") or []:
            for fqn in b.get("params") or []:
                out.setdefault(str(fqn), n)
            n += 1
    return out


def _cause(mode: str | None) -> tuple[str, str]:
    if mode in MODE_WORDS:
        return (f"{MODE_WORDS[mode]}: Dynamo compiled the DDP module as one graph",
                "leave torch._dynamo.config.optimize_ddp on (the default: DDPOptimizer compiles one graph per bucket)")
    return ("the graph was not split by DDPOptimizer (optimize_ddp off, or the frame compiled outside it; the "
            "mode was not recorded)", "leave torch._dynamo.config.optimize_ddp on and compile the DDP-wrapped module")


def find(session: Session, run: Run) -> list[NoOverlap]:
    """The run's backward graphs that feed two or more DDP buckets without DDPOptimizer's split
    (NOTE: [DDP overlap by construction]), merged across ranks by graph, with the cost measured
    on one rank's trace. Empty when there is none or no rank recorded its DDP buckets."""
    if session.execute(select(CompileEvent.id).where(CompileEvent.run_id == run.id,
                                                     CompileEvent.name == "graphdeck_comm_groups").limit(1)).first() is None:
        return []  # no rank recorded its DDP buckets: nothing to judge (NOTE: [DDP overlap by construction])
    graphs = {g.id: g for g in session.execute(select(
        Graph.id, Graph.rank, Graph.kind, Graph.parent_id, Graph.name, Graph.compile_id, Graph.frame_name,
        Graph.meta_json).where(Graph.run_id == run.id, Graph.kind.in_(("dynamo", "ddp_partition", "aot_backward"))))}
    backward = [g for g in graphs.values() if g.kind == "aot_backward" and g.parent_id in graphs]
    if not backward:
        return []
    grads: dict[int, list[str]] = defaultdict(list)
    for gid, fqn in session.execute(select(GraphIO.graph_id, GraphIO.param_fqn).join(Graph, Graph.id == GraphIO.graph_id).where(
            Graph.run_id == run.id, Graph.kind == "aot_backward", GraphIO.direction == "grad",
            GraphIO.has_grad.is_(True), GraphIO.param_fqn.is_not(None))):
        grads[gid].append(fqn)
    bucket_maps: dict[int, dict[str, int]] = {}
    merged: dict[tuple, NoOverlap] = {}
    for g in sorted(backward, key=lambda g: (g.rank, g.id)):
        src = graphs[g.parent_id]
        meta = _meta(src.meta_json)
        mode = meta.get("optimize_ddp")
        if src.kind == "ddp_partition" or meta.get("ddp") or (mode is not None and mode not in MODE_WORDS):
            continue  # DDPOptimizer's graphs; compiled autograd's reducer; DDPOptimizer on but unseen: no claim
        if g.rank not in bucket_maps:
            bucket_maps[g.rank] = _buckets(session, run.id, g.rank)
        where = bucket_maps[g.rank]
        hit = {where[f] for f in grads.get(g.id, []) if f in where}
        if len(hit) < 2:
            continue
        total = len(set(where.values()))
        key = (src.frame_name or src.name, len(hit), total, mode)  # a frame's recompiles: one finding
        f = merged.get(key)
        if f is None:
            cause, fix = _cause(mode)
            f = merged[key] = NoOverlap(graph=src.name, compile_id=src.compile_id, frame=src.frame_name, ranks=[],
                                        graph_ids={}, buckets=len(hit), total_buckets=total,
                                        params=len(set(grads[g.id])), mode=mode, cause=cause, fix=fix)
        if g.rank not in f.ranks:
            f.ranks.append(g.rank)
            f.graph_ids[g.rank] = g.id
    out = list(merged.values())
    if out:
        measured = _measure(session, run.id, sorted({r for f in out for r in f.ranks}))
        for f in out:
            f.measured = measured
            f.trace_link = f"#/traces/{measured['trace_id']}" if measured else None
            f.message = _message(f)
    return out


def _measure(session: Session, run_id: int, ranks: list[int]) -> dict | None:
    """The overlap on the lowest of ``ranks`` with a usable trace (NOTE: [DDP overlap by
    construction]); None when none has one."""
    from graphdeck.analysis.traces.analyze import TraceData, overlap
    from graphdeck.analysis.traces.collectives import run_traces

    traces = run_traces(session, run_id)
    rank = next((r for r in ranks if r in traces), None)
    if rank is None:
        return None
    tid = traces[rank]
    try:
        ov = overlap(TraceData(session, tid))
    except Exception as exc:  # noqa: BLE001 - an unreadable trace: the finding stands, unmeasured
        return {"rank": rank, "trace_id": tid, "error": f"{type(exc).__name__}: {exc}"}
    gpu = ov["trace"]
    where, part = ("gpu", gpu) if gpu.get("comm_kernels") else ("cpu", (ov.get("cpu") or {}).get("trace"))
    if not part or not part.get("comm_busy_ns"):
        return {"rank": rank, "trace_id": tid, "error": "the trace holds no gradient communication"}
    steps = len(ov["steps"]) or 1
    return {"rank": rank, "trace_id": tid, "where": where, "ratio": part["ratio"], "comm_busy_ns": part["comm_busy_ns"],
            "overlap_ns": part["overlap_ns"], "steps": len(ov["steps"]),
            "exposed_ns_per_step": (part["comm_busy_ns"] - part["overlap_ns"]) // steps}


def _message(f: NoOverlap) -> str:
    from graphdeck.analysis.ranks.records import _ranks_phrase

    which = (f"all {f.total_buckets} DDP buckets" if f.buckets == f.total_buckets
             else f"{f.buckets} of the {f.total_buckets} DDP buckets")
    text = (f"compiled DDP cannot overlap its gradient all-reduces with the backward ({_ranks_phrase(f.ranks)}): "
            f"one backward graph ({f.graph}{', ' + f.frame if f.frame else ''}) returns the gradients of {which} "
            f"({f.params} parameters) at once, so DDP starts their all-reduces only after the whole backward has "
            f"run; cause: {f.cause}")
    m = f.measured
    if m and "error" not in m:
        kind = "communication kernel" if m["where"] == "gpu" else "collective (CPU)"
        text += (f"; measured on rank {m['rank']} (trace {m['trace_id']}, {m['steps']} profiled step(s)): "
                 f"{m['ratio']:.1%} of {ns_text(m['comm_busy_ns'])} of {kind} time overlapped compute, "
                 f"{ns_text(m['exposed_ns_per_step'])} a step exposed")
    elif m:
        text += f"; not measured on rank {m['rank']} (trace {m['trace_id']}): {m['error']}"
    else:
        text += "; no trace to measure the cost (profile with Agent.profile)"
    return text + f". Fix: {f.fix}"
