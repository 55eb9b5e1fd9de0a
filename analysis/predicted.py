"""Predictions checked against the record (issue 19, item 3): per process group, the collective
schedule :mod:`graphdeck.analysis.ranks` predicts from the graphs next to what the ranks' Flight
Recorder dumps (:mod:`graphdeck.analysis.flight`) recorded, and whether the prediction held.

Per group (a predicted collective's group is its ``group_name`` argument, which is the name the
recorder gives the group; DDP's and FSDP's bucket collectives belong to the process group the
capture recorded for them, else the default group ``"0"``):

* **predicted**: each rank's collectives of that group in one step of the steady-state schedule
  (NOTE: [Recompiles replace graphs]), with the compile each comes from, and the first position
  where ranks differ — ranks that issue nothing there *skip* it (a predicted hang);
* **recorded**: the group's first mismatched collective (its sequence id, the ranks that never
  reached it), else how many collectives each rank completed;
* **outcome**: ``held`` (a predicted hang whose skipping ranks are the ranks that never reached
  the recorded mismatch, or no hang predicted and none recorded), ``held in part`` (a hang
  predicted and one recorded, other ranks), ``did not hold`` (a hang predicted, every rank
  completed the group's collectives), ``not predicted`` (a recorded mismatch with no predicted
  one: for a group no compiled graph issues, its collectives come from code outside the graphs),
  ``unchecked`` (the prediction names a group the record does not hold).

Pure: reads the report (and the capture's record of DDP's process group).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from graphdeck.analysis.flight import FlightReport, GroupMismatch
    from graphdeck.analysis.ranks import Collective, RankReport


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
    recorded_completed: dict[int, int] = field(default_factory=dict)

    def line(self) -> str:
        return f"group {self.group}{' (' + self.desc + ')' if self.desc else ''}: predicted: {self.predicted} " \
               f"— recorded: {self.recorded}: {self.outcome}"

    def to_dict(self) -> dict:
        return asdict(self)


def _bucket_group(session: Session, run_id: int, rank: int) -> str:
    from graphdeck.analysis.comm_map import load_record

    for ddp in (load_record(session, run_id, rank) or {}).get("ddp") or []:
        if ddp.get("process_group"):
            return str(ddp["process_group"])
    return "0"


def _group(c: Collective, bucket_group: str) -> str | None:
    if c.source in ("ddp_bucket", "fsdp_group"):
        return bucket_group
    return c.group


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


def _steady_compile(report: RankReport, rank: int, compile_id: str | None) -> str | None:
    """The compile of ``compile_id``'s frame that ``rank`` runs in steady state."""
    from graphdeck.analysis.ranks import frame_of, steady_state

    f = frame_of(compile_id)
    if f is None:
        return None
    return next((e.compile_id for e in steady_state(report.sequences.get(rank, [])) if frame_of(e.compile_id) == f),
                None)


def prediction_checks(session: Session, report: RankReport) -> list[PredictionCheck]:
    """Predicted vs recorded per process group; empty when the run has no Flight Recorder dump or
    no rank issues a predicted collective and nothing is recorded."""
    from graphdeck.analysis.ranks import _schedule_mismatch

    fr: FlightReport | None = report.flight
    if fr is None or not report.schedules:
        return []
    if not any(report.schedules.values()):
        return []  # nothing predicted (no graph issues a collective): nothing to check
    from graphdeck.analysis.flight import count_completed

    if not fr.completed:
        count_completed(session, report.run_id, fr)
    ranks = report.ranks
    per_group: dict[str, dict[int, list]] = {}
    for r in ranks:
        bg = _bucket_group(session, report.run_id, r)
        for c in report.schedules.get(r, []):
            g = _group(c, bg)
            if g is not None:
                per_group.setdefault(g, {rr: [] for rr in ranks})[r].append(c)
    recorded_groups = set(fr.completed) | {m.group for m in fr.mismatches}
    mismatch_of: dict[str, GroupMismatch] = {m.group: m for m in fr.mismatches}
    out: list[PredictionCheck] = []
    for g in sorted(set(per_group) | recorded_groups, key=lambda x: (not x.isdigit(), int(x) if x.isdigit() else 0, x)):
        desc = fr.descs.get(g, "")
        scheds = per_group.get(g)
        segs = {r: _segments(s) for r, s in (scheds or {}).items()}
        check = PredictionCheck(group=g, desc=desc, predicted_segments=segs, predicted="", recorded="", outcome="")
        # predicted
        pm = None
        if scheds:
            renumbered = {r: [_copy(c, i) for i, c in enumerate(s)] for r, s in scheds.items()}
            pm = _schedule_mismatch(renumbered)
        if not scheds:
            check.predicted = "no compiled graph issues a collective of this group"
        elif pm is None:
            n = len(next(iter(scheds.values())))
            check.predicted = (f"no hang: every rank issues the same {n} collective(s) a step ("
                               + "; ".join(f"rank {r}: {_seg_text(segs[r])}" for r in ranks) + ")")
        else:
            check.predicted_hang = True
            issued = next(v for v in pm.variants if v["collective"] is not None)
            c = issued["collective"]
            skipping = sorted(r for v in pm.variants if v["collective"] is None for r in v["ranks"])
            if skipping:
                check.predicted_skipping = skipping
                theirs = sorted({_steady_compile(report, r, c["compile_id"]) or "none" for r in skipping})
                check.predicted = (f"ranks {skipping} skip {c['kind']} #{pm.index} of the step (ranks {issued['ranks']} "
                                   f"issue it from {'compile ' + c['compile_id'] if c['compile_id'] else c['source']}"
                                   + (f"; ranks {skipping} run compile {', '.join(theirs)} of that frame"
                                      if c["compile_id"] else "") + ")")
            else:
                check.predicted = (f"collective #{pm.index} of the step differs: " + "; ".join(
                    f"ranks {v['ranks']}: {v['collective']['kind']} from compile {v['collective']['compile_id']}"
                    for v in pm.variants))
        # recorded
        m = mismatch_of.get(g)
        completed = fr.completed.get(g, {})
        check.recorded_completed = dict(completed)
        if m is not None:
            check.recorded_hang = True
            check.recorded_not_reached = list(m.not_reached)
            check.recorded = (f"ranks {m.not_reached} never reached {m.op} #{m.seq} of group {desc or g}"
                              + ("" if m.primary else " (a consequence of another group's hang)"))
        elif g in recorded_groups:
            counts = sorted({completed.get(r, 0) for r in fr.ranks})
            n = counts[0] if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
            check.recorded = f"all ranks completed {n} collectives of group {desc or g}"
        else:
            check.recorded = "the Flight Recorder holds no entry of this group"
        # outcome
        if g not in recorded_groups:
            check.outcome = "unchecked"
        elif check.predicted_hang and m is not None:
            same = (set(check.predicted_skipping) == set(m.not_reached) if check.predicted_skipping
                    else {frozenset(v["ranks"]) for v in pm.variants} >= {frozenset(m.not_reached)})
            check.outcome = "held" if same else "held in part"
        elif check.predicted_hang:
            check.outcome = "did not hold"
        elif m is not None:
            check.outcome = "not predicted"
        elif not scheds:
            continue  # neither predicted nor a recorded hang: nothing to check
        else:
            check.outcome = "held"
        out.append(check)
    return out


def _copy(c: Collective, index: int) -> Collective:
    from dataclasses import replace

    return replace(c, index=index)
