"""One training step's graph-derived memory: a forward graph chained with its backward graph
(:func:`step_memory`), the pair found from either (:func:`forward_backward_pair`), and the module
path of every node (:func:`_module_ids`). The model and its limits: :mod:`graphdeck.analysis.memory.core`
(split from it; still importable from there).
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory.core import (
    _OP_OUTPUT,
    MemoryCurve,
    Tensor,
    _Cols,
    _finish,
    _graph,
    _liveness,
    _load,
    _saved_by_name,
    _saved_positions,
    _Storages,
    _sum_by_module,
)
from graphdeck.errors import NotFoundError
from graphdeck.store.schema import Graph


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


def _tensors(c: _Cols, mods: list[str | None], *, saved: list[int] = ()
             ) -> tuple[list[Tensor], dict[str, int], list[int | None]]:
    """:func:`_liveness` as objects: the storages, node name → storage number, per storage its
    last use (``None``: never read). For the step path (graphs of thousands of nodes)."""
    live = _liveness(c, mods, saved=saved)
    names = {nm: s for nm, s in zip(c.names, live.storage_of.tolist()) if s >= 0}
    return live.st.tensors(), names, [x if x >= 0 else None for x in live.last.tolist()]


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
    saved_pos = _saved_positions(fw) or _saved_by_name(fw, bw)
    mod_f = fw.module_paths(_module_ids(session, fw_graph, fw))
    mod_b = bw.module_paths(_module_ids(session, bw_graph, bw, forward=fw))
    tf, names_f, last_f = _tensors(fw, mod_f, saved=saved_pos)
    live_b = _liveness(bw, mod_b)
    tb = live_b.st.tensors()
    last_b = [x if x >= 0 else None for x in live_b.last.tolist()]
    nf, end = fw.n, fw.n + bw.n - 1
    dropped = {names_f[x] for x in drop_saved if x in names_f}
    merged = [Tensor(**asdict(t)) for t in tf]
    for k, t in enumerate(merged):
        if t.kind == "parameter":
            t.death_idx = end
        elif k in dropped and t.kind == "saved":
            t.kind = "activation"
            t.death_idx = max(t.birth_idx, last_f[k] if last_f[k] is not None else t.birth_idx)
            t.freed_by = f"f:{fw.names[t.death_idx]}"
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
                    first = _first_use_of(bw, live_b.storage_of, j)
                    if first is not None:
                        # The partitioner places each recomputed op just before the backward's
                        # first use of its output (measured: births spread this way match real
                        # min-cut runs; all born at the first of them overstate by 17%).
                        t2.kind = "recomputed"
                        t2.birth_idx = nf + first
                        t2.death_idx = nf + (last_b[j] if last_b[j] is not None else first)
                        t2.freed_by = f"b:{bw.names[t2.death_idx - nf]}"
                        merged.append(t2)
                    continue
                if f.kind == "saved" and last_b[j] is not None and nf + last_b[j] > f.death_idx:
                    f.death_idx = nf + last_b[j]
                    f.freed_by = f"b:{bw.names[last_b[j]]}"
                continue
            t2.kind = "input"  # tangents
        elif t2.freed_by:
            t2.freed_by = f"b:{t2.freed_by}"
        merged.append(t2)
    if itemsize_of is not None:
        for t in merged:
            t.size_bytes = itemsize_of(t)
    names = [f"f:{x}" for x in fw.names] + [f"b:{x}" for x in bw.names]
    curve = _finish([forward_id, backward_id], names, mod_f + mod_b, _Storages.from_tensors(merged))
    curve._tensor_list = merged
    curve.saved = [{"name": t.name, "size_bytes": t.size_bytes, "module_path": t.module_path, "freed_by": t.freed_by}
                   for t in merged if t.kind == "saved"]
    curve.saved_bytes_by_module = _sum_by_module(curve.saved)
    from graphdeck.analysis.memory.recompute import recomputation_at_peak

    curve.recomputation = recomputation_at_peak(session, curve, backward_id, offset=nf)
    return curve


def _first_use_of(c: _Cols, storage_of: np.ndarray, storage: int) -> int | None:
    """Position of the first non-output node that reads ``storage`` (or a view of it)."""
    hit = (c.src >= 0) & (storage_of[c.src] == storage) & (c.op[c.dst] != _OP_OUTPUT)
    return int(c.dst[hit].min()) if hit.any() else None


def _module_ids(session: Session, graph: Graph, c: _Cols, forward: _Cols | None = None) -> np.ndarray:
    """Per node the interned id of its module path (-1: none); a backward node without one takes
    the forward node's with the same ``seq_nr`` (the op whose gradient it computes), else its
    first input's (resolved the same way). Ids of forward paths are added to ``c.text``."""
    if graph.kind == "aot_backward" and forward is None:
        try:
            fw_id, _ = forward_backward_pair(session, graph.id)
            forward = _load(session, fw_id)
        except NotFoundError:
            forward = None
    mp = c.module.copy()
    if forward is not None and forward.n:
        sel = np.flatnonzero((forward.seq >= 0) & (forward.module >= 0))
        want = np.flatnonzero((mp < 0) & (c.seq >= 0))
        if len(sel) and len(want):
            seqs, first = np.unique(forward.seq[sel], return_index=True)  # first in graph order
            paths = forward.module[sel][first]
            j = np.minimum(np.searchsorted(seqs, c.seq[want]), len(seqs) - 1)
            hit = seqs[j] == c.seq[want]
            mp[want[hit]] = paths[j[hit]]
            for i in np.unique(paths[j[hit]]).tolist():
                c.text.setdefault(i, forward.text[i])
    # Missing paths follow first inputs produced earlier: pointer jumping up those chains (each
    # round halves the remaining depth) gives every node its chain head's path in O(n log depth).
    pos = np.arange(c.n, dtype=np.int64)
    parent = np.where((mp < 0) & (c.first_in >= 0) & (c.first_in < pos), c.first_in, pos)
    while True:
        nxt = parent[parent]
        if np.array_equal(nxt, parent):
            break
        parent = nxt
    return mp[parent]
