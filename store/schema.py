"""The one schema of the graphdeck store.

Every table graphdeck writes or reads is declared here and nowhere else; capture, replay, the
server and any migration import this module. Repeated strings (op targets, module paths, stack
traces, trace event names and categories) are interned once in ``strings`` and referenced by id.

Units are in column names: ``*_ns`` nanoseconds, ``*_bytes`` bytes, ``*_s`` seconds.

Layout::

    runs ─┬─ ranks
          ├─ params          (one row per parameter name per rank; tied weights share ``storage_key``)
          ├─ graphs ── nodes ── edges
          │      └── graph_io (inputs/outputs bound to parameters and gradients)
          ├─ partitions      (DDP buckets: one per split sub-graph)
          ├─ compile_events  (structured compile records: metrics, graph-break reasons)
          ├─ grad_steps      (run-time gradient evidence: which parameter got a gradient, per step)
          ├─ kernel_nodes    (generated kernel name -> FX node it computes: Inductor provenance, ...)
          └─ traces ─┬─ trace_events
                     ├─ node_time_sets ── node_times  (per-node time of one trace, written at ingest)
                     └─ trace_links   (one trace's kernel → node links, written at ingest, read by export)
"""

from __future__ import annotations

import datetime as _dt

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: Bumped whenever a table or column changes, together with a new Alembic revision named after it
#: (``store/migrations/versions/000N_*.py``, revision ``"000N"``); stored in ``store_meta`` and in
#: ``alembic_version``, checked on open (:mod:`graphdeck.store.migrate`). 2: ``kernel_nodes.call_index``. 3: ``grad_steps``.
#: 4: an index on ``compile_events``. 5: ``node_time_sets`` / ``node_times``. 6: ``trace_links``.
SCHEMA_VERSION = 6


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


class Base(DeclarativeBase):
    pass


class StoreMeta(Base):
    """Key/value facts about the store itself (``schema_version``)."""

    __tablename__ = "store_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class InternedString(Base):
    """A string stored once; other tables point at it by ``id``."""

    __tablename__ = "strings"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[str] = mapped_column(Text, unique=True)


class Run(Base):
    """One training job (all its ranks). ``name`` is unique in a store."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    world_size: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime(timezone=True), default=_now)
    meta_json: Mapped[str] = mapped_column(Text, default="{}")


class Rank(Base):
    """One process of a run: its rank, world size and environment."""

    __tablename__ = "ranks"
    __table_args__ = (UniqueConstraint("run_id", "rank"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    hostname: Mapped[str | None] = mapped_column(String(200))
    pid: Mapped[int | None] = mapped_column(Integer)
    backend: Mapped[str | None] = mapped_column(String(32))  # process-group backend: gloo, nccl
    torch_version: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[_dt.datetime] = mapped_column(DateTime(timezone=True), default=_now)
    meta_json: Mapped[str] = mapped_column(Text, default="{}")


class Param(Base):
    """A named parameter or buffer of the watched model, on one rank.

    Tied weights appear once per name with the same ``storage_key`` (e.g. GPT-2's
    ``transformer.wte.weight`` and ``lm_head.weight``).
    """

    __tablename__ = "params"
    __table_args__ = (UniqueConstraint("run_id", "rank", "fqn"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    fqn: Mapped[str] = mapped_column(String(500))
    kind: Mapped[str] = mapped_column(String(16))  # "parameter" | "buffer"
    storage_key: Mapped[str] = mapped_column(String(64))
    shape_json: Mapped[str] = mapped_column(Text)
    dtype: Mapped[str] = mapped_column(String(32))
    numel: Mapped[int] = mapped_column(BigInteger)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    requires_grad: Mapped[bool] = mapped_column(Boolean)


class Graph(Base):
    """One FX graph captured on one rank.

    ``kind`` is one of ``dynamo`` (a graph Dynamo handed to the backend; after a graph break
    the resumed frame gets its own), ``ddp_partition`` (one DDP bucket's sub-graph, ``parent_id``
    is the unsplit ``dynamo`` graph), ``aot_forward``, ``aot_backward``, ``aot_inference``
    (``parent_id`` is the graph AOTAutograd traced).
    """

    __tablename__ = "graphs"
    __table_args__ = (Index("ix_graphs_run_rank", "run_id", "rank"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    ordinal: Mapped[int] = mapped_column(Integer)  # capture order on this rank, from 0
    kind: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(300))
    compile_id: Mapped[str | None] = mapped_column(String(64))  # "frame/compile[_attempt]"
    frame_name: Mapped[str | None] = mapped_column(String(300))
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("graphs.id", ondelete="CASCADE"))
    partition_index: Mapped[int | None] = mapped_column(Integer)
    num_nodes: Mapped[int] = mapped_column(Integer, default=0)
    structural_hash: Mapped[str | None] = mapped_column(String(64))
    compile_time_s: Mapped[float | None] = mapped_column(Float)
    backend: Mapped[str | None] = mapped_column(String(64))
    break_reason: Mapped[str | None] = mapped_column(Text)
    code: Mapped[str | None] = mapped_column(Text)  # GraphModule.code, readable Python
    meta_json: Mapped[str] = mapped_column(Text, default="{}")


class Node(Base):
    """One FX node. Tensor metadata is of the node's output (first output for tuples)."""

    __tablename__ = "nodes"
    __table_args__ = (UniqueConstraint("graph_id", "idx"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    graph_id: Mapped[int] = mapped_column(ForeignKey("graphs.id", ondelete="CASCADE"), index=True)
    idx: Mapped[int] = mapped_column(Integer)  # position in graph order
    name: Mapped[str] = mapped_column(String(300))
    op: Mapped[str] = mapped_column(String(32))  # placeholder, call_function, output, ...
    target_id: Mapped[int] = mapped_column(ForeignKey("strings.id"))
    args_json: Mapped[str] = mapped_column(Text, default="[]")
    shape_json: Mapped[str | None] = mapped_column(Text)  # list of ints/"s0"; list of lists for tuples
    dtype: Mapped[str | None] = mapped_column(String(32))
    stride_json: Mapped[str | None] = mapped_column(Text)
    device: Mapped[str | None] = mapped_column(String(32))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    module_path_id: Mapped[int | None] = mapped_column(ForeignKey("strings.id"))  # "a/b/c"
    module_stack_json: Mapped[str | None] = mapped_column(Text)  # [[path, class], ...]
    stack_trace_id: Mapped[int | None] = mapped_column(ForeignKey("strings.id"))
    seq_nr: Mapped[int | None] = mapped_column(Integer)
    partitioner_tag: Mapped[str | None] = mapped_column(String(64))
    desc: Mapped[str | None] = mapped_column(Text)  # AOT input/output descriptor, as printed
    param_fqn: Mapped[str | None] = mapped_column(String(500))  # placeholder bound to a parameter
    meta_json: Mapped[str] = mapped_column(Text, default="{}")


class Edge(Base):
    """Data edge ``src`` → ``dst`` (node positions in the same graph); ``arg_pos`` orders inputs."""

    __tablename__ = "edges"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    graph_id: Mapped[int] = mapped_column(ForeignKey("graphs.id", ondelete="CASCADE"), index=True)
    src_idx: Mapped[int] = mapped_column(Integer)
    dst_idx: Mapped[int] = mapped_column(Integer)
    arg_pos: Mapped[int] = mapped_column(Integer, default=0)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)


class GraphIO(Base):
    """A graph input or output tied to a parameter.

    ``direction`` is ``in`` (a placeholder that reads parameter ``param_fqn``) or ``grad``
    (an output of an ``aot_backward`` graph that is the gradient of ``param_fqn``; ``has_grad``
    is false when the backward graph returns ``None`` there).
    """

    __tablename__ = "graph_io"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    graph_id: Mapped[int] = mapped_column(ForeignKey("graphs.id", ondelete="CASCADE"), index=True)
    direction: Mapped[str] = mapped_column(String(8))
    position: Mapped[int] = mapped_column(Integer)
    node_name: Mapped[str | None] = mapped_column(String(300))
    param_fqn: Mapped[str | None] = mapped_column(String(500))
    has_grad: Mapped[bool | None] = mapped_column(Boolean)
    desc: Mapped[str | None] = mapped_column(Text)


class Partition(Base):
    """A DDP bucket: the sub-graph DDPOptimizer split off, with its parameters and size."""

    __tablename__ = "partitions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(32), default="ddp_bucket")
    parent_graph_id: Mapped[int | None] = mapped_column(ForeignKey("graphs.id", ondelete="CASCADE"))
    graph_id: Mapped[int | None] = mapped_column(ForeignKey("graphs.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    params_json: Mapped[str] = mapped_column(Text, default="[]")


class CompileEvent(Base):
    """A structured compile record (the same records TORCH_TRACE logs), e.g. ``compilation_metrics``."""

    __tablename__ = "compile_events"
    # Checks read one rank's records of a kind (layout, process groups, FR dumps): 1,024 ranks ×
    # a few queries each scanned the run's rows without it (bench/bench_layout.py: 76 → 17 CPU s).
    __table_args__ = (Index("ix_compile_events_run_rank_name", "run_id", "rank", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(100))
    compile_id: Mapped[str | None] = mapped_column(String(64))
    metadata_json: Mapped[str] = mapped_column(Text, default="{}")
    payload: Mapped[str | None] = mapped_column(Text)


class GradStep(Base):
    """Run-time gradient evidence of one rank over a run of identical backward passes.

    One row covers steps ``step_first`` … ``step_last`` (0-based; ``step_source`` ``optimizer``:
    the number of optimizer steps taken before the backward, ``backward``: the backward's index
    when no optimizer step was seen) and ``n_backward`` backward passes in them, all with the
    same ``state_json``: ``{"trainable": N, "none": [fqn], "zero": [fqn], "multi": {fqn: n},
    "frozen": [fqn], "unobserved": [fqn], "sites": {...}}`` — parameters that received no
    gradient, an all-zero gradient from a compiled region whose outputs the loss skipped, more
    than one accumulation in one backward, that were frozen at that step, or not observable
    (written by :mod:`graphdeck.capture.grad_evidence`). ``closed`` is false while the capture
    may still extend the row (a job that died leaves it false: ``step_last`` is then the last
    step known to have been written).
    """

    __tablename__ = "grad_steps"
    __table_args__ = (Index("ix_grad_steps_run_rank", "run_id", "rank"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    step_first: Mapped[int] = mapped_column(Integer)
    step_last: Mapped[int] = mapped_column(Integer)
    n_backward: Mapped[int] = mapped_column(Integer, default=1)
    step_source: Mapped[str] = mapped_column(String(16), default="backward")
    closed: Mapped[bool] = mapped_column(Boolean, default=False)
    state_json: Mapped[str] = mapped_column(Text, default="{}")


class KernelNode(Base):
    """One link from a generated kernel (as named in profiler traces, e.g. ``triton_poi_fused_add_0``)
    to an FX node it computes. A fused kernel has one row per node.

    ``graph_id`` is the stored graph holding ``node_name`` (an AOT forward/backward graph, or an
    imported Inductor post-grad graph); ``pre_grad_node`` is the node of the pre-grad (Dynamo)
    graph it derives from, when known. ``source`` says where the link came from:
    ``inductor_provenance_v1`` / ``inductor_provenance_v2`` (Inductor's provenance tracking),
    ``record_function`` (a profiler range named by the node), ``seq_nr`` (op name + sequence number).
    """

    __tablename__ = "kernel_nodes"
    __table_args__ = (Index("ix_kernel_nodes_run_kernel", "run_id", "kernel_name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    compile_id: Mapped[str | None] = mapped_column(String(64))
    graph_id: Mapped[int | None] = mapped_column(ForeignKey("graphs.id", ondelete="CASCADE"), index=True)
    kernel_name: Mapped[str] = mapped_column(String(500))
    node_name: Mapped[str] = mapped_column(String(300))
    pre_grad_node: Mapped[str | None] = mapped_column(String(300))
    source: Mapped[str] = mapped_column(String(32))  # a short tag: PostgreSQL holds at most 32 characters
    #: Which call of ``kernel_name`` in the graph's generated code this row is (Inductor's
    #: provenance debug handle: increasing in call order); a kernel called at several sites
    #: fuses different nodes at each. NULL when the source does not say.
    call_index: Mapped[int | None] = mapped_column(Integer)


class Trace(Base):
    """A Kineto (Chrome trace JSON) profile of one rank. ``status``: ``ingesting`` (being written, or
    its writer died: readers skip it), ``ok``, or ``truncated`` (the file ended early; every event
    before the cut is kept)."""

    __tablename__ = "traces"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(300))
    status: Mapped[str] = mapped_column(String(16), default="ok")
    num_events: Mapped[int] = mapped_column(Integer, default=0)
    start_ns: Mapped[int | None] = mapped_column(BigInteger)
    end_ns: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime(timezone=True), default=_now)
    stats_json: Mapped[str] = mapped_column(Text, default="{}")
    meta_json: Mapped[str] = mapped_column(Text, default="{}")  # top-level keys: deviceProperties, ...


class TraceEvent(Base):
    """One complete (``X``) or instant (``i``) trace event; times in ns since the Unix epoch when
    the trace gives ``baseTimeNanoseconds``, else the trace's own clock in ns."""

    __tablename__ = "trace_events"
    __table_args__ = (Index("ix_trace_events_trace_ts", "trace_id", "ts_ns"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"))
    ph: Mapped[str] = mapped_column(String(2))
    name_id: Mapped[int] = mapped_column(ForeignKey("strings.id"))
    cat_id: Mapped[int | None] = mapped_column(ForeignKey("strings.id"))
    ts_ns: Mapped[int] = mapped_column(BigInteger)
    dur_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    pid: Mapped[str] = mapped_column(String(64))
    tid: Mapped[str] = mapped_column(String(64))
    correlation: Mapped[int | None] = mapped_column(BigInteger)
    args_json: Mapped[str | None] = mapped_column(Text)


class NodeTimeSet(Base):
    """One mapping of one trace's events onto FX nodes (NOTE: [Node-time table] in
    :mod:`graphdeck.store.node_times`), written when the trace is ingested; its rows are
    :class:`NodeTime`.

    ``method`` names the mapper and its version (``"run_diff/2"``: the units ``map_trace`` places —
    GPU kernels, or a CPU trace's ops and C++ kernels; :mod:`graphdeck.analysis.diff.times`); ``source`` what it
    read (``gpu kernels`` | ``cpu ops of compiled functions``; NULL when nothing mapped, ``missing``
    then says why). ``steps``: profiled steps (``ProfilerStep#N`` ranges; 1 when the trace has
    none). ``mapped_calls`` / ``unmapped_calls``: compiled-function calls or kernels placed / not.
    The state of the rank's graphs it was computed against, to tell a stale set (graphs or kernel
    links stored after the trace): ``graphs_count`` AOT graphs of the trace's run and rank, the
    newest being ``last_graph_id``, and ``kernel_nodes_count`` kernel links of that rank.
    """

    __tablename__ = "node_time_sets"
    __table_args__ = (UniqueConstraint("trace_id", "method"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    method: Mapped[str] = mapped_column(String(64))
    source: Mapped[str | None] = mapped_column(String(64))
    steps: Mapped[int] = mapped_column(Integer, default=1)
    mapped_calls: Mapped[int] = mapped_column(Integer, default=0)
    unmapped_calls: Mapped[int] = mapped_column(Integer, default=0)
    missing: Mapped[str | None] = mapped_column(Text)
    graphs_count: Mapped[int] = mapped_column(Integer, default=0)
    last_graph_id: Mapped[int | None] = mapped_column(ForeignKey("graphs.id", ondelete="SET NULL"))
    kernel_nodes_count: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime(timezone=True), default=_now)


class NodeTime(Base):
    """The time one trace spent in one FX node (a row of a :class:`NodeTimeSet`).

    ``total_ns``: summed over the whole trace (before the first profiled step too), over
    ``count`` timed calls (kernels or ops; a fused kernel's time is split evenly over its nodes);
    ``steps_ns_json``: ``[ns, ...]`` one int per profiled step (``NodeTimeSet.steps`` long;
    time before the first step is in ``total_ns`` only). One row per node rather than per
    (node, step): a step column would make as many rows as the trace has events.
    """

    __tablename__ = "node_times"
    __table_args__ = (Index("ix_node_times_set", "set_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    set_id: Mapped[int] = mapped_column(ForeignKey("node_time_sets.id", ondelete="CASCADE"))
    graph_id: Mapped[int] = mapped_column(ForeignKey("graphs.id", ondelete="CASCADE"), index=True)
    node_name: Mapped[str] = mapped_column(String(300))
    total_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    count: Mapped[int] = mapped_column(Integer, default=0)
    steps_ns_json: Mapped[str] = mapped_column(Text, default="[]")


class TraceLinks(Base):
    """One trace's kernel → FX node links, computed when the trace is ingested and read by
    ``export-trace`` instead of mapping the events again (NOTE: [Stored kernel links] in
    :mod:`graphdeck.analysis.traces.export_map`).

    ``method``: the mapper and its version (``"export/1"``). ``links_json``: the links as compact
    JSON (format in that NOTE). What they were computed against, to tell stale links: the rank's
    graphs and kernel links (``graphs_count`` AOT graphs, the newest ``last_graph_id``,
    ``kernel_nodes_count`` kernel links: as :class:`NodeTimeSet`) and the trace's ``X`` events
    (``events_count`` of them, ids ``first_event_id`` .. ``last_event_id``; plain ints, not foreign
    keys, so a copy of the row into another store with new event ids reads as stale).
    """

    __tablename__ = "trace_links"
    __table_args__ = (UniqueConstraint("trace_id", "method"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    method: Mapped[str] = mapped_column(String(64))
    graphs_count: Mapped[int] = mapped_column(Integer, default=0)
    last_graph_id: Mapped[int | None] = mapped_column(ForeignKey("graphs.id", ondelete="SET NULL"))
    kernel_nodes_count: Mapped[int] = mapped_column(Integer, default=0)
    events_count: Mapped[int] = mapped_column(Integer, default=0)
    first_event_id: Mapped[int | None] = mapped_column(BigInteger)
    last_event_id: Mapped[int | None] = mapped_column(BigInteger)
    links_json: Mapped[str] = mapped_column(Text, default="{}")
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime(timezone=True), default=_now)
