"""Measured memory (a CUDA memory snapshot) beside the graph-derived models, for the memory page.

# NOTE: [Measured beside derived]
At ``graphdeck import`` (NOTE: [Snapshot import]) the replayed snapshot also gives
:func:`record_extras`: the allocated-bytes curve over the recorded history (``t_us`` since the
first event, ``bytes`` allocated then, the bytes allocated before the history included;
downsampled to at most ``MAX_POINTS`` points by keeping each bucket's lowest and highest point,
so the peak survives) and the bytes live at the peak per module path. A place in Inductor code
(``("graph", post-grad graph id, source nodes)``, NOTE: [Memory snapshot format]) gets the module
path of its last source node that has one (the comment lists a fused kernel's nodes in
topological order: the last is the op whose value the kernel writes; a common prefix would put
a softmax that also recomputes the shared causal mask on the whole stack of blocks), the node
names looked up in the
graphs of the same compile that hold most of them (the Dynamo graph for a forward's comments,
the AOT backward for a backward's), with the fall-backs of the step model (a backward node takes
its forward op's path, a node without one its first input's). Other places are ``(optimizer)``,
``(autograd)``, ``(eager)``; nodes without a path ``(no module)``.

:func:`compare` answers the page: the snapshot's peak, the graph-derived step peak of the page's
forward/backward pair (ATen graphs, :func:`graphdeck.analysis.memory.core.step_memory`) and the
Inductor buffer model's step peak (NOTE: [Inductor buffer model]) when the run has output code.
The graphs hold the parameters but not what the job held outside them (optimizer state, eager
buffers): each derived peak is compared as ``peak + max(before_history − parameters, 0)``, the
bytes allocated before the history less the parameters the model already counts. Per module it
compares bytes live at each side's own peak, parameters left out (the snapshot sees them only in
``before_history``). Without a snapshot record the answer says so (``status: "incomplete"``).
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory.measured import MeasuredMemory

#: Most points a stored curve keeps.
MAX_POINTS = 2000
RECORD = "graphdeck_memory_snapshot"  # same name as snapshots.RECORD (no import cycle)
NO_SNAPSHOT = ("no snapshot: measured curve unavailable — import a CUDA memory snapshot of this run "
               "(torch.cuda.memory._dump_snapshot) with `graphdeck import SNAPSHOT.pickle --run RUN`")


def downsample(t: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` of the points ``(t, y)`` (1-D, same length), in order: each of
    ``max_points // 2`` equal-count buckets keeps its lowest and its highest point, so the global
    maximum (and minimum) stays. Unchanged when short enough."""
    n = len(y)
    if n <= max_points:
        return t, y
    buckets = max(max_points // 2, 1)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    keep = []
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            continue
        seg = y[a:b]
        keep.extend(sorted({a + int(np.argmin(seg)), a + int(np.argmax(seg))}))
    idx = np.asarray(keep, dtype=np.int64)
    return t[idx], y[idx]


def snapshot_curve(snapshot: dict, device: int, baseline_bytes: int, max_points: int = MAX_POINTS) -> dict:
    """The allocated-bytes curve of ``snapshot``'s history on ``device`` (NOTE: [Memory snapshot
    format]: ``alloc`` adds, ``free_completed`` subtracts block bytes): ``{"t_us": [int µs since
    the first event], "bytes": [int, allocated, baseline included], "events": int (points before
    downsampling), "points": int}``, one point per alloc/free."""
    events = (snapshot.get("device_traces") or [[]])[device] if device < len(snapshot.get("device_traces") or []) else []
    t, y, net, t0 = [], [], 0, None
    for e in events:
        act = e.get("action")
        if act not in ("alloc", "free_completed"):
            continue
        net += int(e.get("size") or 0) * (1 if act == "alloc" else -1)
        ts = int(e.get("time_us") or 0)
        t0 = ts if t0 is None else t0
        t.append(ts - t0)
        y.append(baseline_bytes + net)
    ta, ya = downsample(np.asarray(t, dtype=np.int64), np.asarray(y, dtype=np.int64), max_points)
    return {"t_us": ta.tolist(), "bytes": ya.tolist(), "events": len(y), "points": len(ya)}


def _graph_modules(session: Session, graph_id: int) -> dict[str, str | None]:
    """Node name → resolved module path of one stored graph (the step model's fall-backs)."""
    from graphdeck.analysis.memory.core import _graph, _load
    from graphdeck.analysis.memory.step import _module_ids

    g = _graph(session, graph_id)
    c = _load(session, graph_id)
    return dict(zip(c.names, c.module_paths(_module_ids(session, g, c))))


def modules_at_peak(session: Session, m: MeasuredMemory) -> dict[str, int]:
    """Bytes live at the measured peak per module path (NOTE: [Measured beside derived]); the
    bytes allocated before the history are left out. Largest first."""
    from graphdeck.store.schema import Graph

    by_gid: dict[int, list[tuple[int, tuple[str, ...]]]] = defaultdict(list)
    out: dict[str, int] = defaultdict(int)
    for size, where in m.at_peak:
        if where[0] == "graph" and where[1] is not None and where[2]:
            by_gid[int(where[1])].append((size, where[2]))
        else:
            out["(no module)" if where[0] == "graph" else f"({where[0]})"] += size
    for gid, places in by_gid.items():
        g = session.get(Graph, gid)
        cands = [] if g is None else session.scalars(select(Graph.id).where(
            Graph.run_id == g.run_id, Graph.rank == g.rank, Graph.compile_id == g.compile_id,
            Graph.kind.in_(("dynamo", "aot_forward", "aot_backward")))).all()
        wanted = {n for _, nodes in places for n in nodes}
        tables = [_graph_modules(session, c) for c in cands]
        tables.sort(key=lambda tb: -len(wanted & tb.keys()))  # the graphs that name most of them first
        for size, nodes in places:
            paths = []
            for n in nodes:
                hit = next((tb for tb in tables if n in tb), None)
                if hit is not None and hit[n]:
                    paths.append(hit[n])
            out[paths[-1] if paths else "(no module)"] += size
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def record_extras(engine, snapshot: dict, m: MeasuredMemory) -> dict:
    """What the ``graphdeck_memory_snapshot`` record keeps beside :func:`summary`'s fields:
    ``curve`` (:func:`snapshot_curve`) and ``by_module_at_peak`` (:func:`modules_at_peak`)."""
    with Session(engine) as s:
        mods = modules_at_peak(s, m)
    return {"curve": snapshot_curve(snapshot, m.device, m.baseline_bytes), "by_module_at_peak": mods}


def _gap(derived: int, measured: int) -> dict:
    return {"gap_bytes": derived - measured, "gap_pct": round((derived - measured) / measured * 100, 2) if measured else None}


def _depth(path: str, depth: int) -> str:
    return path if path.startswith("(") else "/".join(path.split("/")[:depth])


def compare(session: Session, graph_id: int, *, depth: int = 3, top: int = 15) -> dict:
    """The memory page's measured section for graph ``graph_id`` (its run and rank).

    Returns ``{"status": "ok" | "incomplete", "message", "snapshot": {record_id, file, rank,
    device, peak_bytes, baseline_bytes, allocations, attributed, by_category_bytes} | None,
    "curve": {t_us, bytes, events, points} | None, "peaks": [{"source": "measured" | "graph" |
    "inductor", "label", "peak_bytes", "held_outside_bytes", "compared_bytes", "gap_bytes",
    "gap_pct"}], "modules": [{"module", "measured_bytes", "derived_bytes", "gap_bytes"}] (top
    ``top`` by the larger side, paths cut to ``depth`` parts), "notes": [str]}``; bytes are ints.
    Gaps are derived − measured (NOTE: [Measured beside derived]); without a snapshot no gap is
    given.

    Raises:
        NotFoundError: no graph ``graph_id``."""
    from graphdeck.analysis.memory.core import _graph
    from graphdeck.analysis.memory.inductor import inductor_step_memory
    from graphdeck.analysis.memory.step import forward_backward_pair, step_memory
    from graphdeck.errors import NotFoundError
    from graphdeck.store.schema import CompileEvent, Graph

    g = _graph(session, graph_id)
    notes: list[str] = []
    row = session.execute(select(CompileEvent.id, CompileEvent.payload).where(
        CompileEvent.run_id == g.run_id, CompileEvent.rank == g.rank, CompileEvent.name == RECORD)
        .order_by(CompileEvent.id.desc()).limit(1)).first()
    snap = None
    if row is not None:
        try:
            snap = json.loads(row.payload or "")
        except ValueError:
            notes.append(f"snapshot record {row.id} holds no readable summary: import the snapshot again")
    if snap is None and row is None:
        other = session.scalars(select(CompileEvent.rank).where(
            CompileEvent.run_id == g.run_id, CompileEvent.name == RECORD).distinct()).all()
        if other:
            notes.append(f"snapshots of this run are for rank(s) {sorted(other)}, not rank {g.rank}")
    measured = int(snap["peak_bytes"]) if snap else None
    baseline = int(snap.get("baseline_bytes") or 0) if snap else 0
    peaks: list[dict] = []
    if snap:
        peaks.append({"source": "measured", "label": f"measured (snapshot {snap.get('file')})", "peak_bytes": measured,
                      "held_outside_bytes": None, "compared_bytes": measured, "gap_bytes": 0, "gap_pct": 0.0})

    def derived(source: str, label: str, peak: int, params: int) -> None:
        held = max(baseline - params, 0) if snap else None
        d = {"source": source, "label": label, "peak_bytes": peak, "held_outside_bytes": held,
             "compared_bytes": peak + held if snap else None, "gap_bytes": None, "gap_pct": None}
        if snap:
            d.update(_gap(peak + held, measured))
        peaks.append(d)

    curve = None
    try:
        fw, bw = forward_backward_pair(session, graph_id)
        curve = step_memory(session, fw, bw)
        derived("graph", f"graph-derived step (ATen graphs {fw} + {bw})", curve.peak_bytes,
                int(curve.by_kind_at_peak.get("parameter", 0)))
        pairs = session.scalars(select(Graph.compile_id).where(
            Graph.run_id == g.run_id, Graph.rank == g.rank, Graph.kind == "aot_forward").distinct()).all()
        if len(pairs) > 1:
            notes.append(f"this rank ran {len(pairs)} compiled forward/backward pairs: the graph-derived step is this "
                         "page's pair alone; the measured and Inductor figures cover the whole step")
    except NotFoundError as exc:
        notes.append(f"graph-derived step unavailable: {exc}")
    model = inductor_step_memory(session.connection(), g.run_id, g.rank)  # same transaction: no second writer
    if model is not None:
        derived("inductor", f"Inductor buffer model (output code of {len(model.calls)} calls)", model.peak_bytes,
                model.parameter_bytes)
    else:
        notes.append("no Inductor output code in this run: no Inductor buffer model")
    modules: list[dict] = []
    if snap and curve is not None and "by_module_at_peak" in snap:
        meas: dict[str, int] = defaultdict(int)
        for k, v in snap["by_module_at_peak"].items():
            meas[_depth(k, depth)] += int(v)
        der: dict[str, int] = defaultdict(int)
        for h in curve.holders:
            b = h.size_bytes - int(h.by_kind.get("parameter", 0))
            if b:
                der[_depth(h.module_path, depth)] += b
        keys = sorted(set(meas) | set(der), key=lambda k: -max(meas.get(k, 0), der.get(k, 0)))[:top]
        modules = [{"module": k, "measured_bytes": meas.get(k, 0), "derived_bytes": der.get(k, 0),
                    "gap_bytes": der.get(k, 0) - meas.get(k, 0)} for k in keys]
    elif snap:
        notes.append("per module: " + ("no graph-derived step to compare" if curve is None else
                                       "the snapshot record predates per-module bytes: import the snapshot again"))
    if snap and not snap.get("curve"):
        notes.append("the snapshot record predates stored curves: import the snapshot again for the curve")
    info = None if not snap else {"record_id": row.id, "file": snap.get("file"), "rank": g.rank,
                                  "device": snap.get("device"), "peak_bytes": measured, "baseline_bytes": baseline,
                                  "allocations": snap.get("allocations"), "attributed": snap.get("attributed"),
                                  "by_category_bytes": snap.get("by_category_bytes") or {}}
    return {"status": "ok" if snap else "incomplete", "message": None if snap else NO_SNAPSHOT,
            "snapshot": info, "curve": (snap or {}).get("curve"), "peaks": peaks, "modules": modules,
            "depth": depth, "notes": notes}
