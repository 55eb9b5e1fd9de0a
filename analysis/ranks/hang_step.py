"""The step of a hang, and the step each compile was made at (issue 38 item 5): a hang's
predicted collective schedule compares the graphs each rank ran at the step of the hang, not
the graphs of its steady state (NOTE: [Compile steps] in graphdeck/capture/compile_record.py).

* :func:`compile_steps`: rank → compile id → the training step the capture recorded when Dynamo
  compiled that compile's graphs (graph ``meta_json["step"]``; optimizer steps taken, 0 before the
  first);
* :func:`rank_steps`: rank → the step it was in when it stopped: its latest heartbeat's step (the
  live watch: optimizer steps taken, the step it is in), else the last step its gradient evidence
  recorded a backward in;
* :func:`group_steps`: per Flight Recorder mismatch, the step of the hang: the lowest step of the
  ranks that issued the group's first mismatched collective (they are blocked in it, so they are
  still in that step).

Pure: reads the store.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.store.schema import CompileEvent, GradStep, Graph

if TYPE_CHECKING:
    from graphdeck.analysis.ranks.core import RankReport

HEARTBEAT = "graphdeck_heartbeat"  # the live watch's record (analysis/ranks/live.py reads it too)


def compile_steps(session: Session, run_id: int) -> dict[int, dict[str, int]]:
    """rank → compile id → the step its graphs were compiled at (the lowest of its graphs'); a
    compile whose graphs carry no step (an older capture, an import, a rank that counts no steps)
    is absent. One query for the run: the Dynamo graphs' metadata (a few hundred bytes each)."""
    out: dict[int, dict[str, int]] = {}
    for rank, cid, meta in session.execute(select(Graph.rank, Graph.compile_id, Graph.meta_json).where(
            Graph.run_id == run_id, Graph.compile_id.is_not(None), Graph.kind.in_(("dynamo", "ddp_partition")),
            Graph.meta_json.like('%"step"%'))):
        try:
            step = json.loads(meta or "{}").get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            mine = out.setdefault(rank, {})
            mine[cid] = min(step, mine.get(cid, step))
    return out


def rank_steps(session: Session, run_id: int, ranks: list[int] | None = None) -> dict[int, tuple[int, str]]:
    """rank → ``(step, source)``: the step the rank was in when it stopped — its latest heartbeat's
    (``"its last heartbeat"``), else the last step its gradient evidence recorded a backward in
    (``"its gradient evidence"``: a rank stuck in a forward is one step further). Ranks with
    neither are absent."""
    out: dict[int, tuple[int, str]] = {}
    for rank, payload in session.execute(select(CompileEvent.rank, CompileEvent.payload).where(
            CompileEvent.run_id == run_id, CompileEvent.name == HEARTBEAT, CompileEvent.rank >= 0)
            .order_by(CompileEvent.id)):
        try:
            step = json.loads(payload or "{}").get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            out[rank] = (step, "its last heartbeat")
    where = [GradStep.run_id == run_id]
    if ranks is not None and len(ranks) <= 500:
        where.append(GradStep.rank.in_(ranks))
    for rank, step in session.execute(select(GradStep.rank, func.max(GradStep.step_last)).where(*where)
                                      .group_by(GradStep.rank)):
        if rank not in out and step is not None:
            out[rank] = (int(step), "its gradient evidence")
    return out if ranks is None else {r: v for r, v in out.items() if r in set(ranks)}


def group_steps(session: Session, report: RankReport) -> dict[str, tuple[int, str]]:
    """Process group → ``(step, source)`` of its Flight Recorder mismatch (a hang): the lowest
    step (:func:`rank_steps`) of the ranks that issued its first mismatched collective, with the
    ranks and source named (``"rank 0's last heartbeat"``). Groups without a mismatch, or whose
    issuing ranks have no step, are absent."""
    fr = report.flight
    if fr is None or not fr.mismatches:
        return {}
    wanted = sorted({r for m in fr.mismatches for r in m.reached})
    steps = rank_steps(session, report.run_id, wanted)
    out: dict[str, tuple[int, str]] = {}
    for m in fr.mismatches:
        known = [(steps[r][0], r) for r in m.reached if r in steps]
        if known and m.group not in out:
            step, r = min(known)
            out[m.group] = (step, f"rank {r} issued collective #{m.seq} there, by {steps[r][1]}")
    return out


def at_hang_step(session: Session, report: RankReport) -> dict[str, tuple]:
    """Process group → ``(step, source, schedules, compile steps)``: for each group with a Flight
    Recorder mismatch whose step is known (:func:`graphdeck.analysis.ranks.hang_step.group_steps`),
    every rank's collective schedule from the graphs live at that step, when some rank compiled
    at or after it (else the steady state is that step's: the group is absent). A hang at step 0
    of a run whose ranks never counted an optimizer step is absent too: that step is the whole
    run (NOTE: [A step that never ended])."""
    from graphdeck.analysis.ranks.schedules import collective_schedules

    g_steps = group_steps(session, report)
    if not g_steps:
        return {}
    csteps = compile_steps(session, report.run_id)
    if not csteps:
        return {}
    # NOTE: [A step that never ended]: step 0 is bounded only by the first optimizer step; a run
    # none of whose ranks ever counted one (no optimizer, or a hang in the first step) is one
    # "step 0" from start to hang, in which a frame compiled twice ran both compiles at different
    # times (tests/flight_job.py case 2: rank 1's 1/0 at steps 0-1, its 1/1 at the hang). Such a
    # step separates no compiles: the group keeps its steady-state prediction (an older compile
    # whose fate cannot be told stays uncertain, named as missing evidence).
    counted = max([s for mine in csteps.values() for s in mine.values()]
                  + [s for s, _src in rank_steps(session, report.run_id).values()], default=0)
    seqs = {r: report.sequences[r] for r in report.ranks if report.sequences.get(r)}
    out: dict[str, tuple] = {}
    by_step: dict[int, dict] = {}
    for g, (step, src) in g_steps.items():
        if step == 0 and counted <= 0:  # NOTE: [A step that never ended]
            continue
        if not any(s >= step for mine in csteps.values() for s in mine.values()):
            continue
        if step not in by_step:
            by_step[step] = collective_schedules(session, report.run_id, seqs, at_step=step, steps=csteps)
        out[g] = (step, src, by_step[step], csteps)
    return out


def compile_at(session: Session, report: RankReport, rank: int, compile_id: str | None, step: int,
                csteps: dict[int, dict[str, int]]) -> str | None:
    """The compiles of ``compile_id``'s frame that ``rank`` ran at ``step`` (comma-joined), with the
    step each was compiled at."""
    from graphdeck.analysis.ranks.core import frame_of
    from graphdeck.analysis.ranks.predicted import live_compiles

    f = frame_of(compile_id)
    if f is None:
        return None
    mine = csteps.get(rank, {})
    entries, _frames = live_compiles(session, report.run_id, rank, report.sequences.get(rank, []),
                                     at_step=step, steps=mine)
    ids = [e.compile_id for e in entries if frame_of(e.compile_id) == f]
    return ", ".join(c + (f" (compiled at step {mine[c]})" if c in mine else "") for c in ids) or None


__all__ = ["at_hang_step", "compile_at", "compile_steps", "group_steps", "rank_steps"]
