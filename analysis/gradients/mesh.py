"""Gradient findings in the words of the job's parallel wrapper: FSDP2 groups, tensor-parallel
placements, pipeline stages (issue 20, item 3).

# NOTE: [Wrapper words]
# A parameter whose gradient exists on some ranks only means different things under each
# wrapper, and so do the fixes:
#
# * DDP: its bucket's all-reduce is not launched on the ranks without it: a hang, or DDP's
#   "Expected to have finished reduction" error; ``find_unused_parameters=True`` is a fix.
# * FSDP2 (``fully_shard``): every group reduce-scatters the gradients of ITS parameters after
#   backward, one flat buffer per group. A rank without a parameter's gradient builds a smaller
#   buffer: the reduce-scatter's input size differs per rank, so the collective mismatches — gloo
#   fails ("Received data size doesn't match expected size"), NCCL may hang or complete with
#   silently wrong gradients (pytorch/pytorch#158719, #174862). FSDP2 has no option that
#   tolerates it; the fixes are to touch every parameter on every rank (``0 * p.sum()`` in the
#   loss) or to put the rank-dependent module in its own ``fully_shard`` group and make the
#   routing rank-consistent.
# * Tensor parallel: a DTensor parameter whose placement on a mesh dimension is ``Partial``
#   holds a pending sum; its gradient is Partial too, and nothing reduces it before the optimizer
#   steps each rank's piece: the TP ranks drift apart silently.
# * Pipeline parallel (``torch.distributed.pipelining``): a stage's parameters get their gradient
#   only through the gradient the next stage sends back for its input. A stage input (or the
#   previous stage's output) that is detached cuts that path: every parameter of the earlier
#   stage(s) gets no gradient (the schedule raises or waits for a gradient that never comes).
#
# Which wrapper ran is read from the store: the ``graphdeck_watch`` records (``ddp``,
# ``fsdp2``), the ``graphdeck_comm_groups`` records (DDP buckets, FSDP2 groups; NOTE:
# [Communication groups]) and the parallel layout (NOTE: [Parallel layout]: FSDP2 groups, DTensor
# placements, pipeline stages). A job that died before ``close()`` may lack the comm-groups record
# on some ranks; any rank's record (or layout) names the groups.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from sqlalchemy import select, text
from sqlalchemy.orm import Session, aliased

from graphdeck.analysis.gradients.report import FAILING, Finding, ParamRow
from graphdeck.analysis.ranks.records import _ranks_text
from graphdeck.store.schema import Graph, InternedString, Node

GLOO_SIZE_ERROR = "Received data size doesn't match expected size"


@dataclass
class Wrapping:
    """What wraps the model on the run's ranks. ``fsdp_groups``: ``{"module", "params"}`` per
    ``fully_shard`` group (``module`` ``""`` is the root), from any rank's record; ``layout``: the
    run's :class:`~graphdeck.analysis.parallel.layout.RunLayout` or None."""

    ddp: bool = False
    fsdp2: bool = False
    fsdp_groups: list[dict] = field(default_factory=list)
    layout: object | None = None

    def group_of(self, fqn: str) -> dict | None:
        """The FSDP2 group holding parameter ``fqn`` (the innermost one listing it), or None."""
        hits = [g for g in self.fsdp_groups if fqn in (g.get("params") or ())]
        return max(hits, key=lambda g: len(g.get("module") or "")) if hits else None


def wrapping(session: Session, run_id: int, watched: list[dict] | None = None) -> Wrapping:
    """The run's :class:`Wrapping` from its watch records (``watched``, as loaded by
    :mod:`graphdeck.analysis.gradients.evidence`), comm-groups records and parallel layout."""
    from graphdeck.analysis.parallel.layout import load_layout

    out = Wrapping(ddp=any(w.get("ddp") for w in watched or []), fsdp2=any(w.get("fsdp2") for w in watched or []))
    seen: set[tuple] = set()
    for (payload,) in session.execute(text("SELECT payload FROM compile_events WHERE run_id = :r AND "
                                           "name = 'graphdeck_comm_groups' ORDER BY id"), {"r": run_id}):
        try:
            data = json.loads(payload or "{}")
        except ValueError:
            continue
        for g in (data.get("fsdp") or []) if isinstance(data, dict) else []:
            _add_group(out, seen, g)
    out.layout = load_layout(session, run_id)
    if out.layout is not None:
        for rec in out.layout.records.values():
            for g in rec.get("fsdp_groups") or []:
                _add_group(out, seen, g)
    out.fsdp2 = out.fsdp2 or bool(out.fsdp_groups)
    return out


def _add_group(out: Wrapping, seen: set, g) -> None:
    if not isinstance(g, dict) or not isinstance(g.get("params"), list):
        return
    key = (str(g.get("module") or ""), tuple(map(str, g["params"])))
    if key not in seen:
        seen.add(key)
        out.fsdp_groups.append({"module": key[0], "params": list(key[1])})


def group_name(group: dict | None) -> str:
    """``fully_shard group 'layers.0'`` / ``the root fully_shard group``."""
    if group is None:
        return "its fully_shard group"
    return f"fully_shard group '{group['module']}'" if group.get("module") else "the root fully_shard group"


def owner_module(fqn: str) -> str:
    """``expert_b`` for ``expert_b.weight``; ``""`` for a top-level parameter."""
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def fsdp2_consequence(fqn: str, without: list[int], group: dict | None) -> str:
    """The consequence, in FSDP2 words, of ``fqn``'s gradient missing on ranks ``without``."""
    n = len(group.get("params") or []) if group else 0
    many = ", " in fqn
    return (f"under FSDP2 {'they are' if many else 'it is'} reduce-scattered with {group_name(group)}"
            + (f" ({n} parameters)" if n else "")
            + f": the group's post-backward reduce-scatter then has a different input size on each rank "
              f"(rank(s) {_ranks_text(without)} lack {'their gradients' if many else 'its gradient'}) → a collective mismatch "
              f"or hang at the first backward (gloo: \"{GLOO_SIZE_ERROR}\"), or silent gradient corruption on NCCL")


def fsdp2_fix(fqns: list[str]) -> str:
    """The fixes FSDP2 has for parameters used on some ranks only (NOTE: [Wrapper words])."""
    mods = sorted({owner_module(f) for f in fqns} - {""})
    where = ", ".join(mods) if mods else "the module"
    return (f"touch every parameter on every rank (add 0 * p.sum() to the loss for each p in "
            f"{where}.parameters() on the ranks that skip it), or put {where} in its own fully_shard group(s) "
            "and make the routing rank-consistent")


# ---------------------------------------------------------------- tensor and pipeline parallel


def tp_partial_findings(layout) -> list[Finding]:
    """One finding per DTensor parameter whose placements include ``Partial`` on some rank
    (NOTE: [Wrapper words]): its gradient is never reduced over that mesh dimension."""
    if layout is None:
        return []
    by_fqn: dict[str, dict] = {}
    for rank in sorted(layout.records):
        for p in layout.records[rank].get("params") or []:
            if not isinstance(p, dict) or not isinstance(p.get("placements"), list):
                continue
            dims = [d for d, pl in zip(p.get("mesh_dims") or [], p["placements"]) if str(pl).startswith("Partial")]
            if dims:
                entry = by_fqn.setdefault(str(p.get("fqn")), {"ranks": [], "dims": dims, "placements": p["placements"]})
                entry["ranks"].append(rank)
    out = []
    for fqn, e in sorted(by_fqn.items()):
        dims = ", ".join(map(str, e["dims"]))
        groups = [g for d in e["dims"] for g in layout.dim_groups(d)]
        out.append(Finding(
            kind="TP_PARTIAL_GRAD", severity="error", params=[fqn], ranks=e["ranks"],
            message=(f"{fqn} is a DTensor with placements {e['placements']} (Partial on mesh dim {dims}) on rank(s) "
                     f"{_ranks_text(e['ranks'])}: its gradient is a partial sum on each rank of the {dims} group(s) {groups} and "
                     "nothing reduces it, so each rank's optimizer steps on its own piece and the tensor-parallel "
                     "ranks drift apart silently"),
            fix=(f"give {fqn} a Replicate() or Shard(d) placement on mesh dim {dims} (a ParallelStyle that yields "
                 "one), or reduce its gradient before the optimizer step "
                 "(p.grad = p.grad.redistribute(placements=[Replicate()]))")))
    return out


_DETACH = re.compile(r"(?:^|\.)(detach|detach_|alias)(?:\.default)?$")


def pp_cut_findings(session: Session, run_id: int, rows: list[ParamRow], layout) -> list[Finding]:
    """Pipeline stage boundaries where the backward path is cut (NOTE: [Wrapper words]), found
    two ways: a later stage's compiled backward returns no gradient for its stage input (the
    ``aot_backward`` graph's gradient output of a non-parameter input has none), or a stage's
    ranks get no gradient for any of their parameters while a later stage's get theirs. Names
    the ``detach`` that cuts it when a graph of the stage or of the next stage detaches a
    non-parameter input or its output. One finding per boundary."""
    if layout is None or not layout.has_pipeline():
        return []
    stage_ranks: dict[int, list[int]] = {}
    for r in range(layout.world_size):
        s = layout.stage_of(r)
        if s is not None:
            stage_ranks.setdefault(s, []).append(r)
    by_rank: dict[int, list[ParamRow]] = {}
    for row in rows:
        if row.status not in ("BUFFER", "FROZEN", "UNKNOWN") and not row.allowed:
            by_rank.setdefault(row.rank, []).append(row)

    def state(stage: int) -> str | None:  # "ok" | "none" | "mixed" | None (nothing known)
        rs = [row for r in stage_ranks.get(stage, []) for row in by_rank.get(r, [])]
        if not rs:
            return None
        bad = [row for row in rs if row.status in FAILING]
        return "none" if len(bad) == len(rs) else ("ok" if not bad else "mixed")

    stages = sorted(stage_ranks)
    cuts: dict[int, str] = {}  # earlier stage -> how the cut was seen
    for prev, s in zip(stages, stages[1:]):
        dropped = _input_without_grad(session, run_id, stage_ranks[s])
        if dropped:
            cuts[prev] = (f"stage {s}'s compiled backward (graph {dropped[0]}) returns no gradient for its stage "
                          f"input{' ' + dropped[1] if dropped[1] else ''}")
    for s in stages:
        later = [t for t in stages if t > s and state(t) in ("ok", "mixed")]
        if s not in cuts and state(s) == "none" and later:
            cuts[s] = (f"stage {s} gets no gradient for any of its parameters while stage {later[0]} (rank(s) "
                       f"{stage_ranks[later[0]]}) gets its own")
    out: list[Finding] = []
    for s, seen in sorted(cuts.items()):
        nxt = min(t for t in stages if t > s)
        params = sorted({row.fqn for r in stage_ranks[s] for row in by_rank.get(r, [])})
        where = _cut_site(session, run_id, stage_ranks[s], stage_ranks.get(nxt, []), rows)
        shown = ", ".join(params[:6]) + (f" and {len(params) - 6} more" if len(params) > 6 else "")
        fix = (f"do not detach the stage input of stage {nxt} or the output of stage {s} (no .detach(), .data or "
               "torch.no_grad() between them): the pipeline schedule sends the gradient of the stage input back "
               "to the previous stage")
        for r in stage_ranks[s]:  # the per-parameter rows say what the finding says (they do not train)
            for row in by_rank.get(r, []):
                if row.status not in FAILING:
                    row.status, row.fix = "NO_GRAD", fix
                    row.reason = (f"PP_BACKWARD_CUT: the backward path is cut at pipeline stage boundary {s} → {nxt} "
                                  f"({seen}): the gradient this parameter receives is none or zeros, so it does "
                                  "not train")
        out.append(Finding(
            kind="PP_BACKWARD_CUT", severity="error", params=params,
            ranks={r: "no gradient through the pipeline" for r in stage_ranks[s]},
            message=(f"pipeline stage boundary {s} → {nxt} (rank(s) {_ranks_text(stage_ranks[s])} → {_ranks_text(stage_ranks.get(nxt, []))}): "
                     f"the backward path is cut — {seen}, so stage {s} receives no real gradient for its output and "
                     f"its parameters ({shown or 'none recorded'}) do not train (the schedule sends back none or "
                     "zeros)" + (f"; cut by {where[0]}" if where else "")),
            source=where[1] if where else None, fix=fix))
    return out


def _input_without_grad(session: Session, run_id: int, ranks: list[int]) -> tuple[int, str | None] | None:
    """``(graph id, node)`` of an ``aot_backward`` graph of ``ranks`` whose gradient output for a
    non-parameter input (the stage input of a non-first stage) holds no gradient."""
    from graphdeck.store.schema import GraphIO

    row = session.execute(
        select(GraphIO.graph_id, GraphIO.position).join(Graph, Graph.id == GraphIO.graph_id)
        .where(Graph.run_id == run_id, Graph.rank.in_(ranks), Graph.kind == "aot_backward",
               GraphIO.direction == "grad", GraphIO.param_fqn.is_(None), GraphIO.has_grad.is_not(None),
               GraphIO.has_grad.is_(False))
        .order_by(Graph.rank, Graph.ordinal, GraphIO.position).limit(1)).first()
    if row is None:
        return None
    return row[0], f"(gradient output #{row[1]})"


def _cut_site(session: Session, run_id: int, ranks_before: list[int], ranks_after: list[int],
              rows: list[ParamRow]) -> tuple[str, str | None] | None:
    """``(description, source)`` of a detach on the boundary: a cut the gradient analysis found
    on the earlier stage's rows (its output detached), else a ``detach`` of a non-parameter
    placeholder in a Dynamo graph of the later stage (its input detached)."""
    for row in rows:
        if row.rank in ranks_before and row.cut is not None and row.cut.kind == "detach":
            return (f"{row.cut.op} (node {row.cut.node}) on stage output at {row.cut.source}", row.cut.source)
    if not ranks_after:
        return None
    from graphdeck.analysis.ranks.core import source_line

    target, stack = aliased(InternedString), aliased(InternedString)
    graphs = session.scalars(select(Graph.id).where(Graph.run_id == run_id, Graph.rank.in_(ranks_after),
                                                   Graph.kind == "dynamo").order_by(Graph.rank, Graph.ordinal)).all()
    for gid in graphs:
        nodes = session.execute(
            select(Node.name, Node.op, target.value, Node.args_json, Node.param_fqn, stack.value)
            .join(target, target.id == Node.target_id).outerjoin(stack, stack.id == Node.stack_trace_id)
            .where(Node.graph_id == gid).order_by(Node.idx)).all()
        inputs = {n[0] for n in nodes if n[1] == "placeholder" and not n[4] and "parameters" not in (n[2] or "")}
        for name, op, target, args, _fqn, stack in nodes:
            if op not in ("call_function", "call_method") or not _DETACH.search(str(target or "")):
                continue
            used = re.findall(r'\{"node": "([^"]*)"\}', args or "")
            if used and used[0] in inputs:
                src = source_line(stack)
                return (f"{target} of the stage input {used[0]} (graph {gid})" + (f" at {src}" if src else ""), src)
    return None


def mesh_findings(session: Session, run_id: int, rows: list[ParamRow], wrap: Wrapping) -> list[Finding]:
    """The tensor- and pipeline-parallel findings of a run with a layout record."""
    return tp_partial_findings(wrap.layout) + pp_cut_findings(session, run_id, rows, wrap.layout)
