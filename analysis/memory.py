"""Memory from the graph: tensor lifetimes, the running live total, the peak and who holds it.

For a stored FX graph (usually an AOTAutograd forward or backward graph of ATen ops) every node's
output is a tensor *storage* with a birth (its producing node) and a death (the last node that
reads it or any view of it). Storages are counted once: an aliasing op (``view``, ``t``,
``transpose``, ``expand``, ``slice``, ``getitem`` of a multi-output op, ...) makes no allocation
and extends its base's lifetime instead. Walking the nodes in graph order (the order the
generated code runs them), the live total after node ``i`` allocates is the memory the graph
needs there; its maximum is the peak.

Classes of bytes (``Tensor.kind``):

* ``parameter`` — a placeholder bound to a parameter (held by the module for the whole step);
* ``input`` — any other placeholder (held by the caller for the whole graph: token ids, tangents,
  in a backward graph the activations the forward saved);
* ``activation`` — an intermediate, freed after its last use;
* ``output`` — returned by the graph (held until the graph ends); in an ``aot_forward`` graph the
  outputs named ``SavedForBackwardsAOTOutput`` are **saved activations** (``saved``), held until
  the backward graph's last use of them.

``step_memory`` chains a forward graph and its backward graph into one step curve; saved
activations then live from their forward producer to their last backward use, and the backward
node that frees each is reported. ``checkpoint_estimate`` and ``dtype_estimate`` answer what-if
questions from the same model. The model counts tensor bytes (``numel × itemsize``); it does not
model the allocator's caching, rounding or fragmentation, nor workspace memory of kernels, nor
in-place reuse by Inductor — measured peaks are therefore higher (see bench/RESULTS.md).

Pure: reads the store, returns data; the server, CLI and dashboard render it.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.errors import NotFoundError, UsageError
from graphdeck.store.schema import Graph, InternedString

#: Ops whose output aliases their first tensor input (no new storage). Matched against the op
#: name without namespace/overload: ``aten.view.default`` → ``view``; ``torch.Tensor.view`` and
#: ``call_method`` targets too.
ALIAS_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "expand_as",
    "slice", "select", "squeeze", "unsqueeze", "alias", "as_strided", "detach", "narrow", "diagonal",
    "unflatten", "flatten", "view_as", "view_as_real", "view_as_complex", "unfold", "split", "split_with_sizes",
    "chunk", "unbind", "getitem", "contiguous", "type_as", "movedim", "swapaxes", "numpy_T", "mT", "T",
    "lift_fresh", "lift_fresh_copy", "_to_copy_view",
})

#: Bytes per element by dtype name, for what-if dtype changes.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
            "float8_e5m2": 1}


@functools.lru_cache(maxsize=8192)
def op_name(target: str) -> str:
    """``aten.view.default`` → ``view``; ``torch.Tensor.view`` → ``view``; ``_operator.getitem`` → ``getitem``."""
    parts = target.split(".")
    if len(parts) >= 3 and parts[0] in ("aten", "prims", "torch") and parts[-1] in ("default", "Tensor", "int",
                                                                                     "Scalar", "dim", "self", "using_ints"):
        return parts[-2]
    if len(parts) == 3 and parts[0] == "aten":
        return parts[1]
    return parts[-1]


@dataclass(slots=True)
class Tensor:
    """One storage: born at node ``birth_idx``, last read at ``death_idx`` (graph positions)."""

    name: str  # producing node
    birth_idx: int
    death_idx: int
    size_bytes: int
    dtype: str | None
    kind: str  # parameter | input | activation | output | saved
    module_path: str | None
    freed_by: str | None = None  # node whose execution ends its life (None: held past the graph)


@dataclass
class Holder:
    module_path: str
    size_bytes: int
    tensors: int
    by_kind: dict[str, int]


@dataclass
class MemoryCurve:
    """Live bytes per node in execution order (one or two graphs chained)."""

    graph_ids: list[int]
    nodes: list[str]  # "name" (one graph) or "f:name"/"b:name" (forward/backward step)
    modules: list[str | None]
    live_bytes: list[int]  # live total right after each node allocated its output
    peak_bytes: int
    peak_index: int
    peak_node: str
    holders: list[Holder]  # what is live at the peak, by module path, largest first
    by_kind_at_peak: dict[str, int]
    saved: list[dict] = field(default_factory=list)  # saved activations: bytes, module, freed by
    saved_bytes_by_module: dict[str, int] = field(default_factory=dict)
    tensors: list[Tensor] = field(default_factory=list)

    def to_dict(self, *, with_tensors: bool = False) -> dict:
        out = asdict(self)
        if not with_tensors:
            out.pop("tensors")
        return out

    def top_holders(self, n: int = 10) -> list[Holder]:
        return self.holders[:n]


# ------------------------------------------------------------------------------------ loading
@dataclass(slots=True)
class _N:
    idx: int
    name: str
    op: str
    target: str
    size_bytes: int
    dtype: str | None
    module_path: str | None
    seq_nr: int | None
    desc: str | None
    param_fqn: str | None
    inputs: list[int]  # producer idx per input edge, in arg order


def _load(session: Session, graph_id: int) -> list[_N]:
    # Plain DB-API rows on SQLite: on 100k-node graphs SQLAlchemy's per-row processing was most
    # of the time. Interned strings (targets, module paths) are looked up once per distinct id
    # rather than joined per node; ``desc``/``param_fqn`` are read only for placeholders and the
    # output node, the only ones liveness asks about.
    sql_nodes = ("SELECT idx, name, op, target_id, size_bytes, dtype, module_path_id, seq_nr FROM nodes "
                 "WHERE graph_id = {p} ORDER BY idx")
    sql_io = ('SELECT idx, "desc", param_fqn FROM nodes WHERE graph_id = {p} '
              "AND op IN ('placeholder', 'output')")
    sql_edges = "SELECT src_idx, dst_idx FROM edges WHERE graph_id = {p} ORDER BY id"  # (dst, arg_pos) order
    conn = session.connection()
    if conn.dialect.name == "sqlite":
        raw = conn.connection.driver_connection

        def run(sql, *args):
            return raw.execute(sql.format(p="?"), (graph_id, *args))
    else:
        def run(sql, *args):
            return conn.exec_driver_sql(sql.format(p="%(g)s"), {"g": graph_id})
    rows = run(sql_nodes).fetchall()
    io = {r[0]: (r[1], r[2]) for r in run(sql_io)}
    ids = {r[3] for r in rows} | {r[6] for r in rows if r[6] is not None}
    text = dict(session.execute(select(InternedString.id, InternedString.value)
                                .where(InternedString.id.in_(ids))).all()) if ids else {}
    nodes = []
    for r in rows:
        desc, fqn = io.get(r[0], (None, None))
        nodes.append(_N(r[0], r[1], r[2], text.get(r[3], ""), int(r[4] or 0), r[5],
                        text.get(r[6]) if r[6] is not None else None, r[7], desc, fqn, []))
    pos = {n.idx: i for i, n in enumerate(nodes)}
    for src, dst in run(sql_edges):
        p = pos.get(dst)
        if p is not None:
            nodes[p].inputs.append(src)
    return nodes


def _graph(session: Session, graph_id: int) -> Graph:
    g = session.get(Graph, graph_id)
    if g is None:
        raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
    return g


def _saved_names(nodes: list[_N]) -> list[str]:
    """Names of the forward outputs AOTAutograd saves for backward, in output order."""
    out = next((n for n in reversed(nodes) if n.op == "output"), None)
    if out is None or not out.desc:
        return []
    try:
        descs = json.loads(out.desc)
    except ValueError:
        return []
    by_pos = {n.idx: n for n in nodes}
    names = []
    for k, d in enumerate(descs if isinstance(descs, list) else []):
        text = d.get("repr") if isinstance(d, dict) else str(d)
        if text and text.startswith("SavedForBackwards") and k < len(out.inputs):
            names.append(by_pos[out.inputs[k]].name)
    return names


# ------------------------------------------------------------------------------------ liveness
def _tensors(nodes: list[_N], *, saved: set[str] = frozenset(), paths: dict[int, str | None] | None = None
             ) -> tuple[list[Tensor], dict[str, int], list[int | None]]:
    """Storages of one graph; node name → storage index (views share their base's); and per
    storage its real last use (graph position of the last node reading it or a view of it).

    ``death_idx`` is where the graph lets go: the last use for intermediates, the graph's end for
    placeholders and outputs. A storage any of whose names is in ``saved`` is ``saved``.
    """
    if paths is None:
        paths = {n.idx: n.module_path for n in nodes}
    # Few distinct targets: classify each once, not once per node.
    alias_targets = {t for t in {n.target for n in nodes if n.op in ("call_function", "call_method")}
                     if op_name(t) in ALIAS_OPS}
    storage_of: dict[int, int] = {}  # node idx -> tensor index
    names: dict[str, int] = {}
    tensors: list[Tensor] = []
    end = len(nodes) - 1
    returned: set[int] = set()  # storages the output node returns, filled below
    for i, n in enumerate(nodes):
        if n.op == "output":
            continue
        if n.target in alias_targets and n.op != "placeholder" and n.inputs and n.inputs[0] in storage_of:
            storage_of[n.idx] = storage_of[n.inputs[0]]
            names[n.name] = storage_of[n.idx]
            continue
        if n.size_bytes <= 0:
            continue
        kind = ("parameter" if n.param_fqn else "input") if n.op == "placeholder" else "activation"
        storage_of[n.idx] = len(tensors)
        names[n.name] = len(tensors)
        tensors.append(Tensor(name=n.name, birth_idx=i, death_idx=i, size_bytes=n.size_bytes, dtype=n.dtype,
                              kind=kind, module_path=paths.get(n.idx)))
    last: list[int | None] = [None] * len(tensors)
    for i, n in enumerate(nodes):
        if n.op == "output":
            returned = {storage_of[s] for s in n.inputs if s in storage_of}
            continue
        for src in n.inputs:
            t = storage_of.get(src)
            if t is not None:
                last[t] = i
    saved_storages = {names[x] for x in saved if x in names}
    for k, t in enumerate(tensors):
        if k in saved_storages and t.kind == "activation":
            t.kind = "saved"
        elif k in returned and t.kind == "activation":
            t.kind = "output"
        if t.kind == "activation":
            t.death_idx = max(t.birth_idx, last[k] if last[k] is not None else t.birth_idx)
            t.freed_by = nodes[t.death_idx].name
        else:
            t.death_idx = end  # held for the whole graph (saved: and into the backward)
    return tensors, names, last


def _curve(n_positions: int, tensors: list[Tensor]) -> list[int]:
    delta = [0] * (n_positions + 1)
    for t in tensors:
        delta[t.birth_idx] += t.size_bytes
        delta[t.death_idx + 1] -= t.size_bytes
    live, out = 0, []
    # live after node i allocated = everything born at or before i and not freed before i
    for i in range(n_positions):
        live += delta[i]
        out.append(live)
    return out


def _holders(tensors: list[Tensor], at: int) -> tuple[list[Holder], dict[str, int]]:
    by_mod: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "n": 0, "kinds": defaultdict(int)})
    kinds: dict[str, int] = defaultdict(int)
    for t in tensors:
        if t.birth_idx <= at <= t.death_idx:
            m = by_mod[t.module_path or "(no module)"]
            m["bytes"] += t.size_bytes
            m["n"] += 1
            m["kinds"][t.kind] += t.size_bytes
            kinds[t.kind] += t.size_bytes
    holders = [Holder(module_path=k, size_bytes=v["bytes"], tensors=v["n"], by_kind=dict(v["kinds"]))
               for k, v in by_mod.items()]
    holders.sort(key=lambda h: (-h.size_bytes, h.module_path))
    return holders, dict(kinds)


def _finish(graph_ids, names, modules, tensors) -> MemoryCurve:
    live = _curve(len(names), tensors)
    peak_index = max(range(len(live)), key=lambda i: (live[i], -i)) if live else 0
    holders, kinds = _holders(tensors, peak_index)
    return MemoryCurve(graph_ids=graph_ids, nodes=names, modules=modules, live_bytes=live,
                       peak_bytes=live[peak_index] if live else 0, peak_index=peak_index,
                       peak_node=names[peak_index] if names else "", holders=holders, by_kind_at_peak=kinds,
                       tensors=tensors)


def graph_memory(session: Session, graph_id: int) -> MemoryCurve:
    """Liveness of one stored graph: live bytes per node, the peak, holders at the peak.

    Raises:
        NotFoundError: no graph ``graph_id``.
    """
    graph = _graph(session, graph_id)
    nodes = _load(session, graph_id)
    saved = set(_saved_names(nodes)) if graph.kind == "aot_forward" else set()
    paths = _module_resolver(session, graph, nodes)
    tensors, _names, _last = _tensors(nodes, saved=saved, paths=paths)
    curve = _finish([graph_id], [n.name for n in nodes], [paths.get(n.idx) for n in nodes], tensors)
    if saved:
        curve.saved = [{"name": t.name, "size_bytes": t.size_bytes, "module_path": t.module_path, "freed_by": None}
                       for t in tensors if t.kind == "saved"]
        curve.saved_bytes_by_module = _sum_by_module(curve.saved)
    return curve


def forward_backward_pair(session: Session, graph_id: int) -> tuple[int, int]:
    """The (aot_forward, aot_backward) graph ids of the compile ``graph_id`` belongs to.

    Raises:
        NotFoundError: no such graph, or it has no forward/backward partner.
    """
    g = _graph(session, graph_id)
    if g.kind not in ("aot_forward", "aot_backward"):
        kids = session.scalars(select(Graph).where(Graph.parent_id == g.id)).all()
        if not kids:
            raise NotFoundError(f"graph {graph_id} ({g.kind}) has no AOTAutograd forward/backward graphs")
        g = kids[0]
    sibs = session.scalars(select(Graph).where(Graph.run_id == g.run_id, Graph.rank == g.rank,
                                               Graph.parent_id == g.parent_id, Graph.compile_id == g.compile_id,
                                               Graph.kind.in_(("aot_forward", "aot_backward")))).all()
    fw = next((s for s in sibs if s.kind == "aot_forward"), None)
    bw = next((s for s in sibs if s.kind == "aot_backward"), None)
    if fw is None or bw is None:
        raise NotFoundError(f"graph {graph_id}: no forward/backward pair stored for compile {g.compile_id}")
    return fw.id, bw.id


def step_memory(session: Session, forward_id: int, backward_id: int, *, drop_saved: set[str] = frozenset(),
                itemsize_of=None) -> MemoryCurve:
    """One training step's curve: the forward graph, then the backward graph.

    A backward placeholder named like a forward node is that node's storage (AOTAutograd passes
    saved activations and parameters by name): it is counted once, from its forward producer to
    its last backward use (``saved[i]["freed_by"]`` names that backward node). ``drop_saved``
    names saved activations to treat as recomputed (activation checkpointing): held only until
    their last forward use, re-materialised from their first to their last backward use.
    ``itemsize_of(tensor) -> bytes`` rescales tensor bytes (a dtype what-if).
    """
    fw_graph, bw_graph = _graph(session, forward_id), _graph(session, backward_id)
    fw, bw = _load(session, forward_id), _load(session, backward_id)
    saved = set(_saved_names(fw))
    mod_f = _module_resolver(session, fw_graph, fw)
    mod_b = _module_resolver(session, bw_graph, bw, forward=fw)
    tf, names_f, last_f = _tensors(fw, saved=saved, paths=mod_f)
    tb, names_b, last_b = _tensors(bw, paths=mod_b)
    nf, end = len(fw), len(fw) + len(bw) - 1
    dropped = {names_f[x] for x in drop_saved if x in names_f}
    recompute_at = min((u for j, t in enumerate(tb) if t.name in drop_saved
                        for u in [_first_use_of(bw, names_b, j)] if u is not None), default=len(bw))
    merged = [Tensor(**asdict(t)) for t in tf]
    for k, t in enumerate(merged):
        if t.kind == "parameter":
            t.death_idx = end
        elif k in dropped and t.kind == "saved":
            t.kind = "activation"
            t.death_idx = max(t.birth_idx, last_f[k] if last_f[k] is not None else t.birth_idx)
            t.freed_by = f"f:{fw[t.death_idx].name}"
        elif t.kind == "saved":
            t.death_idx = nf - 1  # extended below by its backward uses
        elif t.kind == "output":
            t.death_idx = nf - 1  # user outputs go to the loss, outside these graphs
        elif t.freed_by:
            t.freed_by = f"f:{t.freed_by}"
    for j, t in enumerate(tb):
        t2 = Tensor(**asdict(t))
        t2.birth_idx, t2.death_idx = t.birth_idx + nf, t.death_idx + nf
        if t.kind in ("input", "parameter"):
            k = names_f.get(t.name)
            if k is not None:  # the forward's storage, passed by name
                f = merged[k]
                if k in dropped:
                    first = _first_use_of(bw, names_b, j)
                    if first is not None:
                        # Checkpointing re-runs the module's forward once, when the backward first
                        # needs any of its activations: all of them are born then.
                        t2.kind = "recomputed"
                        t2.birth_idx = nf + min(first, recompute_at)
                        t2.death_idx = nf + (last_b[j] if last_b[j] is not None else first)
                        t2.freed_by = f"b:{bw[t2.death_idx - nf].name}"
                        merged.append(t2)
                    continue
                if f.kind == "saved" and last_b[j] is not None and nf + last_b[j] > f.death_idx:
                    f.death_idx = nf + last_b[j]
                    f.freed_by = f"b:{bw[last_b[j]].name}"
                continue
            t2.kind = "input"  # tangents
        elif t2.freed_by:
            t2.freed_by = f"b:{t2.freed_by}"
        merged.append(t2)
    if itemsize_of is not None:
        for t in merged:
            t.size_bytes = itemsize_of(t)
    names = [f"f:{n.name}" for n in fw] + [f"b:{n.name}" for n in bw]
    modules = [mod_f.get(n.idx) for n in fw] + [mod_b.get(n.idx) for n in bw]
    curve = _finish([forward_id, backward_id], names, modules, merged)
    curve.saved = [{"name": t.name, "size_bytes": t.size_bytes, "module_path": t.module_path, "freed_by": t.freed_by}
                   for t in merged if t.kind == "saved"]
    curve.saved_bytes_by_module = _sum_by_module(curve.saved)
    return curve


def _first_use_of(nodes: list[_N], names: dict[str, int], storage: int) -> int | None:
    members = {n.idx for n in nodes if names.get(n.name) == storage}
    for i, n in enumerate(nodes):
        if n.op != "output" and any(s in members for s in n.inputs):
            return i
    return None


def _sum_by_module(saved: list[dict]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for s in saved:
        out[s["module_path"] or "(no module)"] += s["size_bytes"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _module_resolver(session: Session, graph: Graph, nodes: list[_N], forward: list[_N] | None = None
                     ) -> dict[int, str | None]:
    """Node idx → module path; a backward node without one takes the forward node's with the same
    ``seq_nr`` (the op whose gradient it computes), else its first input's."""
    if graph.kind == "aot_backward" and forward is None:
        try:
            fw_id, _ = forward_backward_pair(session, graph.id)
            forward = _load(session, fw_id)
        except NotFoundError:
            forward = []
    by_seq = {}
    for n in forward or []:
        if n.seq_nr is not None and n.module_path and n.seq_nr not in by_seq:
            by_seq[n.seq_nr] = n.module_path
    paths: dict[int, str | None] = {}
    for n in nodes:  # graph order, so a node's first input is resolved before it
        path = n.module_path or (by_seq.get(n.seq_nr) if n.seq_nr is not None else None)
        if path is None and n.inputs:
            path = paths.get(n.inputs[0])
        paths[n.idx] = path
    return paths


# ------------------------------------------------------------------------------------ what-if
@dataclass
class Estimate:
    what: str
    baseline_peak_bytes: int
    estimated_peak_bytes: int
    saved_bytes_removed: int = 0
    recompute_nodes: int = 0
    note: str = ""

    @property
    def saving_bytes(self) -> int:
        return self.baseline_peak_bytes - self.estimated_peak_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "saving_bytes": self.saving_bytes}


def checkpoint_estimate(session: Session, forward_id: int, backward_id: int, module_path: str) -> Estimate:
    """Activation checkpointing of ``module_path`` (a module path prefix, ``"transformer/h/0"``):
    its saved activations are no longer held between forward and backward (inputs to the module
    from outside it stay saved), and its forward nodes run again in the backward.

    Raises:
        UsageError: no saved activation belongs to that module.
    """
    base = step_memory(session, forward_id, backward_id)
    fw = _load(session, forward_id)
    mod = _module_resolver(session, _graph(session, forward_id), fw)
    inside = [n for n in fw if n.op not in ("placeholder", "output") and _under(mod.get(n.idx), module_path)]
    drop = {s["name"] for s in base.saved if _under(s["module_path"], module_path)}
    if not drop:
        raise UsageError(f"no saved activation of the forward graph belongs to module {module_path!r}; "
                         f"modules with saved activations: {', '.join(list(base.saved_bytes_by_module)[:12])}")
    est = step_memory(session, forward_id, backward_id, drop_saved=drop)
    removed = sum(s["size_bytes"] for s in base.saved if s["name"] in drop)
    return Estimate(what=f"checkpoint {module_path}", baseline_peak_bytes=base.peak_bytes,
                    estimated_peak_bytes=est.peak_bytes, saved_bytes_removed=removed, recompute_nodes=len(inside),
                    note=f"{len(drop)} saved activations recomputed in backward")


def dtype_estimate(session: Session, forward_id: int, backward_id: int, dtype: str = "bfloat16") -> Estimate:
    """Activations (not parameters, not integer tensors) stored in ``dtype`` instead: new peak.

    Raises:
        UsageError: unknown dtype.
    """
    if dtype not in ITEMSIZE:
        raise UsageError(f"unknown dtype {dtype!r}; one of {', '.join(sorted(ITEMSIZE))}")
    new = ITEMSIZE[dtype]
    floats = {"float64", "float32", "float16", "bfloat16"}

    def rescale(t: Tensor) -> int:
        if t.kind == "parameter" or t.dtype not in floats:
            return t.size_bytes
        return t.size_bytes * new // ITEMSIZE[t.dtype]

    base = step_memory(session, forward_id, backward_id)
    est = step_memory(session, forward_id, backward_id, itemsize_of=rescale)
    return Estimate(what=f"activations in {dtype}", baseline_peak_bytes=base.peak_bytes,
                    estimated_peak_bytes=est.peak_bytes)


def _under(path: str | None, prefix: str) -> bool:
    if not path:
        return False
    p = prefix.strip("/").replace(".", "/")
    return path == p or path.startswith(p + "/")


# ------------------------------------------------------------------------------------ measured
def measured_from_trace(session: Session, trace_id: int) -> dict:
    """Measured memory over time from a Kineto trace's ``[memory]`` instant events
    (``profile_memory=True``): per device (``"<Device Type>:<Device Id>"``), ``ts_ns`` and
    ``total_allocated_bytes`` lists and the peak. ``Total Allocated`` where the event has it,
    else the running sum of ``Bytes`` (allocations positive, frees negative).

    Raises:
        NotFoundError: the trace has no ``[memory]`` events.
    """
    from graphdeck.store.schema import Trace, TraceEvent

    if session.get(Trace, trace_id) is None:
        raise NotFoundError(f"trace {trace_id} not found", resource="trace", id=trace_id)
    name_id = session.scalar(select(InternedString.id).where(InternedString.value == "[memory]"))
    if name_id is None:
        raise NotFoundError(f"trace {trace_id} has no [memory] events (profile with profile_memory=True)")
    series: dict[str, dict] = {}
    running: dict[str, int] = defaultdict(int)
    for ts, args in session.execute(select(TraceEvent.ts_ns, TraceEvent.args_json)
                                    .where(TraceEvent.trace_id == trace_id, TraceEvent.name_id == name_id)
                                    .order_by(TraceEvent.ts_ns, TraceEvent.id)):
        a = json.loads(args or "{}")
        dev = f"{a.get('Device Type', '?')}:{a.get('Device Id', '?')}"
        running[dev] += int(a.get("Bytes") or 0)
        # Older traces (2021) carry only the signed ``Bytes`` of each (de)allocation: the total
        # is then their running sum since the profiler started.
        total = a.get("Total Allocated", running[dev])
        s = series.setdefault(dev, {"ts_ns": [], "total_allocated_bytes": []})
        s["ts_ns"].append(ts)
        s["total_allocated_bytes"].append(int(total))
    if not series:
        raise NotFoundError(f"trace {trace_id} has no [memory] events")
    for s in series.values():
        s["peak_bytes"] = max(s["total_allocated_bytes"])
        s["min_bytes"] = min(s["total_allocated_bytes"])
    return series



#: Category names of ``torch.profiler`` memory timelines, in the index order of
#: ``export_memory_timeline_raw`` (torch/profiler/_memory_profiler.py: ``_CATEGORY_TO_INDEX``).
TIMELINE_CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
                       "autograd_detail", "unknown")


def read_memory_timeline_raw(path) -> dict:
    """Measured memory from a ``profile.export_memory_timeline_raw`` file (JSON list of
    ``[timestamp_ns, action, bytes, category index]``; ``.gz`` accepted), streamed with ijson.

    Actions 1 (pre-existing) and 2 (create) add ``bytes``; 3 (version bump) comes as a ``-n``/``+n``
    pair; 4 (destroy) carries ``-n``. Pre-existing tensors have timestamp -1 and are placed at the
    first real time. Returns ``ts_ns`` and ``total_bytes`` (running sum after each event), the
    peak, and ``by_category_at_peak``.

    Raises:
        BadInputError: the file is not such a list.
    """
    import gzip

    import ijson

    from graphdeck.errors import BadInputError

    opener = gzip.open if str(path).endswith(".gz") else open
    ts_ns: list[int] = []
    total: list[int] = []
    cats = [0] * len(TIMELINE_CATEGORIES)
    running, peak, peak_cats, peak_ts = 0, 0, list(cats), None
    first_real = None
    try:
        with opener(path, "rb") as f:
            for item in ijson.items(f, "item"):
                if not (isinstance(item, list) and len(item) == 4):
                    raise BadInputError(f"{path}: not an export_memory_timeline_raw event: {str(item)[:80]}")
                t, _action, n, c = (int(x) for x in item)
                if t >= 0 and first_real is None:
                    first_real = t
                running += n
                cats[c if 0 <= c < len(cats) else len(cats) - 1] += n
                ts_ns.append(t)
                total.append(running)
                if running > peak:
                    peak, peak_cats, peak_ts = running, list(cats), t
    except ijson.JSONError as exc:
        raise BadInputError(f"{path}: not JSON, or cut short ({exc}); {len(total)} events read") from exc
    if not total:
        raise BadInputError(f"{path}: no [timestamp, action, bytes, category] events (not an "
                            "export_memory_timeline_raw file)")
    ts_ns = [first_real if (t < 0 and first_real is not None) else t for t in ts_ns]
    return {"ts_ns": ts_ns, "total_bytes": total, "peak_bytes": peak,
            "peak_ts_ns": first_real if (peak_ts is not None and peak_ts < 0) else peak_ts,
            "by_category_at_peak": dict(zip(TIMELINE_CATEGORIES, peak_cats))}
