"""The capture agent's single writer into the store.

One transaction per graph (its row, nodes, edges and parameter bindings), so a rank that dies
mid-write leaves either the whole graph or nothing. Writers of several ranks share one SQLite
file in WAL mode; ``retrying`` waits out another rank's write lock.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

from sqlalchemy import delete, event, insert, select

from graphdeck.capture.fxrecord import GraphRecord
from graphdeck.store.db import Interner, get_or_create_rank, get_or_create_run, open_engine, retrying, write_session
from graphdeck.store.schema import CompileEvent, Edge, GradStep, Graph, GraphIO, Node, Param, Partition


@dataclass
class IOBinding:
    """A graph input that reads a parameter (``direction="in"``) or a backward output that is a
    parameter's gradient (``direction="grad"``, ``has_grad`` false when it is ``None``)."""

    direction: str
    position: int
    node_name: str | None
    param_fqn: str | None
    has_grad: bool | None = None
    desc: str | None = None


def clean_text(value: str) -> str:
    """``value`` as every store can hold it: a lone surrogate (SQLite's UTF-8 refuses it) becomes
    ``\\udXXX`` text and NUL (PostgreSQL's text refuses it) ``\\x00``; other text unchanged.

    # NOTE: [Odd names] One module or parameter name the database refuses would roll back the
    # transaction of its graph, losing every node of it; the capture stores such a name escaped
    # and keeps the rest.
    """
    if value.isascii():
        return value.replace("\x00", "\\x00") if "\x00" in value else value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value.replace("\x00", "\\x00") if "\x00" in value else value


_NESTED = (dict, list, tuple)


def _clean(params):
    # the common case first, inline: plain ASCII text without NUL is what every store holds
    if isinstance(params, str):
        return params if params.isascii() and "\x00" not in params else clean_text(params)
    if isinstance(params, dict):
        return {k: (v if v.isascii() and "\x00" not in v else clean_text(v)) if type(v) is str
                else _clean(v) if isinstance(v, _NESTED) or isinstance(v, str) else v for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return type(params)([(v if v.isascii() and "\x00" not in v else clean_text(v)) if type(v) is str
                             else _clean(v) if isinstance(v, _NESTED) or isinstance(v, str) else v for v in params])
    return params


#: Execution option of a statement whose text parameters the writer cleaned itself (a graph's
#: node and edge rows: thousands of rows whose JSON columns are ASCII by construction).
PRECLEANED = {"graphdeck_precleaned": True}


def _clean_statement_params(conn, cursor, statement, parameters, context, executemany):
    """``before_cursor_execute`` on the capture's engine: every text parameter cleaned (NOTE: [Odd
    names]), but in statements marked :data:`PRECLEANED`."""
    if context is not None and context.execution_options.get("graphdeck_precleaned"):
        return statement, parameters
    return statement, _clean(parameters)


def _owner_path(fqn: str | None) -> str | None:
    """A parameter placeholder has no ``nn_module_stack``; it belongs to the module that owns the
    parameter: ``"transformer.h.0.ln_1.weight"`` → ``"transformer/h/0/ln_1"``."""
    if not fqn or "." not in fqn:
        return None
    return "/".join(fqn.split(".")[:-1])


class StoreWriter:
    """Writes one rank's capture. ``store`` is a path (SQLite) or SQLAlchemy URL."""

    def __init__(self, store, run_name: str, rank: int, world_size: int, *, backend: str | None = None,
                 launch: str | None = None, append: bool = False):
        """``launch``: this rank's launch (:func:`graphdeck.capture.launch.launch_id`): the run is
        claimed for it (NOTE: [One run per launch]) and ``run_name`` is the run really written,
        ``notice`` says why when it is not the name asked for; None: ``run_name`` as it is (a
        caller that owns the store). ``append``: add to ``run_name`` whoever made it."""
        import torch

        self.engine = open_engine(store)
        event.listen(self.engine, "before_cursor_execute", _clean_statement_params, retval=True)
        self.rank = rank
        self.world_size = world_size
        self.run_name, self.notice = run_name, None

        def register():
            with write_session(self.engine) as s:
                if launch is None:
                    run = get_or_create_run(s, run_name, world_size=world_size)
                else:
                    from graphdeck.capture.launch import claim_run

                    run, self.notice = claim_run(s, run_name, launch, world_size=world_size, append=append)
                get_or_create_rank(
                    s, run, rank, world_size=world_size, hostname=socket.gethostname(), pid=os.getpid(),
                    backend=backend, torch_version=torch.__version__,
                )
                self.run_name = run.name
                return run.id

        try:
            self.run_id = retrying(register)
            with write_session(self.engine) as s:
                self._ordinal = len(s.scalars(select(Graph.id).where(Graph.run_id == self.run_id,
                                                                     Graph.rank == rank)).all())
        except BaseException:  # a store that opened but cannot be written: no engine left behind
            self.engine.dispose()
            raise

    def write_params(self, rows: list[dict]) -> None:
        """Replace this rank's parameter list. Each row: fqn, kind, storage_key, shape, dtype,
        numel, size_bytes, requires_grad."""

        def do():
            with write_session(self.engine) as s:
                s.execute(delete(Param).where(Param.run_id == self.run_id, Param.rank == self.rank))
                for r in rows:
                    s.add(Param(run_id=self.run_id, rank=self.rank, fqn=r["fqn"], kind=r["kind"],
                                storage_key=r["storage_key"], shape_json=json.dumps(r["shape"]),
                                dtype=r["dtype"], numel=r["numel"], size_bytes=r["size_bytes"],
                                requires_grad=r["requires_grad"]))

        retrying(do)

    def write_graph(self, record: GraphRecord, *, kind: str, name: str, compile_id: str | None,
                    frame_name: str | None = None, parent_id: int | None = None,
                    partition_index: int | None = None, compile_time_s: float | None = None,
                    backend: str | None = None, break_reason: str | None = None,
                    io: list[IOBinding] = (), param_by_node: dict[str, str] | None = None,
                    meta: dict | None = None) -> int:
        """Store one graph with its nodes, edges and bindings; returns ``graphs.id``."""
        param_by_node = param_by_node or {}

        def do():
            with write_session(self.engine) as s:
                intern = Interner(s)
                g = Graph(run_id=self.run_id, rank=self.rank, ordinal=self._ordinal, kind=kind, name=name,
                          compile_id=compile_id, frame_name=frame_name, parent_id=parent_id,
                          partition_index=partition_index, num_nodes=len(record.nodes),
                          structural_hash=record.structural_hash, compile_time_s=compile_time_s,
                          backend=backend, break_reason=break_reason, code=record.code,
                          meta_json=json.dumps(meta or {}, default=str))
                s.add(g)
                s.flush()
                # Core executemany, strings interned in batches: the ORM unit of work and one
                # SELECT + flush per new string took ~0.4 s a graph of the compile's own time.
                # Interned as stored (NOTE: [Odd names]): the engine's hook cleans every parameter,
                # so a raw name with a NUL or a lone surrogate would not be found after its insert.
                def ct(v):
                    return clean_text(v) if isinstance(v, str) else v

                paths = [ct(n.module_path or _owner_path(param_by_node.get(n.name))) for n in record.nodes]
                targets = [ct(n.target) for n in record.nodes]
                stacks = [ct(n.stack_trace) for n in record.nodes]
                intern.many(targets + paths + stacks)
                dumps = json.dumps
                if record.nodes:
                    # Core executemany (no ORM bulk work); free text cleaned here, JSON is ASCII
                    s.execute(insert(Node.__table__).execution_options(**PRECLEANED), [
                        {"graph_id": g.id, "idx": n.idx, "name": ct(n.name), "op": n.op, "target_id": intern(t),
                         "args_json": dumps({"args": n.args, "kwargs": n.kwargs}, default=str),
                         "shape_json": None if n.shape is None else dumps(n.shape),
                         "dtype": n.dtype, "stride_json": None if n.stride is None else dumps(n.stride),
                         "device": n.device, "size_bytes": n.size_bytes, "module_path_id": intern(path),
                         "module_stack_json": dumps(n.module_stack) if n.module_stack else None,
                         "stack_trace_id": intern(st), "seq_nr": n.seq_nr,
                         "partitioner_tag": ct(n.partitioner_tag), "desc": ct(n.desc),
                         "param_fqn": ct(param_by_node.get(n.name)), "meta_json": dumps(n.meta, default=str)}
                        for n, path, t, st in zip(record.nodes, paths, targets, stacks)])
                if record.edges:
                    s.execute(insert(Edge.__table__).execution_options(**PRECLEANED), [{"graph_id": g.id, "src_idx": e.src_idx, "dst_idx": e.dst_idx,
                                              "arg_pos": e.arg_pos, "size_bytes": e.size_bytes}
                                             for e in record.edges])
                if io:
                    s.execute(insert(GraphIO), [{"graph_id": g.id, "direction": b.direction,
                                                 "position": b.position, "node_name": b.node_name,
                                                 "param_fqn": b.param_fqn, "has_grad": b.has_grad, "desc": b.desc}
                                                for b in io])
                return g.id

        graph_id = retrying(do)
        self._ordinal += 1
        return graph_id

    def update_graph_meta(self, graph_id: int, updates: dict) -> None:
        """Merge ``updates`` into ``graphs.meta_json`` of ``graph_id`` (facts seen after compile)."""

        def do():
            with write_session(self.engine) as s:
                g = s.get(Graph, graph_id)
                if g is not None:
                    g.meta_json = json.dumps({**json.loads(g.meta_json or "{}"), **updates}, default=str)

        retrying(do)

    def add_bindings(self, rows_by_graph: dict[int, list[IOBinding]]) -> None:
        """Add ``graph_io`` rows to graphs already stored (one transaction): the parameters a
        compiled graph read on a later call (see NOTE: [Run-time parameter binding] in agent.py)."""

        def do():
            with write_session(self.engine) as s:
                s.add_all([GraphIO(graph_id=gid, direction=b.direction, position=b.position,
                                   node_name=b.node_name, param_fqn=b.param_fqn, has_grad=b.has_grad,
                                   desc=b.desc) for gid, rows in rows_by_graph.items() for b in rows])

        retrying(do)

    def write_partition(self, *, parent_graph_id: int, graph_id: int | None, index: int,
                        size_bytes: int, params: list[str]) -> None:
        def do():
            with write_session(self.engine) as s:
                s.add(Partition(run_id=self.run_id, rank=self.rank, kind="ddp_bucket",
                                parent_graph_id=parent_graph_id, graph_id=graph_id, index=index,
                                size_bytes=size_bytes, params_json=json.dumps(params)))

        retrying(do)

    def write_compile_events(self, events: list[dict]) -> None:
        if not events:
            return

        def do():
            with write_session(self.engine) as s:
                for e in events:
                    payload = e.get("payload")  # text, or a callable making it (compile_log's snapshots)
                    s.add(CompileEvent(run_id=self.run_id, rank=self.rank, name=e["name"],
                                       compile_id=e.get("compile_id"),
                                       metadata_json=json.dumps(e.get("metadata", {}), default=str),
                                       payload=payload() if callable(payload) else payload))

        retrying(do)

    def write_grad_step(self, *, step_first: int, step_last: int, n_backward: int, step_source: str,
                        state: dict, closed: bool = False) -> int:
        """Store one run of identical backward passes (``grad_steps``); returns its id."""

        def do():
            with write_session(self.engine) as s:
                row = GradStep(run_id=self.run_id, rank=self.rank, step_first=step_first, step_last=step_last,
                               n_backward=n_backward, step_source=step_source, closed=closed,
                               state_json=json.dumps(state, default=str))
                s.add(row)
                s.flush()
                return row.id

        return retrying(do)

    def extend_grad_step(self, row_id: int, *, step_last: int, n_backward: int, step_source: str,
                         closed: bool = False) -> None:
        """Move the end of ``grad_steps`` row ``row_id`` (more identical backward passes seen)."""

        def do():
            with write_session(self.engine) as s:
                row = s.get(GradStep, row_id)
                if row is not None:
                    row.step_last, row.n_backward, row.step_source, row.closed = (
                        step_last, n_backward, step_source, closed)

        retrying(do)

    def grad_steps_at_step_zero(self, row_ids: list[int]) -> None:
        """Renumber ``grad_steps`` rows ``row_ids`` as optimizer step 0: the backward passes seen
        before the first optimizer step belong to it."""

        def do():
            with write_session(self.engine) as s:
                for row in s.query(GradStep).filter(GradStep.id.in_(row_ids)):
                    row.step_first = row.step_last = 0
                    row.step_source = "optimizer"

        retrying(do)

    def write_records(self, name: str, payloads: list[str], updates: dict[int, str] | None = None) -> list[int]:
        """Store ``compile_events`` records of the capture's own (``compile_id`` None) and replace
        the payloads of earlier ones (``updates``: id → payload), in one transaction; returns the
        new rows' ids."""

        def do():
            with write_session(self.engine) as s:
                for rid, payload in (updates or {}).items():
                    row = s.get(CompileEvent, rid)
                    if row is not None:
                        row.payload = payload
                rows = [CompileEvent(run_id=self.run_id, rank=self.rank, name=name, compile_id=None,
                                     metadata_json="{}", payload=p) for p in payloads]
                s.add_all(rows)
                s.flush()
                return [r.id for r in rows]

        return retrying(do)
