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

from graphdeck.analysis.grad_report import Finding, ParamRow
from graphdeck.store.schema import Edge, Graph, GraphIO, InternedString, Node

REDUCE_OPS = ("all_reduce", "reduce_scatter", "all_reduce_coalesced", "reduce_scatter_tensor")
COLLECTIVE_WORDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


def _is_wait(target: str) -> bool:
    return "wait_tensor" in target


def _is_collective(target: str) -> bool:
    return ("c10d" in target or "funcol" in target or "_functional_collectives" in target) and \
        any(w in target for w in COLLECTIVE_WORDS) and not _is_wait(target)


def collective_findings(session: Session, run_id: int, rows: list[ParamRow]) -> list[Finding]:
    """Findings for the graphs of ``run_id`` holding collectives; sets ``reduced`` on ``rows``."""
    ids = dict(session.execute(select(InternedString.id, InternedString.value).where(or_(
        *[InternedString.value.contains(w) for w in (*COLLECTIVE_WORDS, "wait_tensor")]))).all())
    ids = {k: v for k, v in ids.items() if _is_collective(v) or _is_wait(v)}
    if not ids:
        return []
    hits = session.execute(select(Node.graph_id).join(Graph, Graph.id == Node.graph_id)
                           .where(Graph.run_id == run_id, Node.target_id.in_(list(ids))).distinct()).all()
    findings: list[Finding] = []
    row_by = {(r.rank, a): r for r in rows for a in r.aliases}
    for (gid,) in hits:
        g = session.get(Graph, gid)
        findings += _graph_findings(session, g, ids, row_by)
    return findings


def _graph_findings(session: Session, g: Graph, coll_ids: dict[int, str], row_by: dict) -> list[Finding]:
    rows = session.execute(select(Node.idx, Node.name, Node.target_id, Node.stack_trace_id)
                           .where(Node.graph_id == g.id).order_by(Node.idx)).all()
    n = len(rows)
    users: list[list[int]] = [[] for _ in range(n)]
    preds: list[list[int]] = [[] for _ in range(n)]
    for s, d in session.execute(select(Edge.src_idx, Edge.dst_idx).where(Edge.graph_id == g.id)):
        if 0 <= s < n and 0 <= d < n:
            users[s].append(d)
            preds[d].append(s)
    target = [coll_ids.get(r.target_id, "") for r in rows]
    colls = [i for i in range(n) if _is_collective(target[i])]
    out: list[Finding] = []
    unwaited = []
    for c in colls:
        seen, stack, waited = {c}, [c], False
        while stack and not waited:
            i = stack.pop()
            for u in users[i]:
                if _is_wait(target[u]):
                    waited = True
                    break
                if u not in seen and rows[u].name != "output":
                    seen.add(u)
                    stack.append(u)
        if not waited:
            unwaited.append(c)
    if unwaited:
        names = [rows[i].name for i in unwaited]
        out.append(Finding(kind="COLLECTIVE_NOT_WAITED", severity="error", graph_id=g.id, node=names[0],
                           ranks=[g.rank],
                           message=(f"rank {g.rank}, graph {g.id} ({g.kind}): {', '.join(names)} "
                                    f"({target[unwaited[0]]}) never reach a wait_tensor: the result is used "
                                    "before the collective completes, or it is never completed"),
                           fix="wait on every functional collective's result (torch.ops._c10d_functional."
                               "wait_tensor, or use the AsyncCollectiveTensor it returns) before using it"))
    if g.kind == "aot_backward" and any(any(w in target[c] for w in REDUCE_OPS) for c in colls):
        out += _grad_reduction(session, g, rows, preds, target, row_by)
    return out


def _grad_reduction(session, g, rows, preds, target, row_by) -> list[Finding]:
    """Each gradient output of a backward graph that reduces gradients in-graph: does an
    ``all_reduce``/``reduce_scatter`` lie on its path?"""
    by_name = {r.name: r.idx for r in rows}
    grads = session.execute(select(GraphIO.param_fqn, GraphIO.node_name).where(
        GraphIO.graph_id == g.id, GraphIO.direction == "grad", GraphIO.has_grad.is_(True))).all()
    missing = defaultdict(list)
    for fqn, node_name in grads:
        start = by_name.get(node_name)
        if start is None:
            continue
        seen, stack, reduced = {start}, [start], any(w in target[start] for w in REDUCE_OPS)
        while stack and not reduced:
            i = stack.pop()
            for p in preds[i]:
                if any(w in target[p] for w in REDUCE_OPS):
                    reduced = True
                    break
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
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
