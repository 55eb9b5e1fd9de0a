"""Gradient-path report: for every parameter on every rank, does the backward graph give it a
gradient?

Inputs are the capture's bindings in ``graph_io``: a Dynamo (or DDP partition) graph placeholder
that reads a parameter (``direction="in"``), and each output of an AOTAutograd backward graph
that AOTAutograd's output descriptor names as ``GradAOTOutput(grad_of=<that input>)``
(``direction="grad"``; ``has_grad`` false when the backward graph returns ``None`` there).

Statuses (per parameter storage: tied names such as GPT-2's ``lm_head.weight`` /
``transformer.wte.weight`` are one entry with ``aliases``):

* ``OK``: some backward graph returns a gradient for it (``paths`` counts those outputs).
* ``NO_GRAD``: it requires grad and a compiled graph reads it, but every backward graph returns
  ``None`` for it (``detach``, ``no_grad`` regions, integer outputs), or no backward graph was
  produced for the graphs that read it.
* ``NOT_IN_GRAPH``: it requires grad but no compiled graph reads it (an unused sub-module, a
  branch not taken). Under DDP without ``find_unused_parameters`` this is the "Expected to have
  finished reduction in the prior iteration" error.
* ``FROZEN``: ``requires_grad`` is false.

Pure: reads the store, returns data; rendering is the server's job.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from sqlalchemy import distinct, func, select
from sqlalchemy.orm import Session

from graphdeck.store.schema import Edge, Graph, GraphIO, InternedString, Node, Param, Run

STATUSES = ("OK", "NO_GRAD", "NOT_IN_GRAPH", "FROZEN")
READ_KINDS = ("dynamo", "ddp_partition")


@dataclass
class ParamVerdict:
    rank: int
    fqn: str
    status: str
    aliases: list[str]
    paths: int
    shape: list[int]
    dtype: str
    reason: str
    graphs: list[int] = field(default_factory=list)  # graphs that read it
    grad_graphs: list[int] = field(default_factory=list)  # backward graphs that bind its gradient
    first_use: str | None = None  # source line of its first use in a compiled graph


@dataclass
class GradientReport:
    run_id: int
    run: str
    ranks: list[int]
    params: list[ParamVerdict]
    summary: dict[str, int]
    problems: list[dict]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "run": self.run, "ranks": self.ranks, "ok": self.ok,
                "summary": self.summary, "problems": self.problems,
                "params": [asdict(p) for p in self.params]}


def _last_frame(stack_trace: str | None) -> str | None:
    if not stack_trace:
        return None
    lines = [ln.strip() for ln in stack_trace.strip().splitlines() if ln.strip().startswith("File ")]
    return lines[-1] if lines else None


def gradient_report(session: Session, run: Run) -> GradientReport:
    """Build the report for ``run`` (every rank that has a parameter list)."""
    params = session.scalars(select(Param).where(Param.run_id == run.id, Param.kind == "parameter")
                             .order_by(Param.rank, Param.id)).all()
    rows = session.execute(
        select(Graph.rank, Graph.id, Graph.kind, GraphIO.direction, GraphIO.param_fqn, GraphIO.has_grad,
               GraphIO.node_name)
        .join(GraphIO, GraphIO.graph_id == Graph.id)
        .where(Graph.run_id == run.id, GraphIO.param_fqn.is_not(None))
    ).all()
    # NOTE: the parents of AOT graphs tell which compiled graphs produced no backward at all.
    graphs = session.execute(select(Graph.id, Graph.rank, Graph.kind, Graph.parent_id)
                             .where(Graph.run_id == run.id)).all()
    has_backward = {g.parent_id for g in graphs if g.kind == "aot_backward"}
    split_parents = {g.parent_id for g in graphs if g.kind == "ddp_partition"}
    uses = _uses_per_param(session, run.id, split_parents)

    storage: dict[tuple[int, str], str] = {(p.rank, p.fqn): p.storage_key for p in params}
    reads: dict[tuple[int, str], list[tuple[int, str]]] = defaultdict(list)
    grads: dict[tuple[int, str], list[tuple[int, bool]]] = defaultdict(list)
    for r in rows:
        key = (r.rank, storage.get((r.rank, r.param_fqn), r.param_fqn))
        if r.direction == "in" and r.kind in READ_KINDS:
            reads[key].append((r.id, r.node_name))
        elif r.direction == "grad":
            grads[key].append((r.id, bool(r.has_grad)))

    groups: dict[tuple[int, str], list[Param]] = defaultdict(list)
    for p in params:
        groups[(p.rank, p.storage_key)].append(p)

    verdicts: list[ParamVerdict] = []
    for (rank, skey), members in groups.items():
        head = members[0]
        aliases = [m.fqn for m in members]
        read_by = reads.get((rank, skey), [])
        grad_by = grads.get((rank, skey), [])
        read_ids = sorted({g for g, _ in read_by})
        grad_ids = sorted({g for g, _ in grad_by})
        n_grads = sum(1 for _, ok in grad_by if ok)
        # Gradient paths: the ops that consume the parameter in the compiled graphs (a tied
        # embedding/lm_head weight is consumed twice, whether both uses share a graph or not).
        paths = max(n_grads, sum(uses.get((rank, a), 0) for a in aliases)) if n_grads else 0
        if not head.requires_grad:
            status, reason = "FROZEN", "requires_grad is False"
        elif paths:
            status = "OK"
            reason = f"gradient through {paths} path(s), from {n_grads} backward output(s)" + (
                f"; tied: {', '.join(aliases)}" if len(aliases) > 1 else "")
        elif read_by:
            status = "NO_GRAD"
            no_bw = [g for g in read_ids if g not in has_backward]
            if grad_by:
                reason = (f"read by graph(s) {', '.join(map(str, read_ids))}, but backward graph(s) "
                          f"{', '.join(map(str, grad_ids))} return None for its gradient "
                          "(gradient flow is cut: detach, no_grad region or a non-differentiable op)")
            else:
                reason = (f"read by graph(s) {', '.join(map(str, read_ids))}, which produced no backward "
                          "graph for it" + (f" (no backward at all for {no_bw})" if no_bw else ""))
        else:
            status = "NOT_IN_GRAPH"
            reason = ("no compiled graph reads it (unused module or branch not taken); DDP without "
                      "find_unused_parameters=True fails with 'Expected to have finished reduction'")
        verdicts.append(ParamVerdict(rank=rank, fqn=head.fqn, status=status, aliases=aliases, paths=paths,
                                     shape=json.loads(head.shape_json), dtype=head.dtype, reason=reason,
                                     graphs=read_ids, grad_graphs=grad_ids))

    _attach_first_use(session, verdicts)
    summary = {s: 0 for s in STATUSES}
    for v in verdicts:
        summary[v.status] += 1
    problems = [{"rank": v.rank, "fqn": v.fqn, "status": v.status, "reason": v.reason, "first_use": v.first_use}
                for v in verdicts if v.status in ("NO_GRAD", "NOT_IN_GRAPH")]
    problems += _rank_divergence(verdicts)
    ranks = sorted({v.rank for v in verdicts})
    return GradientReport(run_id=run.id, run=run.name, ranks=ranks, params=verdicts, summary=summary,
                          problems=problems)


def _uses_per_param(session: Session, run_id: int, skip_graphs: set[int]) -> dict[tuple[int, str], int]:
    """(rank, parameter name) → number of distinct nodes that consume its placeholder, over the
    compiled graphs that read it (an unsplit graph whose DDP buckets are stored is skipped)."""
    q = (select(Graph.rank, Graph.id, GraphIO.param_fqn, func.count(distinct(Edge.dst_idx)))
         .join(GraphIO, GraphIO.graph_id == Graph.id)
         .join(Node, (Node.graph_id == Graph.id) & (Node.name == GraphIO.node_name))
         .join(Edge, (Edge.graph_id == Graph.id) & (Edge.src_idx == Node.idx))
         .where(Graph.run_id == run_id, Graph.kind.in_(READ_KINDS), GraphIO.direction == "in")
         .group_by(Graph.rank, Graph.id, GraphIO.param_fqn))
    out: dict[tuple[int, str], int] = defaultdict(int)
    for rank, graph_id, fqn, n in session.execute(q):
        if graph_id not in skip_graphs:
            out[(rank, fqn)] += n
    return out


def _attach_first_use(session: Session, verdicts: list[ParamVerdict]) -> None:
    """Source line (last ``File ...`` line of ``stack_trace``) of the first node using the parameter."""
    for v in verdicts:
        if not v.graphs:
            continue
        placeholder = _placeholder_of(session, v)
        if placeholder is None:
            continue
        row = session.execute(
            select(Node.idx, InternedString.value)
            .join(InternedString, InternedString.id == Node.stack_trace_id)
            .where(Node.graph_id == v.graphs[0], Node.op != "placeholder",
                   Node.args_json.contains(json.dumps({"node": placeholder})))
            .order_by(Node.idx).limit(1)
        ).first()
        if row is not None:
            v.first_use = _last_frame(row.value)


def _placeholder_of(session: Session, v: ParamVerdict) -> str | None:
    return session.scalar(select(GraphIO.node_name).where(GraphIO.graph_id == v.graphs[0],
                                                          GraphIO.direction == "in",
                                                          GraphIO.param_fqn.in_(v.aliases)).limit(1))


def _rank_divergence(verdicts: list[ParamVerdict]) -> list[dict]:
    """Parameters whose status differs by rank: DDP's buckets then never match (a hang)."""
    by_fqn: dict[str, dict[int, str]] = defaultdict(dict)
    for v in verdicts:
        by_fqn[v.fqn][v.rank] = v.status
    out = []
    for fqn, per_rank in sorted(by_fqn.items()):
        if len(set(per_rank.values())) > 1:
            out.append({"fqn": fqn, "status": "RANK_DIVERGENCE", "ranks": per_rank,
                        "reason": "gradient status differs by rank: DDP's all-reduce of its bucket will "
                                  "not match across ranks (predicted hang)"})
    return out
