"""Per-node overlays of a stored graph: a separate model keyed by FX node name (``../shared/STYLE.md``).

An :class:`Overlay` holds one value per node — output bytes, time from a trace, or a partition
(DDP bucket, FSDP2 group, collective's mesh dimension, pipeline stage, rank) — and says its unit and whether it is categorical. The graph view draws
numeric overlays as a heat colour and categorical ones by a hashed palette slot; Model Explorer
export writes them as node data. Nothing here draws.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.errors import NotFoundError, UsageError
from graphdeck.store.schema import Graph, Node, Partition

#: Overlay kinds :func:`graph_overlay` knows.
OVERLAY_KINDS = ("bytes", "time", "comm", "partition", "rank", "memory", "stage")


class Overlay(BaseModel):
    """Values keyed by node id (the FX node name); nodes without a value are absent.

    Example::

        >>> Overlay(kind="bytes", unit="bytes", values={"mm": 2048}).values["mm"]
        2048
    """

    kind: str = Field(description="one of " + ", ".join(OVERLAY_KINDS))
    unit: str = Field(default="", description="'bytes', 'ns', or '' for categorical values")
    categorical: bool = False
    values: dict[str, float | int | str] = Field(default_factory=dict)
    note: str | None = Field(default=None, description="why values are missing, when they are")
    label: str | None = Field(default=None, description="what the overlay says of the whole graph, e.g. "
                              "'pipeline stage 1 of 2 (ScheduleGPipe, 4 microbatches)'")
    aggregate: Literal["sum", "max"] = Field(
        default="sum", description="how a collapsed cluster combines its nodes' values: 'sum' for amounts each "
        "node adds (time, bytes produced), 'max' for a level each node reaches (live bytes)")


def graph_overlay(session: Session, graph_id: int, kind: str) -> Overlay:
    """The ``kind`` overlay of stored graph ``graph_id``.

    * ``bytes``: each node's output bytes (``nodes.size_bytes``; symbolic shapes have none).
    * ``time``: ns per node from ``graphdeck.analysis.traces.mapping.node_time_ns(session, graph_id)``
      when that module is installed and maps this graph's kernels; else empty with a note.
    * ``comm``: ns per node of the communication kernels (DDP all-reduce, FSDP2 all-gather /
      reduce-scatter) that carry the node's parameter or gradient (``node_time_ns(...,
      part="comm")``, NOTE: [Collectives to graph nodes]); ``time`` counts computation only.
    * ``partition``: the parallel part each node belongs to (NOTE: [Partition overlay] in
      ``analysis/parallel/partition.py``), first that applies: the mesh dimension of a collective
      (``"tp collective"``: DTensor's ``_c10d_functional`` ops, by their process group); the
      FSDP2 group whose parameters the node reads (``"fsdp blocks.0"``); the DDP bucket (for a
      graph DDPOptimizer split, each node's bucket by name in the bucket graphs; for a bucket's
      own graphs and their AOT graphs, that bucket); the pipeline stage boundary
      (``"stage 1 input"`` / ``"stage 1 output"``) and stage (``"stage 1"``), with ``label``
      naming the graph's stage.
    * ``rank``: the graph's rank, on every node (for comparing ranks side by side).
    * ``memory``: live bytes right after each node allocated its output, from the graph-derived
      liveness (:func:`graphdeck.analysis.memory.core.graph_memory`); a cluster shows its nodes'
      maximum (``aggregate="max"``: a running total summed over nodes means nothing).
    * ``stage``: the executor's pipeline stage of each node for 2 ``layerwise`` stages
      (:func:`graphdeck.replay.partition.plan_for_graph`; other K and strategies through
      ``GET /api/graphs/{id}/stages``).
    ``time`` falls back to the newest executor trace of the graph (its node ranges) when no
    kernel mapping covers it.

    Raises:
        NotFoundError: no graph ``graph_id``.
        UsageError: unknown ``kind``.
    """
    graph = session.get(Graph, graph_id)
    if graph is None:
        raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
    if kind not in OVERLAY_KINDS:
        raise UsageError(f"unknown overlay {kind!r}; one of {', '.join(OVERLAY_KINDS)}")
    names = list(session.scalars(select(Node.name).where(Node.graph_id == graph_id).order_by(Node.idx)))
    if kind == "bytes":
        rows = session.execute(select(Node.name, Node.size_bytes).where(Node.graph_id == graph_id)).all()
        return Overlay(kind=kind, unit="bytes", values={n: b for n, b in rows if b is not None})
    if kind == "rank":
        return Overlay(kind=kind, categorical=True, values=dict.fromkeys(names, f"rank {graph.rank}"))
    if kind == "partition":
        return _partition(session, graph, names)
    if kind == "stage":
        from graphdeck.replay.partition import plan_for_graph

        plan = plan_for_graph(session, graph_id, 2, "layerwise")
        return Overlay(kind=kind, categorical=True, values={n: f"stage {k}" for n, k in plan.assignment.items()},
                       note="2 layerwise stages (graphdeck replay --workers K --strategy S for others)")
    if kind == "memory":
        from graphdeck.analysis.memory.core import graph_memory

        curve = graph_memory(session, graph_id)
        return Overlay(kind=kind, unit="bytes", values=dict(zip(curve.nodes, curve.live_bytes)), aggregate="max",
                       note=f"peak {curve.peak_bytes} bytes at {curve.peak_node}")
    if kind == "comm":
        return _comm(session, graph_id)
    return _time(session, graph_id)


def _comm(session: Session, graph_id: int) -> Overlay:
    from graphdeck.analysis.traces.mapping import node_time_ns

    values = node_time_ns(session, graph_id, part="comm")
    return Overlay(kind="comm", unit="ns", values={k: float(v) for k, v in values.items()},
                   note=None if values else "no communication kernel of this rank's trace carries this graph's "
                   "parameters (the capture records DDP buckets and FSDP2 groups; see NOTE: [Collectives to graph nodes])")


def _partition(session: Session, graph: Graph, names: list[str]) -> Overlay:
    from graphdeck.analysis.parallel.partition import parallel_partition

    par = parallel_partition(session, graph)
    ddp = _ddp_buckets(session, graph, names)
    values = dict(par.values)
    for name, value in ddp.items():  # DDP buckets come before pipeline stages, after collectives / FSDP2
        if name not in values or values[name].startswith("stage "):
            values[name] = value
    notes = list(par.notes)
    ordered = {n: values[n] for n in names if n in values}
    note = "; ".join(notes) if notes else None
    if not ordered:
        note = "this graph is not a DDP bucket and was not split; no FSDP2 group, collective or pipeline stage " \
               "was recorded for it" + (f" ({note})" if note else "")
    return Overlay(kind="partition", categorical=True, values=ordered, note=note, label=par.label)


def _ddp_buckets(session: Session, graph: Graph, names: list[str]) -> dict[str, str]:
    """Node → ``"bucket <i>"``: DDPOptimizer's split of this graph, or the bucket it is."""
    buckets = session.execute(select(Partition.index, Partition.graph_id)
                              .where(Partition.parent_graph_id == graph.id).order_by(Partition.index)).all()
    values: dict[str, str] = {}
    for index, child_id in buckets:
        if child_id is None:
            continue
        for name in session.scalars(select(Node.name).where(Node.graph_id == child_id, Node.op != "placeholder",
                                                            Node.op != "output")):
            values.setdefault(name, f"bucket {index}")
    if values:
        return values
    index, at = graph.partition_index, graph
    while index is None and at.parent_id is not None:
        at = session.get(Graph, at.parent_id)
        index = at.partition_index
    return {} if index is None else dict.fromkeys(names, f"bucket {index}")


def _time(session: Session, graph_id: int) -> Overlay:
    try:
        from graphdeck.analysis.traces.mapping import node_time_ns
    except ImportError:
        return Overlay(kind="time", unit="ns", note="no kernel-to-node mapping is installed (graphdeck.analysis.traces.mapping)")
    values = node_time_ns(session, graph_id) or {}
    note = None
    if not values:
        # An executor run of this graph (graphdeck replay) maps onto its nodes by range names.
        from graphdeck.replay.executor import recorded_node_ns

        trace_id, values = recorded_node_ns(session, graph_id, exclude=set())
        note = (f"node times from trace {trace_id} (executor ranges)" if values
                else "no trace of this graph maps kernels to its nodes")
    return Overlay(kind="time", unit="ns", values={str(k): float(v) for k, v in values.items()}, note=note)
