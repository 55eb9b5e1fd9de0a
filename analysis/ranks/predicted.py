"""Predictions checked against the record (issue 19, item 3): per process group, the collective
schedule :mod:`graphdeck.analysis.ranks.core` predicts from the graphs next to what the ranks' Flight
Recorder dumps (:mod:`graphdeck.analysis.ranks.flight`) recorded, and whether the prediction held.

Per group (a predicted collective's group is its ``group_name`` argument, which is the name the
recorder gives the group; DDP's bucket collectives belong to the process group the capture
recorded for DDP, else the default group ``"0"``; an FSDP2 group's all-gathers and
reduce-scatters to its shard dimension's process group on each rank, from the layout record —
``"0"`` only for a run without one):

# NOTE: [Predictions per group's members]
# A group's schedules are compared among its MEMBERS only — the Flight Recorder comparison's
# members (``pg_config``, else the capture's process-group / layout records), the same sets
# ranks/mesh.py compares. On a 2 x 2 (dp, tp) mesh, tp group "3" is ranks [0, 1]: ranks 2 and 3
# issue none of its collectives by design and never "skip" them (comparing every rank read as a
# predicted hang that did not happen). The recorded side counts the members' dumps only; a member
# without a dump makes the check ``incomplete`` (a rank that aborted inside the collective may
# write none), never ``held``.

* **predicted**: each member's collectives of that group in one step of the steady-state schedule
  (NOTE: [Recompiles replace graphs]), with the compile each comes from, and the first position
  where ranks differ — ranks that issue nothing there *skip* it (a predicted hang);
* **recorded**: the group's first mismatched collective (its sequence id, the ranks that never
  reached it), else how many collectives each rank completed;
* **outcome**: ``held`` (a predicted hang whose skipping ranks are the ranks that never reached
  the recorded mismatch, or no hang predicted and none recorded), ``held in part`` (a hang
  predicted and one recorded, other ranks), ``did not hold`` (a hang predicted, every rank
  completed the group's collectives), ``not predicted`` (a recorded mismatch with no predicted
  one: for a group no compiled graph issues, its collectives come from code outside the graphs),
  ``unchecked`` (the prediction names a group the record does not hold), ``incomplete`` (no
  mismatch recorded, but a member of the group has no dump: neither confirmed nor refuted).

Which compiles of a frame run (NOTE: [Live compiles]) is :func:`live_compiles` (from
:mod:`graphdeck.analysis.ranks.frame_compiles`), which
:func:`graphdeck.analysis.ranks.core.collective_schedules` calls for each rank.

Pure: reads the report and the store (the capture's record of DDP's process group, compile
records, profiler traces' compiled regions).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

# live_compiles is looked up here at call time (uncertain_frames; schedules.py and hang_step.py
# import it from this module), so a test that patches it here changes every caller.
from graphdeck.analysis.ranks.frame_compiles import FrameCompiles, live_compiles

if TYPE_CHECKING:
    from graphdeck.analysis.ranks.core import Collective, RankReport
    from graphdeck.analysis.ranks.flight import FlightReport, GroupMismatch


@dataclass
class PredictionCheck:
    group: str
    desc: str
    # rank -> [{"compile_id", "source", "count"}]: where each rank's predicted collectives come from
    predicted_segments: dict[int, list[dict]]
    predicted: str
    recorded: str
    outcome: str  # "held" | "held in part" | "did not hold" | "not predicted" | "unchecked"
    predicted_hang: bool = False
    predicted_skipping: list[int] = field(default_factory=list)
    recorded_hang: bool = False
    recorded_not_reached: list[int] = field(default_factory=list)
    recorded_completed: dict[int, int] = field(default_factory=dict)  # members with a dump only
    members: list[int] = field(default_factory=list)  # the group's members the prediction compared
    recorded_no_dump: list[int] = field(default_factory=list)  # members without a Flight Recorder dump
    # members on the two sides of a harmful compile divergence of the report (NOTE: [No "no hang"
    # beside a divergence]): the schedule alone cannot promise their collectives match
    predicted_divergent: list[int] = field(default_factory=list)
    # the step of the group's hang (NOTE: [Compiles live at a step]): the prediction compares each
    # member's graphs live at that step; None: the steady state (no hang, or no step recorded)
    step: int | None = None
    step_source: str | None = None

    def line(self) -> str:
        return f"group {self.group}{' (' + self.desc + ')' if self.desc else ''}: predicted: {self.predicted} " \
               f"— recorded: {self.recorded}: {self.outcome}"

    def to_dict(self) -> dict:
        return asdict(self)


def _bucket_groups(session: Session, run_id: int) -> dict[int, str]:
    """rank → the process group of its DDP buckets, from its newest ``graphdeck_comm_groups``
    record (as :func:`graphdeck.analysis.traces.comm_map.load_record` reads it; one query for the run);
    a rank without one is absent (the default group ``"0"``)."""
    import json

    from graphdeck.analysis.traces.comm_map import EVENT_NAME
    from graphdeck.store.schema import CompileEvent

    newest: dict[int, str | None] = {}
    for rank, payload in session.execute(select(CompileEvent.rank, CompileEvent.payload).where(
            CompileEvent.run_id == run_id, CompileEvent.name == EVENT_NAME).order_by(CompileEvent.id)):
        newest[rank] = payload
    out: dict[int, str] = {}
    for rank, payload in newest.items():
        try:
            data = json.loads(payload or "{}")
        except ValueError:
            continue
        for ddp in (data.get("ddp") or []) if isinstance(data, dict) else []:
            if ddp.get("process_group"):
                out[rank] = str(ddp["process_group"])
                break
    return out


def _fsdp_groups(session: Session, run_id: int) -> dict[int, dict[str, str]]:
    """rank → {FSDP2 group module → the process group its all-gathers / reduce-scatters use}, from
    the rank's layout record (NOTE: [Parallel layout]): the group's shard dimension (the last of
    its ``mesh_dims``, else its mesh's last dimension) and the rank's ``dim_groups`` entry of that
    dimension. A rank without a record, or a group whose dimension's process group is not named,
    is absent (its FSDP2 collectives' group is then unknown, not the default group)."""
    from graphdeck.analysis.parallel.layout import load_records

    out: dict[int, dict[str, str]] = {}
    for rank, rec in load_records(session, run_id).items():
        meshes = {m.get("key"): m for m in rec.get("meshes") or [] if isinstance(m, dict)}
        for g in rec.get("fsdp_groups") or []:
            if not isinstance(g, dict):
                continue
            mesh = meshes.get(g.get("mesh")) or {}
            dims = list(g.get("mesh_dims") or []) or list(mesh.get("dim_names") or [])[-1:]
            name = next((str(dg["name"]) for dg in mesh.get("dim_groups") or []
                         if isinstance(dg, dict) and dims and dg.get("dim") == dims[-1] and dg.get("name") is not None),
                        None)
            if name is not None:
                out.setdefault(rank, {})[str(g.get("module") or "")] = name
    return out


_FSDP_MODULE = re.compile(r"^FSDP2 group (.*) \(\d+ params\)$")


def _group(c: Collective, rank: int, bucket_groups: dict[int, str], fsdp: dict[int, dict[str, str]],
           has_layout: bool) -> str | None:
    """The process group ``c`` of ``rank`` runs on (None: unknown). A DDP bucket: the group the
    capture recorded for DDP, else the default ``"0"``; an FSDP2 group: its shard dimension's group
    (:func:`_fsdp_groups`), else ``"0"`` when the run has no layout record (1-D FSDP2 over the world)."""
    if c.source == "ddp_bucket":
        return bucket_groups.get(rank, "0")
    if c.source == "fsdp_group":
        mine = fsdp.get(rank)
        if mine:
            m = _FSDP_MODULE.match(c.node or "")
            module = m.group(1) if m else None
            module = "" if module == "(root)" else module
            if module in mine:
                return mine[module]
            names = set(mine.values())
            return names.pop() if len(names) == 1 else None
        return None if has_layout else "0"
    return c.group


def _has_layout(session: Session, run_id: int) -> bool:
    from graphdeck.analysis.parallel.layout import EVENT_NAME
    from graphdeck.store.schema import CompileEvent

    return session.scalar(select(CompileEvent.id).where(CompileEvent.run_id == run_id,
                                                        CompileEvent.name == EVENT_NAME).limit(1)) is not None


def group_members(session: Session, run_id: int, fr: FlightReport | None, ranks: list[int]) -> dict[str, list[int]]:
    """Process-group name → member ranks: the Flight Recorder comparison's members (``pg_config``,
    else the capture's records) where it has the group, else the capture's process-group / layout
    records (:func:`graphdeck.analysis.ranks.flight.recorded_members`). A group named by neither is
    absent (callers then take every rank, as without a layout). Ranks: ints, sorted."""
    from graphdeck.analysis.ranks.flight import recorded_members

    out = {g: sorted(m) for g, m in recorded_members(session, run_id).items()}
    if fr is not None:
        for g, m in fr.group_members.items():
            if m and (g in out or set(m) != set(fr.members)):  # the whole world is FR's fallback, not a record
                out[g] = sorted(m)
    return out


def _segments(sch: list[Collective]) -> list[dict]:
    out: list[dict] = []
    for c in sch:
        if out and out[-1]["compile_id"] == c.compile_id and out[-1]["source"] == c.source:
            out[-1]["count"] += 1
        else:
            out.append({"compile_id": c.compile_id, "source": c.source, "count": 1})
    return out


def _seg_text(segs: list[dict]) -> str:
    if not segs:
        return "none"
    return ", ".join(f"{s['count']} from " + (f"compile {s['compile_id']}" if s["compile_id"] else s["source"])
                     for s in segs)


def _alike(segs: dict[int, list[dict]]) -> dict[str, list[int]]:
    """``_seg_text`` → the ranks it holds for, in rank order: one entry per distinct text."""
    out: dict[str, list[int]] = {}
    for r in sorted(segs):
        out.setdefault(_seg_text(segs[r]), []).append(r)
    return out


def _steady_compile(report: RankReport, rank: int, compile_id: str | None) -> str | None:
    """The compile of ``compile_id``'s frame that ``rank`` runs in steady state."""
    from graphdeck.analysis.ranks.core import frame_of, steady_state

    f = frame_of(compile_id)
    if f is None:
        return None
    return next((e.compile_id for e in steady_state(report.sequences.get(rank, [])) if frame_of(e.compile_id) == f),
                None)


def prediction_checks(session: Session, report: RankReport) -> list[PredictionCheck]:
    """Predicted vs recorded per process group; empty when the run has no Flight Recorder dump or
    no rank issues a predicted collective and nothing is recorded."""
    from graphdeck.analysis.ranks.core import _schedule_mismatch

    fr: FlightReport | None = report.flight
    if fr is None or not report.schedules:
        return []
    if not any(report.schedules.values()):
        return []  # nothing predicted (no graph issues a collective): nothing to check
    from graphdeck.analysis.ranks.flight import count_completed
    from graphdeck.analysis.ranks.records import _ranks_phrase, _ranks_text

    if not fr.completed:
        count_completed(session, report.run_id, fr)
    ranks = report.ranks
    issued: dict[str, dict[int, list]] = {}
    bucket_groups = _bucket_groups(session, report.run_id)
    fsdp = _fsdp_groups(session, report.run_id)
    has_layout = bool(fsdp) or _has_layout(session, report.run_id)
    for r in ranks:
        for c in report.schedules.get(r, []):
            g = _group(c, r, bucket_groups, fsdp, has_layout)
            if g is not None:
                issued.setdefault(g, {}).setdefault(r, []).append(c)
    from graphdeck.analysis.ranks.hang_step import at_hang_step, compile_at

    at = at_hang_step(session, report)  # NOTE: [Compiles live at a step]
    for g, (_step, _src, sched, _cs) in at.items():
        issued[g] = {}
        for r in ranks:
            for c in sched.get(r, []):
                if _group(c, r, bucket_groups, fsdp, has_layout) == g:
                    issued[g].setdefault(r, []).append(c)
        if not issued[g]:
            del issued[g]
    members = group_members(session, report.run_id, fr, ranks)
    # NOTE: [Predictions per group's members]: a group's schedules are compared among its members
    # only (as the Flight Recorder comparison and ranks/mesh.py do); a rank outside the group issues
    # none of its collectives by design, never "skips" them. A member that issues none does.
    per_group: dict[str, dict[int, list]] = {
        g: {r: by_rank.get(r, []) for r in sorted(set(members.get(g, ranks)) & set(ranks) | set(by_rank))}
        for g, by_rank in issued.items()}
    recorded_groups = set(fr.completed) | {m.group for m in fr.mismatches}
    mismatch_of: dict[str, GroupMismatch] = {m.group: m for m in fr.mismatches}
    out: list[PredictionCheck] = []
    for g in sorted(set(per_group) | recorded_groups, key=lambda x: (not x.isdigit(), int(x) if x.isdigit() else 0, x)):
        desc = fr.descs.get(g, "")
        scheds = per_group.get(g)
        segs = {r: _segments(s) for r, s in (scheds or {}).items()}
        check = PredictionCheck(group=g, desc=desc, predicted_segments=segs, predicted="", recorded="", outcome="")
        if g in at:
            check.step, check.step_source = at[g][0], at[g][1]
        # predicted
        pm = None
        if scheds:
            renumbered = {r: [_copy(c, i) for i, c in enumerate(s)] for r, s in scheds.items()}
            pm = _schedule_mismatch(renumbered)
        if not scheds:
            check.predicted = "no compiled graph issues a collective of this group"
        elif pm is None and _divergent_members(report, scheds):
            # NOTE: [No "no hang" beside a divergence]: the schedules agree by kind and count, but
            # members compile different graphs (a harmful divergence of the same report): "no
            # hang" would contradict that finding; the prediction names it instead.
            n = len(next(iter(scheds.values())))
            d = _divergent_members(report, scheds)[0]
            check.predicted_divergent = sorted(set(d.ranks) | set(d.reference_ranks))
            check.predicted = (f"a possible mismatch: members issue the same {n} collective(s) a step by kind and "
                               f"order, but ranks {_ranks_text(d.ranks)} vs {_ranks_text(d.reference_ranks)} diverge "
                               f"({d.what}" + (f" at compile {d.compile_id}" if d.compile_id else "")
                               + "; DIVERGED above), so their sizes or inputs need not match")
        elif pm is None:
            n = len(next(iter(scheds.values())))
            check.predicted = (f"no hang: every member issues the same {n} collective(s) a step ("
                               + "; ".join(f"{_ranks_phrase(rs)}: {text}" for text, rs in _alike(segs).items()) + ")"
                               + (" — a frame with several live graphs counts each once (NOTE: [Live compiles])"
                                  if _several_live(scheds) else ""))
        else:
            check.predicted_hang = True
            issued = next(v for v in pm.variants if v["collective"] is not None)
            c = issued["collective"]
            skipping = sorted(r for v in pm.variants if v["collective"] is None for r in v["ranks"])
            if skipping:
                check.predicted_skipping = skipping
                theirs = sorted({(compile_at(session, report, r, c["compile_id"], check.step, at[g][3])
                                  if g in at else _steady_compile(report, r, c["compile_id"])) or "none"
                                 for r in skipping})
                check.predicted = (f"ranks {_ranks_text(skipping)} skip {c['kind']} #{pm.index} of the step (ranks {_ranks_text(issued['ranks'])} "
                                   f"issue it from {'compile ' + c['compile_id'] if c['compile_id'] else c['source']}"
                                   + (f"; ranks {_ranks_text(skipping)} run compile {', '.join(theirs)} of that frame"
                                      if c["compile_id"] else "") + ")")
            else:
                check.predicted = (f"collective #{pm.index} of the step differs: " + "; ".join(
                    f"ranks {_ranks_text(v['ranks'])}: {v['collective']['kind']} from compile {v['collective']['compile_id']}"
                    for v in pm.variants))
        if check.step is not None and check.predicted:
            check.predicted = f"at step {check.step} (the step of the hang: {check.step_source}): {check.predicted}"
        # recorded, among the group's members (a rank outside the group completes none of it)
        m = mismatch_of.get(g)
        mine = sorted(set(members.get(g) or fr.group_members.get(g) or ranks))
        check.members = mine
        no_dump = [r for r in mine if r not in set(fr.ranks)]
        completed = {r: n for r, n in fr.completed.get(g, {}).items() if r in mine}
        check.recorded_completed = dict(completed)
        check.recorded_no_dump = no_dump
        if m is not None:
            check.recorded_hang = True
            check.recorded_not_reached = list(m.not_reached)
            check.recorded = (f"ranks {_ranks_text(m.not_reached)} never reached {m.op} #{m.seq} of group {desc or g}"
                              + ("" if m.primary else " (a consequence of another group's hang)"))
        elif g in recorded_groups:
            dumped = [r for r in mine if r not in no_dump]
            counts = sorted({completed.get(r, 0) for r in dumped}) or [0]
            n = counts[0] if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
            check.recorded = (f"{'every member' if not no_dump else 'members'} {_ranks_text(dumped)} completed {n} "
                              f"collectives of group {desc or g}")
        else:
            check.recorded = "the Flight Recorder holds no entry of this group"
        if no_dump and m is None:
            check.recorded += (f"; members {_ranks_text(no_dump)} have no Flight Recorder dump, so whether they issued them "
                               "cannot be told")
        # outcome
        if g not in recorded_groups:
            check.outcome = "unchecked"
        elif check.predicted_divergent and m is not None:
            check.outcome = "held"  # the divergence it names came to a recorded mismatch
        elif check.predicted_hang and m is not None:
            same = (set(check.predicted_skipping) == set(m.not_reached) if check.predicted_skipping
                    else {frozenset(v["ranks"]) for v in pm.variants} >= {frozenset(m.not_reached)})
            check.outcome = "held" if same else "held in part"
        elif m is not None:
            check.outcome = "not predicted"
        elif not scheds:
            continue  # neither predicted nor a recorded hang: nothing to check
        elif no_dump:
            check.outcome = "incomplete"  # a member without a dump: the record can neither confirm nor refute
        elif check.predicted_hang:
            check.outcome = "did not hold"
        else:
            check.outcome = "held"
        out.append(check)
    return out


def _divergent_members(report: RankReport, scheds: dict[int, list]) -> list:
    """The report's harmful divergences (not ``harmless``) with ranks on both sides among the
    members ``scheds`` holds."""
    members = set(scheds)
    return [d for d in report.divergences
            if not d.harmless and members & set(d.ranks) and members & set(d.reference_ranks)]


def _several_live(scheds: dict[int, list[Collective]]) -> bool:
    """Whether some rank's schedule holds collectives of two compiles of one frame."""
    from graphdeck.analysis.ranks.core import frame_of

    for sch in scheds.values():
        per_frame: dict[str, set[str]] = {}
        for c in sch:
            if c.compile_id and frame_of(c.compile_id):
                per_frame.setdefault(frame_of(c.compile_id), set()).add(c.compile_id)
        if any(len(v) > 1 for v in per_frame.values()):
            return True
    return False


def _copy(c: Collective, index: int) -> Collective:
    from dataclasses import replace

    return replace(c, index=index)


def uncertain_frames(session: Session, report: RankReport) -> list[FrameCompiles]:
    """Per rank of ``report``, the frames whose live compiles cannot be told (missing evidence);
    none for a run of one rank (no other rank's collectives to disagree with)."""
    out: list[FrameCompiles] = []
    if len(report.ranks) < 2:
        return out
    scheduled = _scheduled(session, report.run_id)
    for r in report.ranks:
        _entries, frames = live_compiles(session, report.run_id, r, report.sequences.get(r, []),
                                         scheduled.get(r, set()))
        out += [f for f in frames if f.uncertain]
    return out


def _scheduled(session: Session, run_id: int) -> dict[int, set[str]]:
    """rank → compile ids with an imported Inductor collective schedule (one query for the run)."""
    from graphdeck.store.schema import CompileEvent

    out: dict[int, set[str]] = {}
    for rank, cid, p in session.execute(select(CompileEvent.rank, CompileEvent.compile_id, CompileEvent.payload)
                                        .where(CompileEvent.run_id == run_id,
                                               CompileEvent.name == "inductor_collective_schedule")):
        if p:
            out.setdefault(rank, set()).add(cid)
    return out
