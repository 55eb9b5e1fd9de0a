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
  the backward graph's last use of them (without descriptors: the outputs a backward placeholder
  names);
* ``recomputed`` — (checkpoint what-if) a dropped saved activation born again in the backward.

``step_memory`` chains a forward graph and its backward graph into one step curve; saved
activations then live from their forward producer to their last backward use, and the backward
node that frees each is reported. ``checkpoint_estimate`` and ``dtype_estimate`` answer what-if
questions from the same model. The model counts tensor bytes (``numel × itemsize``); it does not
model the allocator's caching, rounding or fragmentation, nor workspace memory of kernels. Where
the captured graphs are the graphs that run (eager execution of the partitioned graphs) the step
peak and the checkpoint estimate equal the profiler's CPU measurement; Inductor fuses and reuses
buffers, so its measured peaks are lower (17-27% on GPT-2; see bench/RESULTS.md "Memory view"):
for an Inductor run, :mod:`graphdeck.analysis.memory.inductor` models the step from the generated
code's own buffers instead (NOTE: [Inductor buffer model]).

The hot path works on column arrays (numpy) rather than one object per node: 100k-node graphs
take about as long as fetching their rows.

Pure: reads the store, returns data; the server, CLI and dashboard render it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory.names import (  # noqa: F401 (re-exported: callers and tests import them here)
    ALIAS_OPS,
    CAST_OPS,
    DTYPE_ALIASES,
    ITEMSIZE,
    canonical_dtype,
    op_name,
)
from graphdeck.errors import NotFoundError
from graphdeck.store.schema import Graph, InternedString

#: ``Tensor.kind`` values; storages carry the index into this tuple.
KINDS = ("parameter", "input", "activation", "output", "saved", "recomputed")
_PARAM, _INPUT, _ACT, _OUT, _SAVED, _RECOMP = range(len(KINDS))
#: Node op codes of the column arrays (``_Cols.op``).
_OP_OTHER, _OP_PLACEHOLDER, _OP_OUTPUT, _OP_CALL = range(4)


@dataclass(slots=True)
class Tensor:
    """One storage: born at node ``birth_idx``, last read at ``death_idx`` (graph positions)."""

    name: str  # producing node
    birth_idx: int
    death_idx: int
    size_bytes: int
    dtype: str | None
    kind: str  # parameter | input | activation | output | saved | recomputed
    module_path: str | None
    freed_by: str | None = None  # node whose execution ends its life (None: held past the graph)


@dataclass
class Holder:
    module_path: str
    size_bytes: int
    tensors: int
    by_kind: dict[str, int]


class _Storages:
    """Storages as columns, index = storage number (allocation order).

    ``birth``/``death``/``size``/``kind`` are int64/int8 arrays (``kind`` indexes :data:`KINDS`);
    ``name``/``dtype``/``module``/``freed_by`` are sequences indexed by storage number (lazy
    views over the node columns on the one-graph path, plain lists on the step path).
    """

    __slots__ = ("birth", "death", "size", "kind", "name", "dtype", "module", "freed_by")

    def __init__(self, birth, death, size, kind, name, dtype, module, freed_by):
        self.birth, self.death, self.size, self.kind = birth, death, size, kind
        self.name, self.dtype, self.module, self.freed_by = name, dtype, module, freed_by

    def __len__(self) -> int:
        return len(self.birth)

    def tensor(self, k: int) -> Tensor:
        return Tensor(name=self.name[k], birth_idx=int(self.birth[k]), death_idx=int(self.death[k]),
                      size_bytes=int(self.size[k]), dtype=self.dtype[k], kind=KINDS[self.kind[k]],
                      module_path=self.module[k], freed_by=self.freed_by[k])

    def tensors(self) -> list[Tensor]:
        return [self.tensor(k) for k in range(len(self))]

    @classmethod
    def from_tensors(cls, tensors: list[Tensor]) -> _Storages:
        return cls(np.array([t.birth_idx for t in tensors], dtype=np.int64),
                   np.array([t.death_idx for t in tensors], dtype=np.int64),
                   np.array([t.size_bytes for t in tensors], dtype=np.int64),
                   np.array([KINDS.index(t.kind) for t in tensors], dtype=np.int8),
                   [t.name for t in tensors], [t.dtype for t in tensors], [t.module_path for t in tensors],
                   [t.freed_by for t in tensors])


class _Take:
    """``seq[index[k]]`` without building the list (per-storage view of a per-node column)."""

    __slots__ = ("seq", "index")

    def __init__(self, seq, index):
        self.seq, self.index = seq, index

    def __getitem__(self, k):
        return self.seq[self.index[k]]

    def __len__(self):
        return len(self.index)


class _FreedBy:
    """Per storage: the node at its death for an activation, else ``None``."""

    __slots__ = ("names", "death", "kind")

    def __init__(self, names, death, kind):
        self.names, self.death, self.kind = names, death, kind

    def __getitem__(self, k):
        return self.names[self.death[k]] if self.kind[k] == _ACT else None

    def __len__(self):
        return len(self.death)


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
    recomputation: dict | None = None  # recomputed tensors at the peak (recompute.py; aot_backward only)
    storages: _Storages | None = field(default=None, repr=False, compare=False)

    @property
    def tensors(self) -> list[Tensor]:
        """Every storage as a :class:`Tensor` (built on first use: 100k-node graphs have ~75k)."""
        cached = getattr(self, "_tensor_list", None)
        if cached is None:
            cached = self.storages.tensors() if self.storages is not None else []
            self._tensor_list = cached
        return cached

    def to_dict(self, *, with_tensors: bool = False) -> dict:
        out = {"graph_ids": list(self.graph_ids), "nodes": list(self.nodes), "modules": list(self.modules),
               "live_bytes": list(self.live_bytes), "peak_bytes": self.peak_bytes, "peak_index": self.peak_index,
               "peak_node": self.peak_node, "holders": [asdict(h) for h in self.holders],
               "by_kind_at_peak": dict(self.by_kind_at_peak), "saved": [dict(s) for s in self.saved],
               "saved_bytes_by_module": dict(self.saved_bytes_by_module), "recomputation": self.recomputation}
        if with_tensors:
            out["tensors"] = [asdict(t) for t in self.tensors]
        return out

    def top_holders(self, n: int = 10) -> list[Holder]:
        return self.holders[:n]


# ------------------------------------------------------------------------------------ loading
@dataclass(slots=True)
class _Cols:
    """One stored graph as columns; position ``i`` is the ``i``-th node in graph order.

    Integer columns are int64 arrays with ``-1`` for NULL (``size`` uses 0); ``op`` holds the
    ``_OP_*`` codes. Edges are kept in (consumer, argument) order as producer/consumer positions
    (``src`` is ``-1`` where the producer is not a node of this graph); ``first_in[i]`` is the
    producer of node ``i``'s first input edge (``-1``: none).
    """

    idx: np.ndarray
    names: list[str]
    op: np.ndarray
    target: np.ndarray
    size: np.ndarray
    dtypes: list[str | None]
    module: np.ndarray
    seq: np.ndarray
    io: dict[int, tuple[str | None, str | None]]  # position -> (desc, param_fqn), placeholders/output
    text: dict[int, str]  # interned id -> text
    src: np.ndarray
    dst: np.ndarray
    first_in: np.ndarray
    same_cast: set[int] = field(default_factory=set)  # positions of CAST_OPS nodes that change nothing

    @property
    def n(self) -> int:
        return len(self.names)

    def inputs_of(self, pos: int) -> list[int]:
        """Producer positions of node ``pos``'s input edges, in argument order."""
        return self.src[self.dst == pos].tolist()

    def module_paths(self, ids: np.ndarray) -> list[str | None]:
        get = self.text.get
        return [get(i) for i in ids.tolist()]


#: dtype names coded inside the packed node column (code = position; 0 = NULL, 31 = any other,
#: read as text in a second query).
_DTYPE_CODES = (None, "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")
_DTYPE_OTHER = 31
_SEQ_LIMIT = 1 << 32


def _load(session: Session, graph_id: int) -> _Cols:
    # Plain DB-API rows: on 100k-node graphs SQLAlchemy's per-row processing was most of the
    # time, and what remains is the driver making one Python object per value. So the integers
    # come packed, 2 per column: (target id, dtype code, op code) and (module path id, seq_nr);
    # ``idx`` is read only when a graph's positions are not 0..n-1. Interned strings (targets,
    # module paths) are looked up once per distinct id; ``desc``/``param_fqn`` only for
    # placeholders and the output node.
    dtype_case = " ".join(f"WHEN '{d}' THEN {k}" for k, d in enumerate(_DTYPE_CODES) if d)
    packed_1 = (f"(CAST(COALESCE(target_id, -1) + 1 AS BIGINT) * 32 + (CASE WHEN dtype IS NULL THEN 0 ELSE CASE dtype {dtype_case} "
                f"ELSE {_DTYPE_OTHER} END END)) * 4 + (CASE op WHEN 'placeholder' THEN 1 WHEN 'output' THEN 2 "
                "WHEN 'call_function' THEN 3 WHEN 'call_method' THEN 3 ELSE 0 END)")
    packed_2 = (f"CAST(COALESCE(module_path_id, -1) + 1 AS BIGINT) * {_SEQ_LIMIT} + (CASE WHEN seq_nr >= 0 AND seq_nr < "
                f"{_SEQ_LIMIT - 1} THEN seq_nr + 1 ELSE 0 END)")
    sql_span = "SELECT COUNT(*), MIN(idx), MAX(idx) FROM nodes WHERE graph_id = {p}"
    sql_nodes = ("SELECT {idx}name, " + packed_1 + ", COALESCE(size_bytes, 0), " + packed_2 +
                 " FROM nodes WHERE graph_id = {p} ORDER BY idx")
    sql_dtypes = "SELECT idx, dtype FROM nodes WHERE graph_id = {p} AND dtype IS NOT NULL ORDER BY idx"
    sql_io = ('SELECT idx, "desc", param_fqn FROM nodes WHERE graph_id = {p} '
              "AND op IN ('placeholder', 'output')")
    sql_edges = ("SELECT (src_idx + 1) * 4294967296 + dst_idx FROM edges WHERE graph_id = {p} "
                 "AND dst_idx >= 0 ORDER BY id")  # (dst, arg_pos) order
    conn = session.connection()
    if conn.dialect.name == "sqlite":
        raw = conn.connection.driver_connection

        def run(sql, **fmt):
            return raw.execute(sql.format(p="?", **fmt), (graph_id,))
    else:
        def run(sql, **fmt):
            return conn.exec_driver_sql(sql.format(p="%(g)s", **fmt), {"g": graph_id})
    n, lo, hi = run(sql_span).fetchone()
    contiguous = not n or (lo == 0 and hi == n - 1)  # idx is unique per graph
    rows = run(sql_nodes, idx="" if contiguous else "idx, ").fetchall()
    cols = list(zip(*rows)) if rows else [()] * (4 if contiguous else 5)
    del rows
    if contiguous:
        idx = np.arange(len(cols[0]), dtype=np.int64)
    else:
        idx = np.array(cols[0], dtype=np.int64)
        cols = cols[1:]
    names = list(cols[0])
    p1 = np.array(cols[1], dtype=np.int64)
    size = np.array(cols[2], dtype=np.int64)
    p2 = np.array(cols[3], dtype=np.int64)
    del cols
    n = len(names)
    op = (p1 & 3).astype(np.int8)
    codes = (p1 >> 2) & 31
    target = (p1 >> 7) - 1
    module = (p2 >> 32) - 1
    seq = (p2 & (_SEQ_LIMIT - 1)) - 1
    table = np.array(_DTYPE_CODES + (None,) * (32 - len(_DTYPE_CODES)), dtype=object)
    dtypes = table[codes].tolist()

    def positions(raw_idx: np.ndarray) -> np.ndarray:
        if contiguous:
            return np.where((raw_idx >= 0) & (raw_idx < n), raw_idx, -1)
        if not n:
            return np.full(len(raw_idx), -1, dtype=np.int64)
        p = np.minimum(np.searchsorted(idx, raw_idx), n - 1)
        return np.where(idx[p] == raw_idx, p, -1)

    if (codes == _DTYPE_OTHER).any():
        other = run(sql_dtypes).fetchall()
        for p, (_, d) in zip(positions(np.array([r[0] for r in other], dtype=np.int64)).tolist(), other):
            if p >= 0 and codes[p] == _DTYPE_OTHER:
                dtypes[p] = d
    ids = set(np.unique(target).tolist()) | set(np.unique(module).tolist())
    ids.discard(-1)
    text: dict[int, str] = {}
    chunk = sorted(ids)
    for k in range(0, len(chunk), 20000):  # bound the IN list (SQLite's host-parameter limit)
        text.update(session.execute(select(InternedString.id, InternedString.value)
                                    .where(InternedString.id.in_(chunk[k:k + 20000]))).all())
    # An unknown or empty module path is no module path.
    no_path = [i for i in np.unique(module).tolist() if i != -1 and not text.get(i)]
    if no_path:
        module[np.isin(module, no_path)] = -1
    io_rows = run(sql_io).fetchall()
    io_pos = positions(np.array([r[0] for r in io_rows], dtype=np.int64)).tolist()
    io = {p: (r[1], r[2]) for p, r in zip(io_pos, io_rows) if p >= 0}
    packed = np.array(run(sql_edges).fetchall(), dtype=np.int64).reshape(-1)
    src = positions((packed >> 32) - 1)
    dst = positions(packed & 0xFFFFFFFF)
    keep = dst >= 0
    if not keep.all():
        src, dst = src[keep], dst[keep]
    first_in = np.full(n, -1, dtype=np.int64)
    if len(dst):
        heads, first_edge = np.unique(dst, return_index=True)
        first_in[heads] = src[first_edge]
    return _Cols(idx=idx, names=names, op=op, target=target, size=size, dtypes=dtypes, module=module, seq=seq,
                 io=io, text=text, src=src, dst=dst, first_in=first_in,
                 same_cast=_same_casts(run, idx, op, target, size, dtypes, text, first_in))


def _same_casts(run, idx, op, target, size, dtypes, text, first_in) -> set[int]:
    """Positions of :data:`CAST_OPS` nodes whose output has its first input's dtype, bytes and
    device: the cast returns the input itself. Devices are read only for those candidates."""
    cast_ids = [t for t in np.unique(target[op == _OP_CALL]).tolist() if op_name(text.get(t, "")) in CAST_OPS]
    if not cast_ids:
        return set()
    cand = [i for i in np.flatnonzero(np.isin(target, cast_ids) & (op == _OP_CALL) & (first_in >= 0)).tolist()
            if dtypes[i] is not None and dtypes[i] == dtypes[first_in[i]] and size[i] == size[first_in[i]]]
    if not cand:
        return set()
    wanted = sorted({int(idx[i]) for i in cand} | {int(idx[first_in[i]]) for i in cand})
    device: dict[int, str | None] = {}
    for k in range(0, len(wanted), 900):  # bound the IN list (SQLite's host-parameter limit)
        part = ", ".join(str(v) for v in wanted[k:k + 900])  # integers from the store, not user text
        device.update(run("SELECT idx, device FROM nodes WHERE graph_id = {p} AND idx IN (" + part + ")").fetchall())
    return {i for i in cand if device.get(int(idx[i])) == device.get(int(idx[first_in[i]]))}


def _graph(session: Session, graph_id: int) -> Graph:
    g = session.get(Graph, graph_id)
    if g is None:
        raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
    return g


def _output_pos(c: _Cols) -> int | None:
    outs = np.flatnonzero(c.op == _OP_OUTPUT)
    return int(outs[-1]) if len(outs) else None


def _saved_positions(c: _Cols) -> list[int]:
    """Positions of the forward outputs AOTAutograd saves for backward, in output order."""
    o = _output_pos(c)
    desc = c.io.get(o, (None, None))[0] if o is not None else None
    if not desc:
        return []
    try:
        descs = json.loads(desc)
    except ValueError:
        return []
    inputs = c.inputs_of(o)
    out = []
    for k, d in enumerate(descs if isinstance(descs, list) else []):
        text = d.get("repr") if isinstance(d, dict) else str(d)
        if text and text.startswith("SavedForBackwards") and k < len(inputs) and inputs[k] >= 0:
            out.append(inputs[k])
    return out


def _saved_by_name(fw: _Cols, bw: _Cols) -> list[int]:
    """Forward outputs that a backward placeholder names: the saved activations when the forward
    graph's output carries no AOT descriptors (seen on graphs with a checkpointed region)."""
    o = _output_pos(fw)
    if o is None:
        return []
    wanted = {bw.names[p] for p in np.flatnonzero(bw.op == _OP_PLACEHOLDER).tolist()}
    return [p for p in fw.inputs_of(o) if p >= 0 and fw.names[p] in wanted and fw.op[p] != _OP_PLACEHOLDER]


# ------------------------------------------------------------------------------------ liveness
@dataclass(slots=True)
class _Live:
    """One graph's storages (see :class:`_Storages`) plus, per node, its storage number
    (``storage_of``, -1: none; views share their base's) and, per storage, its real last use
    (``last``: position of the last non-output node reading it or a view of it, -1: never)."""

    st: _Storages
    storage_of: np.ndarray
    last: np.ndarray
    end: int


def _liveness(c: _Cols, mods: list[str | None], *, saved: list[int] = ()) -> _Live:
    """Storages of one graph, in one pass over column arrays.

    ``death`` is where the graph lets go: the last use for intermediates, the graph's end for
    placeholders and outputs. A storage any of whose nodes is at a position in ``saved`` is
    ``saved``.
    """
    n = c.n
    pos = np.arange(n, dtype=np.int64)
    # Few distinct targets: classify each once, not once per node.
    call_targets = np.unique(c.target[c.op == _OP_CALL]).tolist()
    alias_ids = [t for t in call_targets if op_name(c.text.get(t, "")) in ALIAS_OPS]
    is_alias = np.isin(c.target, alias_ids) & (c.op != _OP_PLACEHOLDER) & (c.op != _OP_OUTPUT)
    if c.same_cast:
        is_alias[list(c.same_cast)] = True
    # An alias whose first input was produced earlier shares that input's storage, if it has one.
    via = is_alias & (c.first_in >= 0) & (c.first_in < pos)
    root = np.where((c.size > 0) & (c.op != _OP_OUTPUT) & ~via, pos, -1)
    chained = np.flatnonzero(via)
    if len(chained):
        r = root.tolist()
        for i, f, s in zip(chained.tolist(), c.first_in[chained].tolist(), c.size[chained].tolist()):
            base = r[f]
            r[i] = base if base >= 0 else (i if s > 0 else -1)
        root = np.array(r, dtype=np.int64)
    alloc = np.flatnonzero(root == pos)  # allocating nodes, in graph order = storage numbers
    number = np.full(n + 1, -1, dtype=np.int64)
    number[alloc] = np.arange(len(alloc), dtype=np.int64)
    storage_of = number[root]  # root -1 reads number[-1] == -1
    # Last use: the largest consumer position over every edge into a storage (the output node's
    # edges excluded: returning a tensor is not a use inside the graph).
    last = np.full(len(alloc), -1, dtype=np.int64)
    ok = (c.src >= 0) & (c.op[c.dst] != _OP_OUTPUT)
    s = storage_of[c.src[ok]]
    d = c.dst[ok]
    m = s >= 0
    np.maximum.at(last, s[m], d[m])
    kind = np.full(len(alloc), _ACT, dtype=np.int8)
    placeholders = np.flatnonzero(c.op[alloc] == _OP_PLACEHOLDER)
    for k in placeholders.tolist():
        kind[k] = _PARAM if c.io.get(int(alloc[k]), (None, None))[1] else _INPUT
    act = kind == _ACT
    returned = np.zeros(len(alloc), dtype=bool)
    o = _output_pos(c)
    if o is not None:
        ret = storage_of[[p for p in c.inputs_of(o) if p >= 0]]
        returned[ret[ret >= 0]] = True
    if len(saved):
        sv = storage_of[np.asarray(list(saved), dtype=np.int64)]
        is_saved = np.zeros(len(alloc), dtype=bool)
        is_saved[sv[sv >= 0]] = True
        kind[act & is_saved] = _SAVED
        kind[act & ~is_saved & returned] = _OUT
    else:
        kind[act & returned] = _OUT
    act = kind == _ACT
    end = n - 1
    death = np.where(act, np.maximum(alloc, last), end)  # held for the whole graph (saved: and into the backward)
    st = _Storages(alloc, death, c.size[alloc], kind, _Take(c.names, alloc), _Take(c.dtypes, alloc),
                   _Take(mods, alloc), _FreedBy(c.names, death, kind))
    return _Live(st=st, storage_of=storage_of, last=last, end=end)


def _curve(n_positions: int, st: _Storages) -> np.ndarray:
    """Live bytes after each position: running sum of +size at birth, -size after death."""
    delta = np.zeros(n_positions + 1, dtype=np.int64)
    np.add.at(delta, st.birth, st.size)
    np.subtract.at(delta, st.death + 1, st.size)
    return np.cumsum(delta[:n_positions])


def _holders(st: _Storages, at: int) -> tuple[list[Holder], dict[str, int]]:
    by_mod: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "n": 0, "kinds": defaultdict(int)})
    kinds: dict[str, int] = defaultdict(int)
    live = np.flatnonzero((st.birth <= at) & (st.death >= at))
    for k, size, kd in zip(live.tolist(), st.size[live].tolist(), st.kind[live].tolist()):
        name = KINDS[kd]
        m = by_mod[st.module[k] or "(no module)"]
        m["bytes"] += size
        m["n"] += 1
        m["kinds"][name] += size
        kinds[name] += size
    holders = [Holder(module_path=k, size_bytes=v["bytes"], tensors=v["n"], by_kind=dict(v["kinds"]))
               for k, v in by_mod.items()]
    holders.sort(key=lambda h: (-h.size_bytes, h.module_path))
    return holders, dict(kinds)


def _finish(graph_ids, names, modules, st: _Storages) -> MemoryCurve:
    live = _curve(len(names), st)
    peak_index = int(np.argmax(live)) if len(live) else 0  # the first position of the maximum
    holders, kinds = _holders(st, peak_index)
    return MemoryCurve(graph_ids=graph_ids, nodes=names, modules=modules, live_bytes=live.tolist(),
                       peak_bytes=int(live[peak_index]) if len(live) else 0, peak_index=peak_index,
                       peak_node=names[peak_index] if names else "", holders=holders, by_kind_at_peak=kinds,
                       storages=st)


def graph_memory(session: Session, graph_id: int) -> MemoryCurve:
    """Liveness of one stored graph: live bytes per node, the peak, holders at the peak.

    Raises:
        NotFoundError: no graph ``graph_id``.
    """
    from graphdeck.analysis.memory.step import _module_ids

    graph = _graph(session, graph_id)
    c = _load(session, graph_id)
    saved = _saved_positions(c) if graph.kind == "aot_forward" else []
    mods = c.module_paths(_module_ids(session, graph, c))
    live = _liveness(c, mods, saved=saved)
    curve = _finish([graph_id], c.names, mods, live.st)
    if saved:
        st = live.st
        curve.saved = [{"name": st.name[k], "size_bytes": int(st.size[k]), "module_path": st.module[k],
                        "freed_by": None} for k in np.flatnonzero(st.kind == _SAVED).tolist()]
        curve.saved_bytes_by_module = _sum_by_module(curve.saved)
    if graph.kind == "aot_backward":
        from graphdeck.analysis.memory.recompute import recomputation_at_peak

        curve.recomputation = recomputation_at_peak(session, curve, graph_id)
    return curve


def _sum_by_module(saved: list[dict]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for s in saved:
        out[s["module_path"] or "(no module)"] += s["size_bytes"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# The step model, the what-if estimates and the measured series live in their own modules, still
# importable from here (PEP 562: loaded on first use, so either module may be imported first).
_MOVED = {"step_memory": "step", "forward_backward_pair": "step", "_module_ids": "step",
          "Estimate": "estimates", "checkpoint_estimate": "estimates",
          "dtype_estimate": "estimates", "TIMELINE_CATEGORIES": "profiler",
          "measured_from_trace": "profiler", "read_memory_timeline_raw": "profiler"}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"graphdeck.analysis.memory.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
