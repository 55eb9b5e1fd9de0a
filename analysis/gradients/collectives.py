"""Collectives inside captured graphs: is every collective waited on, and does every gradient of a
backward graph that reduces gradients in-graph (compiled autograd with ``python_reducer``, FSDP2,
user functional collectives) go through the reduction?

Functional collectives (``torch.ops._c10d_functional.all_reduce`` and friends) return a tensor
that must pass through ``_c10d_functional.wait_tensor`` before use; an un-waited result is read
before the communication finished (garbage) or never completes. Sources: the ops' names in
``torch/csrc/distributed/c10d/Functional.cpp`` (``_c10d_functional`` library).
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.report import Finding, ParamRow
from graphdeck.store.schema import Graph, InternedString, Node

REDUCE_OPS = ("all_reduce", "reduce_scatter", "all_reduce_coalesced", "reduce_scatter_tensor")
COLLECTIVE_WORDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


def _is_wait(target: str) -> bool:
    return "wait_tensor" in target


def _is_collective(target: str) -> bool:
    return ("c10d" in target or "funcol" in target or "_functional_collectives" in target) and \
        any(w in target for w in COLLECTIVE_WORDS) and not _is_wait(target)


def collective_findings(session: Session, run_id: int, rows: list[ParamRow], wrap=None) -> list[Finding]:
    """Findings for the graphs of ``run_id`` holding collectives; sets ``reduced`` on ``rows``.
    ``wrap`` (:class:`graphdeck.analysis.gradients.mesh.Wrapping`): parameters of an FSDP2 group are
    reduce-scattered by FSDP2 after the backward, outside the graph, so they need no in-graph
    reduction; a reduction on a process group the parallel layout names as a tensor-parallel
    (non-data-parallel) mesh dimension's is no gradient reduction (NOTE: [Wrapper words]).

    Graphs with one structural hash (same nodes, arguments and edges; the names of nodes aside)
    are analysed once: a 1,024-rank run holds a few distinct graphs thousands of times."""
    ids = dict(session.connection().execute(select(InternedString.id, InternedString.value).where(or_(
        *[InternedString.value.contains(w) for w in (*COLLECTIVE_WORDS, "wait_tensor", "getitem")]))).all())
    if not any(_is_collective(v) for v in ids.values()):
        return []
    coll = [k for k, v in ids.items() if _is_collective(v) or _is_wait(v)]
    conn = session.connection()
    graphs = conn.execute(select(Graph.id, Graph.rank, Graph.kind, Graph.structural_hash)
                          .where(Graph.run_id == run_id).order_by(Graph.id)).all()
    rep: dict[tuple, int] = {}  # (kind, hash) -> the first graph with it; a graph without a hash is its own
    for g in graphs:
        rep.setdefault((g.kind, g.structural_hash) if g.structural_hash else ("graph", g.id), g.id)
    reps = sorted(set(rep.values()))
    has_coll: set[int] = set()
    for start in range(0, len(reps), 500):
        has_coll.update(conn.execute(select(Node.graph_id).distinct().where(
            Node.graph_id.in_(reps[start:start + 500]), Node.target_id.in_(coll))).scalars())
    hits = [g for g in graphs if rep[(g.kind, g.structural_hash) if g.structural_hash else ("graph", g.id)]
            in has_coll]
    findings: list[Finding] = []
    row_by = {(r.rank, a): r for r in rows for a in r.aliases}
    shared: dict = {}
    grads = _grads(session, [g.id for g in hits if g.kind == "aot_backward"])
    for g in hits:
        key = (g.kind, g.structural_hash) if g.structural_hash else ("graph", g.id)
        findings += _graph_findings(session, g, ids, row_by, wrap, shared, key, rep[key], grads.get(g.id, []))
    return findings


def _grads(session: Session, graph_ids: list[int]) -> dict[int, list[tuple[str, str, int]]]:
    """graph id → ``(param fqn, node name, node position)`` of each gradient output (``graph_io``
    rows with a gradient, in their order; a name no node of the graph has is left out)."""
    from sqlalchemy import and_

    from graphdeck.store.schema import GraphIO

    out: dict[int, list[tuple[str, str, int]]] = defaultdict(list)
    for start in range(0, len(graph_ids), 500):
        for gid, fqn, name, idx in session.connection().execute(
                select(GraphIO.graph_id, GraphIO.param_fqn, GraphIO.node_name, Node.idx)
                .join(Node, and_(Node.graph_id == GraphIO.graph_id, Node.name == GraphIO.node_name))
                .where(GraphIO.graph_id.in_(graph_ids[start:start + 500]), GraphIO.direction == "grad",
                       GraphIO.has_grad.is_(True)).order_by(GraphIO.graph_id, GraphIO.id)):
            out[gid].append((fqn, name, idx))
    return out


class _Arrays:
    """One graph as numpy arrays: ``target_id`` per node, edges (``src``, ``dst``; predecessors in
    CSR form on demand), node positions by name. Read with aggregate queries (one string per column), which is
    what keeps a 10^5-node backward graph well under a second."""

    def __init__(self, session: Session, graph_id: int):
        import numpy as np

        from graphdeck.analysis.gradients.graph import fetch

        if session.get_bind().dialect.name == "postgresql":  # group_concat is SQLite's string_agg
            sql_nodes = ("SELECT string_agg(name, chr(31)), string_agg(idx::text, ','), "
                         "string_agg(target_id::text, ',') FROM nodes WHERE graph_id = ?")
            sql_edges = "SELECT string_agg(src_idx || ',' || dst_idx, ',') FROM edges WHERE graph_id = ?"
        else:
            sql_nodes = ("SELECT group_concat(name, char(31)), group_concat(idx), "
                         "group_concat(target_id) FROM nodes WHERE graph_id = ?")
            sql_edges = "SELECT group_concat(src_idx || ',' || dst_idx) FROM edges WHERE graph_id = ?"
        names, idxs, tids = fetch(session, sql_nodes, (graph_id,))[0]
        order = np.fromstring(idxs or "", sep=",", dtype=np.int64)
        self.n = n = len(order)
        self._names = (names or "").split("\x1f")
        self._order = order
        self.by_name = dict(zip(self._names, order.tolist()))
        self.target_id = np.zeros(n, dtype=np.int64)
        self.target_id[order] = np.fromstring(tids or "", sep=",", dtype=np.int64)
        (flat,) = fetch(session, sql_edges, (graph_id,))[0]
        pairs = np.fromstring(flat or "", sep=",", dtype=np.int64).reshape(-1, 2)
        ok = (pairs >= 0).all(axis=1) & (pairs < n).all(axis=1)
        self.src, self.dst = pairs[ok, 0], pairs[ok, 1]
        self._pred = None  # CSR of predecessors, built on the first walk

    def preds(self, i: int):
        if self._pred is None:
            self._pred = self._csr(self.dst, self.src, self.n)
        ptr, pred = self._pred
        return pred[ptr[i]:ptr[i + 1]].tolist()

    def name(self, i: int) -> str:
        """Name of the node at position ``i`` (rarely needed: only for findings)."""
        import numpy as np

        k = int(np.nonzero(self._order == i)[0][0])
        return self._names[k]

    @staticmethod
    def _csr(key, value, n):
        import numpy as np

        order = np.argsort(key, kind="stable")
        ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(key, minlength=n), out=ptr[1:])
        return ptr, value[order]



def _non_dp_groups(wrap) -> set[str]:
    """Process group names of the layout's mesh dimensions that are not data parallel; computed
    once per report (it reads every rank's layout record: once per graph cost ~30 s at 1,024 ranks)."""
    cached = getattr(wrap, "_non_dp_groups", None)
    if cached is not None:
        return cached
    layout = getattr(wrap, "layout", None)
    if layout is None:
        return set()
    dp = layout.dp_dims()
    out = {str(gr["name"]) for rec in layout.records.values() for m in rec.get("meshes") or [] if isinstance(m, dict)
           for gr in m.get("dim_groups") or [] if isinstance(gr, dict) and gr.get("name") and gr.get("dim") not in dp}
    try:
        wrap._non_dp_groups = out
    except AttributeError:  # a frozen / slotted wrapper: recomputed next time
        pass
    return out


class _Analysed:
    """What one distinct graph (a structural hash) gives, by node position: its arrays, which
    collectives are never waited on, and which nodes lie within reach of a gradient reduction."""

    def __init__(self, session: Session, graph_id: int, kind_: str, ids: dict[int, str], wrap=None):
        import numpy as np

        self.arr = arr = _Arrays(session, graph_id)
        kind = {k: ("wait" if _is_wait(v) else "coll" if _is_collective(v) else "getitem" if "getitem" in v else "")
                for k, v in ids.items()}
        tid = arr.target_id

        def mask(kinds) -> np.ndarray:
            keys = [k for k, v in kind.items() if v in kinds]
            return np.isin(tid, np.array(keys or [-1]))

        is_coll, is_wait, is_item = mask(("coll",)), mask(("wait",)), mask(("getitem",))
        is_reduce = np.isin(tid, np.array([k for k, v in ids.items() if kind[k] == "coll"
                                           and any(w in v for w in REDUCE_OPS)] or [-1]))
        # Waited: a collective with a wait_tensor user, or a getitem user that has one (coalesced
        # collectives return tuples). One vectorised pass over the edges per level.
        src, dst = arr.src, arr.dst
        waited = np.zeros(arr.n, dtype=bool)
        waited[src[is_wait[dst]]] = True
        item_waited = waited & is_item
        waited[src[item_waited[dst]]] = True
        self.unwaited = np.nonzero(is_coll & ~waited)[0].tolist()
        self.unwaited_target = ids.get(int(tid[self.unwaited[0]]), "?") if self.unwaited else None
        tp_groups = _non_dp_groups(wrap) if kind_ == "aot_backward" and is_reduce.any() else set()
        if kind_ == "aot_backward" and is_reduce.any() and tp_groups:
            from graphdeck.analysis.ranks.core import group_of

            for idx, args in session.execute(select(Node.idx, Node.args_json).where(
                    Node.graph_id == graph_id, Node.idx.in_(np.nonzero(is_reduce)[0].tolist()))):
                if group_of(args) in tp_groups:  # a tensor-parallel reduction, not the data-parallel one
                    is_reduce[idx] = False
        self.is_reduce = is_reduce
        self.reduces = kind_ == "aot_backward" and bool(is_reduce.any())
        self.near = None
        self.walked: dict[int, bool] = {}
        if self.reduces:
            near = is_reduce.copy()
            for _ in range(4):  # a reduction within 4 steps back, vectorised over the edges
                step = near.copy()
                step[dst[near[src]]] = True
                near = step
            self.near = near

    def reduced(self, start: int) -> bool:
        """Whether a reduction lies on the path back from node position ``start``."""
        if start not in self.walked:
            self.walked[start] = bool(self.near[start]) or _walk_back(self.arr, start, self.is_reduce)
        return self.walked[start]


def _graph_findings(session: Session, g, ids: dict[int, str], row_by: dict, wrap=None, shared: dict | None = None,
                    key=None, rep_id: int | None = None, grads: list | None = None) -> list[Finding]:
    """Findings of graph ``g`` (``id``, ``rank``, ``kind``); ``shared``/``key``/``rep_id``: the
    analysis of its distinct graph, kept across the graphs of one report (the representative
    ``rep_id`` read once); ``grads``: its gradient outputs (:func:`_grads`)."""
    shared = {} if shared is None else shared
    key = key if key is not None else ("graph", g.id)
    if key not in shared:
        shared[key] = _Analysed(session, g.id if rep_id is None else rep_id, g.kind, ids, wrap)
    an: _Analysed = shared[key]
    out: list[Finding] = []
    if an.unwaited:
        arr = an.arr if rep_id in (None, g.id) else _Arrays(session, g.id)  # this graph's own node names
        unwaited = an.unwaited
        bad = [arr.name(i) for i in unwaited[:8]]
        out.append(Finding(kind="COLLECTIVE_NOT_WAITED", severity="error", graph_id=g.id, node=bad[0],
                           ranks=[g.rank],
                           message=(f"rank {g.rank}, graph {g.id} ({g.kind}): {', '.join(bad)}"
                                    f"{' …' if len(unwaited) > 8 else ''} ({an.unwaited_target}) never "
                                    "reach a wait_tensor: the result is used before the collective completes, or "
                                    "it is never completed"),
                           fix="wait on every functional collective's result (torch.ops._c10d_functional."
                               "wait_tensor, or use the AsyncCollectiveTensor it returns) before using it"))
    if an.reduces:
        skip = {p for grp in getattr(wrap, "fsdp_groups", None) or [] for p in grp.get("params") or []}
        if grads is None:
            grads = _grads(session, [g.id]).get(g.id, [])
        out += _grad_reduction(g, an, grads, row_by, skip=skip)
    return out


def _grad_reduction(g, an: _Analysed, grads: list[tuple[str, str, int]], row_by: dict,
                    skip: set[str] = frozenset()) -> list[Finding]:
    """Each gradient output of a backward graph that reduces gradients in-graph: does an
    ``all_reduce``/``reduce_scatter`` lie on its path (:meth:`_Analysed.reduced`)? Parameters in
    ``skip`` (FSDP2's, reduced after the backward) are not required to."""
    missing = defaultdict(list)
    for fqn, node_name, start in grads:
        if fqn in skip:
            continue
        reduced = an.reduced(start)
        row = row_by.get((g.rank, fqn))
        if row is not None:
            row.reduced = reduced if row.reduced is None else (row.reduced and reduced)
        if not reduced:
            missing[fqn].append(node_name)
    if not missing:
        return []
    return [Finding(kind="GRAD_NOT_REDUCED", severity="error", graph_id=g.id, node=next(iter(missing.values()))[0],
                    params=sorted(missing), ranks=[g.rank],
                    message=(f"rank {g.rank}, backward graph {g.id} all-reduces/reduce-scatters gradients in-graph, "
                             f"but the gradients of {', '.join(sorted(missing))} never reach a reduction: "
                             "ranks will step with different weights"),
                    fix="make sure every parameter's gradient goes through the data-parallel reduction "
                        "(register it with the reducer/FSDP, or all-reduce it yourself)")]


def _walk_back(arr: _Arrays, start: int, is_reduce) -> bool:
    seen, stack = {start}, [start]
    while stack:
        for p in arr.preds(stack.pop()):
            if is_reduce[p]:
                return True
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return False
