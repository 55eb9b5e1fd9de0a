"""The live hang report: written while the job still hangs, from the ranks' heartbeats, the
Flight Recorder dumps and Python stacks their watcher threads stored (NOTE: [Live watch] in
:mod:`graphdeck.capture.heartbeat`).

Per mismatched process group it names the training step (each rank's optimizer steps taken when
it stalled), the group, the first mismatched collective (the Flight Recorder comparison of
:mod:`graphdeck.analysis.ranks.flight`, read-only), which ranks issued it and which did not, and
each rank's current frame: the innermost frame of user code on the rank's main thread now (for a
rank blocked in a collective, the line that issued it; for a rank asleep or computing, the line it
is at, with its source text). Where no dump shows a mismatch yet, the stalled groups of the
heartbeats (enqueued past completed) are the report.

Stored as a ``graphdeck_hang_report`` compile record (payload :class:`LiveHang` as a dict, with
``lines``); the latest one of a run is the report. Pure but :func:`write_hang_report`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.flight import LIBRARY_FRAMES, flight_report
from graphdeck.analysis.ranks.records import _ranks_text
from graphdeck.analysis.units import duration_text as _d
from graphdeck.store.schema import CompileEvent

#: compile_events names: a rank's heartbeat (one row, updated in place), its Python stacks, the report.
HEARTBEAT, STACKS, REPORT = "graphdeck_heartbeat", "graphdeck_stacks", "graphdeck_hang_report"


@dataclass
class RankNow:
    """One rank when the report was written."""

    rank: int
    step: int | None  # optimizer steps taken (the step it is in, 0-based)
    frame: str | None  # innermost user frame of the main thread: "file:line in fn"
    source: str | None  # that line's source text
    innermost: str | None  # innermost Python frame of the main thread (any code)
    waiting: dict | None  # its stalled (else confirmed in-flight) collective per its heartbeat: {"group", "desc", "seq", "for_s"}
    beat_age_s: float | None  # seconds since its last heartbeat
    ended: str | None


@dataclass
class LiveGroup:
    group: str
    desc: str | None
    seq: int
    op: str | None
    sizes: list | None
    issued_by: list[int]
    not_issued_by: list[int]
    no_dump: list[int]
    issued_at: dict[int, str | None] = field(default_factory=dict)  # rank -> user line that issued it


@dataclass
class LiveHang:
    run_id: int
    detected_at: float | None  # wall s (the epoch) a watcher saw the stall
    written_at: float
    threshold_s: float | None
    timeout_s: float | None
    step: int | None  # the lowest step of the ranks (where the job is stuck)
    groups: list[LiveGroup]
    ranks: dict[int, RankNow]
    lines: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ranks"] = {str(r): asdict(v) for r, v in self.ranks.items()}
        return d


#: A ``graphdeck watch`` request: a stall the watch saw, asked of the agents (stored under rank 0:
#: a rank the run has, so that no check counts a rank that is not; agents read it as "rank -1").
REQUEST, WATCH_RANK = "graphdeck_watch_request", -1


def heartbeats(session: Session, run_id: int) -> dict[int, dict]:
    """Each rank's latest heartbeat payload (rank → dict as NOTE: [Live watch] gives)."""
    out: dict[int, dict] = {}
    for r, p in session.execute(select(CompileEvent.rank, CompileEvent.payload).where(
            CompileEvent.run_id == run_id, CompileEvent.name == HEARTBEAT, CompileEvent.rank >= 0)
            .order_by(CompileEvent.id)):
        try:
            out[r] = json.loads(p or "{}")
        except ValueError:
            continue
    return out


def stored_report(session: Session, run_id: int) -> dict | None:
    """The run's latest stored live hang report (a :meth:`LiveHang.to_dict`), or None."""
    p = session.scalar(select(CompileEvent.payload).where(
        CompileEvent.run_id == run_id, CompileEvent.name == REPORT).order_by(CompileEvent.id.desc()).limit(1))
    try:
        return json.loads(p) if p else None
    except ValueError:
        return None


def _stacks(session: Session, run_id: int) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r, p in session.execute(select(CompileEvent.rank, CompileEvent.payload).where(
            CompileEvent.run_id == run_id, CompileEvent.name == STACKS).order_by(CompileEvent.id)):
        try:
            out[r] = json.loads(p or "{}")
        except ValueError:
            continue
    return out


def _main_frames(stacks: dict) -> list:
    for t in stacks.get("threads") or []:
        if t.get("main"):
            return t.get("frames") or []
    return []


def _where(frames: list) -> tuple[str | None, str | None, str | None]:
    """(innermost user frame, its source text, innermost frame) of a stack (outermost first)."""
    inner = f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else None
    for f in reversed(frames):
        if not any(x in f[0] for x in LIBRARY_FRAMES):
            return f"{f[0]}:{f[1]} in {f[2]}", (f[3] or None), inner
    return None, None, inner


def live_hang(session: Session, run_id: int, *, detected_at: float | None = None,
              threshold_s: float | None = None) -> LiveHang:
    """The hang as the store shows it now (module docstring)."""
    now = time.time()
    beats = heartbeats(session, run_id)
    stacks = _stacks(session, run_id)
    ranks: dict[int, RankNow] = {}
    for r in sorted(set(beats) | set(stacks)):
        b = beats.get(r, {})
        frame, source, inner = _where(_main_frames(stacks.get(r, {})))
        waiting = b.get("stalled") or next(
            ({"group": g, "desc": v.get("desc"), "seq": v.get("enqueued"),
              "for_s": round(float(b.get("t") or now) - float(v.get("since") or now), 3)}
             for g, v in sorted((b.get("groups") or {}).items()) if v.get("in_flight")), None)
        ranks[r] = RankNow(rank=r, step=b.get("step"), frame=frame, source=source, innermost=inner,
                           waiting=waiting, beat_age_s=round(now - b["t"], 3) if b.get("t") else None,
                           ended=b.get("ended"))
    groups: list[LiveGroup] = []
    fr = flight_report(session, run_id)
    for m in (fr.mismatches if fr is not None else []):
        if not m.primary:
            continue
        groups.append(LiveGroup(group=m.group, desc=m.desc, seq=m.seq, op=m.op, sizes=m.sizes,
                                issued_by=list(m.reached), not_issued_by=list(m.not_reached), no_dump=list(m.no_dump),
                                issued_at={r: e.line for r, e in m.issued.items()}))
    if not groups:  # no dump shows it yet: the heartbeats' stalled groups
        by: dict[tuple, list[int]] = {}
        for r, rn in ranks.items():
            if rn.waiting:
                by.setdefault((rn.waiting["group"], rn.waiting.get("desc"), rn.waiting["seq"]), []).append(r)

        for (g, desc, seq), rs in sorted(by.items(), key=lambda kv: str(kv[0])):
            groups.append(LiveGroup(group=g, desc=desc, seq=seq, op=None, sizes=None, issued_by=rs,
                                    not_issued_by=sorted(set(ranks) - set(rs)), no_dump=[]))
    timeout = next((b.get("timeout_s") for b in beats.values() if b.get("timeout_s")), None)
    if threshold_s is None:
        threshold_s = next((b.get("threshold_s") for b in beats.values() if b.get("threshold_s")), None)
    steps = [rn.step for rn in ranks.values() if rn.step is not None]
    out = LiveHang(run_id=run_id, detected_at=detected_at, written_at=now, threshold_s=threshold_s,
                   timeout_s=timeout, step=min(steps) if steps else None, groups=groups, ranks=ranks)
    out.lines = _lines(out)
    return out


def _group_line(g: LiveGroup) -> str:
    what = f"collective #{g.seq}" + (f" {g.op}" if g.op else "") + (f" {g.sizes}" if g.sizes else "")
    return (f"group {g.group}{' (' + g.desc + ')' if g.desc else ''}: {what} issued by "
            f"ranks {_ranks_text(g.issued_by)}, not by ranks {_ranks_text(g.not_issued_by)}"
            + (f"; no dump from ranks {_ranks_text(g.no_dump)}" if g.no_dump else ""))


def _rank_line(rn: RankNow) -> str:
    text = f"rank {rn.rank} (step {rn.step if rn.step is not None else '?'}): "
    if rn.waiting:
        text += f"waiting {_d(rn.waiting.get('for_s', 0), 1)} in collective #{rn.waiting['seq']} of group " \
                f"{rn.waiting['group']}; "
    text += f"now at {rn.frame}" if rn.frame else (f"now at {rn.innermost}" if rn.innermost else "no stack stored")
    if rn.source:
        text += f": {rn.source}"
    if rn.ended:
        text += f" (ended: {rn.ended})"
    return text


def _lines(h: LiveHang) -> list[str]:
    steps = sorted({rn.step for rn in h.ranks.values() if rn.step is not None})
    step = (f"step {steps[0]}" if len(steps) == 1 else
            f"steps {', '.join(map(str, steps))}" if steps else "step unknown (no optimizer step seen)")
    limit = f" (threshold {h.threshold_s:g} s of a {h.timeout_s:g} s collective timeout)" if h.timeout_s and \
        h.threshold_s else ""
    return ([f"HANG (live: the job is still running) at {step}{limit}"] + [f"  {_group_line(g)}" for g in h.groups]
            + [f"  {line}" for line in _merged([rn for _r, rn in sorted(h.ranks.items())])])


def _merged(ranks: list[RankNow]) -> list[str]:
    """:func:`_rank_line` of each rank, ranks whose lines read the same but for the rank merged
    (``ranks [2-63] (step 2): now at …``: one line for 1,024 ranks stuck alike)."""
    alike: dict[str, list[int]] = {}
    for rn in ranks:
        alike.setdefault(_rank_line(rn)[len(f"rank {rn.rank}"):], []).append(rn.rank)
    return [(f"ranks {_ranks_text(rs)}" if len(rs) > 1 else f"rank {rs[0]}") + rest for rest, rs in alike.items()]


def _with_texts(report: dict) -> dict:
    """A stored report with each group's and rank's line of :func:`_lines` as its ``text`` (the page
    shows these, so that it says what ``graphdeck watch`` printed)."""
    try:
        for g in report.get("groups") or []:
            g["text"] = _group_line(LiveGroup(**{k: v for k, v in g.items() if k != "text"}))
        for rn in (report.get("ranks") or {}).values():
            rn["text"] = _rank_line(RankNow(**{k: v for k, v in rn.items() if k != "text"}))
    except (TypeError, KeyError, ValueError):  # a report of another version: its lines alone
        pass
    return report


def stack_lines(session: Session, run_id: int) -> list[str]:
    """Each rank's place from its latest stored stacks (the live watch's, or an imported debug
    server dump's): ``rank R: now at FILE:LINE in FN: SOURCE`` (the innermost user frame of the main
    thread, as the hang report finds it), with ``(the same in the last N dumps, over S s)`` when
    several periodic dumps showed it (NOTE: [Debug-server dumps] in store/debug_dumps.py)."""
    out = []
    for r, st in sorted(_stacks(session, run_id).items()):
        frame, source, inner = _where(_main_frames(st))
        same = st.get("same_for") or {}
        out.append(f"rank {r}: " + (f"now at {frame or inner}" if (frame or inner) else "no main-thread stack")
                   + (f": {source}" if source else "")
                   + (f" (the same in the last {same['snapshots']} dumps, over {same['seconds']:g} s)"
                      if (same.get("snapshots") or 0) > 1 else ""))
    return out


#: A rank with no heartbeat for this many of its intervals (at least :data:`STALE_MIN_S`) that did
#: not end has stopped beating: the job died or froze holding the GIL (``graphdeck watch`` exit 3).
STALE_BEATS, STALE_MIN_S = 10, 30.0


def progress_lines(beats: dict[int, dict], now: float) -> list[str]:
    """One line a rank from its heartbeat: ``rank R: step S, group G(desc) #completed (#enqueued
    pending N s); beat A s ago[; ended (how)]`` (what ``graphdeck watch`` prints as the job goes)."""
    out = []
    for r, b in sorted(beats.items()):
        groups = ", ".join(f"group {g}{'(' + v['desc'] + ')' if v.get('desc') else ''} #{v.get('completed')}"
                           + (f" (#{v['enqueued']} pending {now - float(v.get('since') or now):.0f} s)"
                              if (v.get("enqueued") or 0) > (v.get("completed") or 0) else "")
                           for g, v in sorted((b.get("groups") or {}).items()))
        age = now - float(b.get("t") or now)
        out.append(f"rank {r}: step {b.get('step') if b.get('step') is not None else '?'}"
                   + (f", {groups}" if groups else "") + f"; beat {age:.0f} s ago"
                   + (f"; ended ({b['ended']})" if b.get("ended") else ""))
    return out


def stale_limit_s(beats: dict[int, dict], stale_s: float | None = None) -> float:
    """Seconds without a heartbeat after which a rank that did not end has stopped beating."""
    if stale_s is not None:
        return stale_s
    interval = max((float(b.get("interval_s") or 0) for b in beats.values()), default=1.0)
    return max(STALE_MIN_S, STALE_BEATS * interval)


def live_state(session: Session, run_id: int, *, world_size: int | None = None, now: float | None = None) -> dict:
    """What the run's heartbeats and live hang report say now (``GET /api/runs/{run}/live``, the
    run page's live section)::

        {"run_id", "now": wall s, "state": "none" | "running" | "stalled" | "hang" | "ended" | "silent",
         "poll_s": seconds between two beats, "threshold_s", "timeout_s", "world_size",
         "ranks": [{"rank", "step": optimizer steps taken | None, "beat_age_s", "interval_s",
                    "ended": None | "close" | "exit", "stalled": {"group", "desc", "seq", "for_s"} | None,
                    "beating": not ended and a heartbeat within :func:`stale_limit_s`,
                    "groups": [{"group", "desc", "enqueued", "completed", "in_flight": bool | None,
                                "pending_s": seconds enqueued > completed held | None}]}],
         "lines": :func:`progress_lines`, "report": :func:`stored_report` | None (each of its
         groups and ranks with its line of the report as ``text``),
         "final": bool — nothing will change any more (every rank ended or stopped beating)}

    ``state``: ``none`` — no heartbeat (a run captured without the live watch, or an import);
    ``hang`` — a live hang report is stored; ``ended`` — every rank closed or exited; ``silent`` —
    no rank that did not end has beaten for :func:`stale_limit_s` (the job died, or froze holding
    the GIL); ``stalled`` — a rank says a collective is past the threshold (the report is being
    gathered); else ``running``. Strings are the job's (group descriptions): text, never markup."""
    now = time.time() if now is None else now
    beats = heartbeats(session, run_id)
    report = stored_report(session, run_id)
    limit = stale_limit_s(beats)
    ranks = []
    for r, b in sorted(beats.items()):
        groups = []
        for g, v in sorted((b.get("groups") or {}).items()):
            enq, done = v.get("enqueued"), v.get("completed")
            pending = (round(now - float(v["since"]), 3) if v.get("since") and (enq or 0) > (done or 0) else None)
            groups.append({"group": g, "desc": v.get("desc"), "enqueued": enq, "completed": done,
                           "in_flight": v.get("in_flight"), "pending_s": pending})
        age = now - float(b["t"]) if b.get("t") else None
        ranks.append({"rank": r, "step": b.get("step"),
                      "beating": not b.get("ended") and age is not None and age <= limit,
                      "beat_age_s": round(age, 3) if age is not None else None,
                      "interval_s": b.get("interval_s"), "ended": b.get("ended"),
                      "stalled": b.get("stalled") if not b.get("ended") else None, "groups": groups})
    gone = bool(beats) and all(b.get("ended") or now - float(b.get("t") or now) > limit for b in beats.values())
    if not beats and report is None:
        state = "none"
    elif report is not None:
        state = "hang"
    elif len(beats) >= (world_size or 1) and all(b.get("ended") for b in beats.values()):
        state = "ended"
    elif gone:
        state = "silent"
    elif any(rk["stalled"] for rk in ranks):
        state = "stalled"
    else:
        state = "running"
    return {"run_id": run_id, "now": now, "state": state, "world_size": world_size,
            "poll_s": max((float(b.get("interval_s") or 0) for b in beats.values()), default=None) or None,
            "threshold_s": next((b.get("threshold_s") for b in beats.values() if b.get("threshold_s")), None),
            "timeout_s": next((b.get("timeout_s") for b in beats.values() if b.get("timeout_s")), None),
            "ranks": ranks, "lines": progress_lines(beats, now), "report": _with_texts(report) if report else None,
            "final": state in ("ended", "silent") or (state == "hang" and gone)}


def request_evidence(engine, run_id: int, stalled: dict, interval_s: float, threshold_s: float | None = None) -> None:
    """Ask the run's agents, through the store, for their stall evidence (the ``graphdeck watch
    --threshold-s`` path): a row saying ``stalled`` (``{"group",
    "desc", "seq", "since", "for_s"}``); every live agent answers it at its next beat as it answers
    a rank's stall, the lowest rank writing the report. Stored as a :data:`REQUEST` record of rank 0."""
    from graphdeck.store.db import retrying, write_session

    def do():
        with write_session(engine) as s:
            s.add(CompileEvent(run_id=run_id, rank=0, name=REQUEST, compile_id=None, metadata_json="{}",
                               payload=json.dumps({"t": time.time(), "stalled": stalled, "by": "graphdeck watch",
                                                   "interval_s": interval_s, "threshold_s": threshold_s,
                                                   "ended": None})))

    retrying(do)


def write_hang_report(engine, run_id: int, *, rank: int, detected_at: float | None = None,
                      threshold_s: float | None = None) -> list[str]:
    """Compute :func:`live_hang` and store it as a ``graphdeck_hang_report`` record of ``rank``;
    returns its lines."""
    from graphdeck.store.db import retrying, write_session

    with Session(engine) as s:
        h = live_hang(s, run_id, detected_at=detected_at, threshold_s=threshold_s)

    def do():
        with write_session(engine) as s:
            s.add(CompileEvent(run_id=run_id, rank=rank, name=REPORT, compile_id=None,
                               metadata_json=json.dumps({"step": h.step, "groups": len(h.groups)}),
                               payload=json.dumps(h.to_dict(), default=str)))

    retrying(do)
    return h.lines


__all__ = ["HEARTBEAT", "REQUEST", "STACKS", "WATCH_RANK", "LiveGroup", "LiveHang", "RankNow", "REPORT", "heartbeats",
           "live_hang", "live_state", "progress_lines", "request_evidence", "stack_lines", "stale_limit_s",
           "stored_report",
           "write_hang_report"]
