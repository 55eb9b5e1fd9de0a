"""Verdicts from time (issue 38 items 2, 3, 6): a compile skew or a straggler's wait compared with
the job's collective timeout, placed in its training step, and the late rank's time explained.

# NOTE: [Time verdicts]
A rank that arrives late at a collective makes its peers wait inside it; past the process
group's timeout the job dies there. :mod:`~graphdeck.analysis.ranks.compile_skew` measures the
compile skew before the first collective, :func:`~graphdeck.analysis.ranks.cpu_collectives.rank_timing`
the traced straggler. Each becomes one :class:`TimeFinding` with a verdict:

* **FAIL**: the wait reaches the timeout of the group the collective ran in (``skew ≥ timeout``),
  or the job died there — the Flight Recorder shows that collective never completed — with a wait
  over :data:`WARN_FRACTION` of the timeout;
* **WARN**: the wait is at least :data:`WARN_FRACTION` of the timeout;
* **NOTE**: under that: told, no verdict (a first compile of 20 s on every rank is no skew at all);
  also a compile skew whose ranks hold no record of when the collective ran (no trace, no Flight
  Recorder dump reaching it): the first compile of each frame may come after it.

The timeout is the one the capture recorded for the collective's group (``graphdeck_process_groups``,
matched by the group's name or description), else :func:`~graphdeck.analysis.ranks.compile_skew.collective_timeout`.
The **step**: the profiler's ``ProfilerStep#N`` holding the collective (a trace), else — for a job
that died there — the last step of the waiting rank's gradient evidence (optimizer hooks or
backward count); else unknown, said so. The **place in the step**: from the collective's stack in
the Flight Recorder (a compiled region's frames, the autograd engine's backward, an optimizer's
``step``, else outside the compiled regions at the innermost user frame) or from the trace's
ranges enclosing the collective's call.

The **cause** of a straggler (item 6): the late rank's window before its arrival (from its
previous collective's end, else its step's start) is split into compile (its compile records'
wall time), forward, backward, optimizer and outside from its trace; recompiles in that window
that the waiting ranks did not make (a compile id ``f/c`` they lack) are named with their frame
and guard failure (``recompile_reasons``) as the cause when they take at least half the lateness.

Pure: reads the store, returns data; :mod:`graphdeck.analysis.ranks.core` puts the findings on
the report, and its ``verdict`` counts them (NOTE: [One rank verdict]).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.records import _ranks_text
from graphdeck.analysis.units import duration_text as _d
from graphdeck.store.schema import CompileEvent, GradStep

#: Share of the collective timeout from which a wait is a WARN (the checks' ``warn_fraction``).
WARN_FRACTION = 0.5
#: Share of a straggler's lateness its rank-only recompiles must take to be named the cause.
CAUSE_FRACTION = 0.5
_CID = re.compile(r"^!?(\d+)/(\d+)")
_PLACES = (("compile", ()), ("data loading", ("enumerate(DataLoader)",)), ("optimizer", ("Optimizer.step#",)),
           ("backward", ("CompiledFunctionBackward", "autograd::engine::evaluate_function")),
           ("forward", ("CompiledFunction", "Torch-Compiled Region")))


@dataclass
class TimeFinding:
    """One wait judged against the collective timeout (times in seconds)."""

    kind: str  # "compile skew" | "straggler" | "outside skew" (time outside the compiled step)
    verdict: str  # "FAIL" | "WARN" | "NOTE"
    message: str
    late_rank: int | None
    waiting_ranks: list[int]
    wait_s: float
    timeout_s: float | None
    timeout_source: str | None
    share: float | None  # wait / timeout
    died: bool = False  # the Flight Recorder shows the collective never completed
    collective: str | None = None
    step: int | None = None
    step_source: str | None = None
    place: str | None = None
    cause: str | None = None
    split_s: dict = field(default_factory=dict)  # the late rank's window: compile/forward/backward/optimizer/outside
    recompiles: list[dict] = field(default_factory=list)  # {"compile_id", "frame", "reason", "seconds"}

    def to_dict(self) -> dict:
        return asdict(self)


def judge(wait_s: float, timeout_s: float | None, died: bool, warn_fraction: float = WARN_FRACTION) -> str:
    """FAIL / WARN / NOTE for a wait of ``wait_s`` against ``timeout_s`` (NOTE: [Time verdicts])."""
    share = wait_s / timeout_s if timeout_s else None
    if share is None:
        return "NOTE"
    if share >= 1 or (died and share >= warn_fraction):
        return "FAIL"
    return "WARN" if share >= warn_fraction else "NOTE"


def group_timeouts(session: Session, run_id: int) -> dict[str, float]:
    """Process group name and description → its timeout (s), from the capture's records."""
    from graphdeck.analysis.ranks.compile_skew import PG_EVENT

    out: dict[str, float] = {}
    for (payload,) in session.execute(select(CompileEvent.payload).where(
            CompileEvent.run_id == run_id, CompileEvent.name == PG_EVENT)):
        try:
            groups = json.loads(payload or "{}").get("groups") or []
        except (ValueError, AttributeError):
            continue
        for g in groups:
            t = g.get("timeout_s") if isinstance(g, dict) else None
            if isinstance(t, (int, float)) and t > 0:
                for key in (g.get("name"), g.get("desc")):
                    if key is not None:
                        out.setdefault(str(key), float(t))
    return out


def _timeout_for(session: Session, run_id: int, groups: tuple, memo: dict) -> tuple[float, str]:
    if "groups" not in memo:
        memo["groups"] = group_timeouts(session, run_id)
    for g in groups:
        if g is not None and str(g) in memo["groups"]:
            return memo["groups"][str(g)], f"the timeout recorded for process group {g}"
    from graphdeck.analysis.ranks.compile_skew import collective_timeout

    return collective_timeout(session, run_id)


def _grad_step(session: Session, run_id: int, ranks: list[int]) -> int | None:
    return session.scalar(select(func.max(GradStep.step_last)).where(GradStep.run_id == run_id,
                                                                         GradStep.rank.in_(ranks)))


def stack_place(stack: list[str]) -> str | None:
    """Where in the step a collective was issued, from its Flight Recorder stack (innermost
    first: ``"file:line in fn"``): ``inside a compiled region``, ``in the backward``, ``in the
    optimizer step`` or ``outside the compiled regions (at <user frame>)``; None without frames."""
    from graphdeck.analysis.ranks.flight import COMPILED_FRAMES, LIBRARY_FRAMES

    if not stack:
        return None
    user = next((f for f in stack if not any(lib in f for lib in LIBRARY_FRAMES)), None)
    at = f" (at {user})" if user else ""
    if any(c in f for f in stack for c in COMPILED_FRAMES):
        return "inside a compiled region" + at
    if any("torch/autograd/" in f and "backward" in f for f in stack):
        return "in the backward" + at
    if any("torch/optim/" in f for f in stack):
        return "in the optimizer step" + at
    return "outside the compiled regions" + at


def _fr_entry(session: Session, run_id: int, rank: int, t_ns: int) -> dict | None:
    """The rank's Flight Recorder entry created at ``t_ns`` (its group, state, stack)."""
    row = session.execute(select(CompileEvent.payload).where(
        CompileEvent.run_id == run_id, CompileEvent.rank == rank, CompileEvent.name == "flight_recorder")
        .order_by(CompileEvent.id.desc())).first()
    try:
        dump = json.loads(row[0]) if row is not None and row[0] else None
        last = max(e[8] for e in dump["entries"])
        for e in dump["entries"]:
            if e[8] == t_ns:
                pg = dump["pgs"][e[0]] if isinstance(e[0], int) else [e[0], None]
                stacks = dump.get("stacks") or []
                stack = stacks[e[7]] if isinstance(e[7], int) and 0 <= e[7] < len(stacks) else []
                return {"group": pg[0], "desc": pg[1], "seq": e[1], "stack": list(stack),
                        "died": e[8] == last and _died(dump, e)}
    except (TypeError, ValueError, KeyError, IndexError):
        return None
    return None


#: The capture's dump reasons that mean the rank ended on an error (capture/flight.py).
DIED_SOURCES = ("capture:exception", "capture:sigterm")


def _reason(metadata_json: str | None) -> str | None:
    """The capture's reason for a stored dump (its record's metadata), None for another one."""
    try:
        meta = json.loads(metadata_json or "{}")
    except ValueError:
        return None
    return meta.get("reason") if isinstance(meta, dict) else None


def _died(dump: dict, e: list) -> bool:
    """Whether the rank died inside entry ``e``, its last one: its dump was written as it ended on
    an error (:data:`DIED_SOURCES`), and — where the recorder tracks completion (some entry of the
    dump completed: NCCL; gloo leaves every entry "scheduled") — ``e`` never completed."""
    tracked = any(x[4] == 2 for x in dump["entries"])
    return dump.get("source") in DIED_SOURCES and not (tracked and e[4] == 2)


def skew_finding(session: Session, run, skew, warn_fraction: float = WARN_FRACTION,
                 memo: dict | None = None) -> TimeFinding | None:
    """The compile skew (a :class:`~graphdeck.analysis.ranks.compile_skew.CompileSkew` with a
    ``finding``) judged against the timeout of the group of the first collective; None without one."""
    if skew.finding is None or skew.slowest is None:
        return None
    memo = {} if memo is None else memo
    waiting = sorted(r for r in skew.ranks if r != skew.slowest)
    entries = {r: _fr_entry(session, run.id, r, v.first_collective_ns) for r, v in skew.ranks.items()
               if v.basis == "flight recorder" and v.first_collective_ns}
    groups = tuple(x for e in entries.values() if e for x in (e["group"], e["desc"]))
    groups += tuple(v.first_collective_group for v in skew.ranks.values() if v.first_collective_group)
    timeout, source = _timeout_for(session, run.id, groups, memo)
    died = any(e is not None and e["died"] for r, e in entries.items() if r in waiting)
    # Without a record of when the collective ran (first compiles of each frame summed), the skew
    # may hold compiles made after it: told, never judged.
    unplaced = any(v.basis == "initial compiles" for v in skew.ranks.values())
    verdict = "NOTE" if unplaced else judge(skew.skew_s, timeout, died, warn_fraction)
    f = TimeFinding("compile skew", verdict, "", skew.slowest, waiting, skew.skew_s, timeout, source,
                    skew.skew_s / timeout if timeout else None, died)
    first = skew.ranks[waiting[0]] if waiting else None
    f.collective = first.first_collective if first else None
    steps = [v.first_collective_step for r, v in skew.ranks.items() if v.first_collective_step is not None]
    if steps:
        f.step, f.step_source = min(steps), "the profiler's step of that collective"
    elif died:
        f.step = _grad_step(session, run.id, waiting)
        f.step_source = "the last step of the waiting ranks' gradient evidence" if f.step is not None else None
    stacks = [e["stack"] for r, e in entries.items() if e and r in waiting and e["stack"]]
    f.place = stack_place(stacks[0]) if stacks else None
    slow, fast = skew.ranks[skew.slowest], skew.ranks[skew.fastest]
    head = {"FAIL": "FAIL", "WARN": "WARN", "NOTE": "note"}[verdict]
    step = f"step {f.step}" + (f" ({f.step_source})" if f.step_source else "") if f.step is not None else \
        "step unknown (no profiler step or gradient evidence reaches that collective)"
    f.message = (f"{head}: compile skew at {step}: rank {skew.slowest} compiled {_d(slow.before_first_collective_s, 1)} "
                 f"before its first collective, rank {skew.fastest} {_d(fast.before_first_collective_s, 1)}; ranks "
                 f"{_ranks_text(waiting)} waited about {_d(skew.skew_s, 1)} in {f.collective or 'that collective'}"
                 + (f" issued {f.place}" if f.place else "")
                 + f": {f.share:.0%} of the {timeout:g} s collective timeout ({source})"
                 + ("; the job died there (its last Flight Recorder entry, dumped as it ended on an error)" if died else "")
                 + ("; not judged: no record of when that collective ran (the first compile of each frame is "
                    "counted)" if unplaced else ""))
    return f


def died_finding(session: Session, run, warn_fraction: float = WARN_FRACTION, memo: dict | None = None,
                 min_skew_s: float = 2.0) -> TimeFinding | None:
    """The collective the job died in (a waiting rank's last Flight Recorder entry, its dump written
    as it ended on an error: :func:`_died`) and the compile time each rank spent before it, since
    its previous collective (a rank that never issued it: since its last one). A compile skew there
    of at least ``min_skew_s`` s is judged against that group's timeout (NOTE: [Time verdicts]):
    any skew, not only before the first collective (a warm rank that compiled ahead, a cold one
    that compiles at its first use). None when no rank died in a collective or no skew explains it."""
    from graphdeck.analysis.ranks.compile_skew import _metric_rows
    from graphdeck.analysis.ranks.flight import load_dumps

    memo = {} if memo is None else memo
    latest = {r: m for r, m in session.execute(select(CompileEvent.rank, CompileEvent.metadata_json).where(
        CompileEvent.run_id == run.id, CompileEvent.name == "flight_recorder").order_by(CompileEvent.id))}
    if not any(f"capture:{_reason(m)}" in DIED_SOURCES for m in latest.values()):
        return None  # no rank's dump was written as it ended on an error: read no payload (1,024 ranks)
    dumps = load_dumps(session, run.id)
    records = _metric_rows(session, run.id)
    ents: dict[int, list] = {}
    for r, d in dumps.items():
        try:
            pgs = d.get("pgs") or []
            ents[r] = sorted(((str(pgs[e[0]][0]) if isinstance(e[0], int) else str(e[0]), e[1]), e[8], e)
                             for e in d["entries"] if e[1] and e[8])
        except (TypeError, KeyError, IndexError):
            continue
    dead = [(es[-1][0], r) for r, es in ents.items() if es and _died(dumps[r], es[-1][2])]
    if len(ents) < 2 or not dead:
        return None
    key = min(dead, key=lambda kr: next(t for k, t, _e in ents[kr[1]] if k == kr[0]))[0]
    spent: dict[int, tuple[float, list[str]]] = {}
    for r, es in ents.items():
        at = next((i for i, (k, _t, _e) in enumerate(es) if k == key), None)
        t0 = es[at - 1][1] if at else (es[-1][1] if at is None else 0)
        t1 = es[at][1] if at is not None else 2 ** 63
        wins = [(a, b, cid) for a, b, cid, _n in _compile_windows(session, run.id, r, records.get(r, []))
                if _overlap(a, b, t0, t1)]
        spent[r] = (sum(_overlap(a, b, t0, t1) for a, b, _c in wins) / 1e9, sorted({c for _a, _b, c in wins if c}))
    late = max(sorted(spent), key=lambda r: spent[r][0])
    fast = min(sorted(spent), key=lambda r: spent[r][0])
    skew_s = spent[late][0] - spent[fast][0]
    if skew_s < min_skew_s:
        return None
    waiting = sorted(r for r in spent if r != late)
    desc = next((dumps[r]["pgs"][e[0]][1] for r in waiting for k, _t, e in ents[r] if k == key
                 and isinstance(e[0], int)), None)
    timeout, source = _timeout_for(session, run.id, (key[0], desc), memo)
    f = TimeFinding("compile skew", judge(skew_s, timeout, True, warn_fraction), "", late, waiting, skew_s,
                    timeout, source, skew_s / timeout if timeout else None, died=True)
    sig = next((e[3] for r in waiting for k, _t, e in ents[r] if k == key), None)
    sigs = dumps[waiting[0]].get("sigs") or []
    op = sigs[sig][0] if isinstance(sig, int) and 0 <= sig < len(sigs) else "collective"
    f.collective = f"{op} #{key[1]} of group {desc or key[0]} (flight recorder)"
    f.step = _grad_step(session, run.id, waiting)
    f.step_source = "the last step of the waiting ranks' gradient evidence" if f.step is not None else None
    stacks = dumps[waiting[0]].get("stacks") or []
    st = next((e[7] for k, _t, e in ents[waiting[0]] if k == key), None)
    f.place = stack_place(list(stacks[st])) if isinstance(st, int) and 0 <= st < len(stacks) else None
    head = {"FAIL": "FAIL", "WARN": "WARN", "NOTE": "note"}[f.verdict]
    step = f"step {f.step} ({f.step_source})" if f.step is not None else \
        "step unknown (no gradient evidence reaches that collective)"
    def one(r: int) -> str:
        return (f"rank {r} compiled {_d(spent[r][0], 1)}" + (f" (compiles {', '.join(spent[r][1])})" if spent[r][1] else ""))
    f.message = (f"{head}: compile skew at {step}: the job died in {f.collective}"
                 + (f" issued {f.place}" if f.place else "") + "; since its previous collective "
                 + ", ".join(one(r) for r in [late, *waiting]) + f": ranks {_ranks_text(waiting)} waited about {_d(skew_s, 1)} for "
                 f"rank {late}, {f.share:.0%} of the {timeout:g} s collective timeout ({source})")
    f.cause = f"rank {late} compiling: " + one(late)
    return f


def _compile_windows(session: Session, run_id: int, rank: int, rows: list | None = None) -> list[tuple[int, int, str, str]]:
    """``(start ns, end ns, compile id, record name)`` of the rank's compile records (``rows``: as
    :func:`~graphdeck.analysis.ranks.compile_skew._metric_rows` gives them for the rank, else read)."""
    from graphdeck.analysis.ranks.compile_skew import _metric_rows, _parse_metrics

    out = []
    for name, cid, _key, values in (_metric_rows(session, run_id, [rank]).get(rank, []) if rows is None else rows):
        m_cid, dur, start, _failed, _cache = _parse_metrics(values)
        if start:
            out.append((start, start + int(dur * 1e9), cid or m_cid, name))
    return out


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def trace_split(events: list, t0: int, t1: int, compiles: list[tuple[int, int]]) -> dict[str, float]:
    """Seconds of ``[t0, t1)`` (the rank's own clock, ns; ``events``: its trace's events) spent compiling (``compiles``), in the
    data loader's, optimizer's, backward and forward ranges of its trace (in that order of
    precedence) and outside them: ``{"compile", "data loading", "optimizer", "backward", "forward",
    "outside"}``."""
    from graphdeck.analysis.traces.data import total_ns, union_ns

    taken = union_ns((max(a, t0), min(b, t1)) for a, b in compiles if _overlap(a, b, t0, t1))
    out = {"compile": total_ns(taken) / 1e9}
    events = [e for e in events if _overlap(e.ts, e.end, t0, t1)]
    for part, names in _PLACES[1:]:
        mine = union_ns((max(e.ts, t0), min(e.end, t1)) for e in events if e.name.startswith(names))
        both = union_ns([*taken, *mine])
        out[part] = (total_ns(both) - total_ns(taken)) / 1e9
        taken = both
    out["outside"] = max(0.0, (t1 - t0 - total_ns(taken)) / 1e9)
    return {k: round(v, 3) for k, v in out.items()}


def straggler_finding(session: Session, report, matched: dict, timing: dict,
                      warn_fraction: float = WARN_FRACTION, memo: dict | None = None) -> TimeFinding | None:
    """The traced straggler (``timing``: :func:`~graphdeck.analysis.ranks.cpu_collectives.rank_timing`
    of ``matched``) at the collective its peers waited longest in, judged against that group's
    timeout, placed in its step, with the late rank's window split and its rank-only recompiles."""
    late = timing.get("straggler")
    if late is None:
        return None
    from graphdeck.analysis.traces.data import load_events

    memo = {} if memo is None else memo
    colls = [c for c in matched.get("collectives") or [] if not c.get("suspect") and c["last_rank"] == late]
    if not colls:
        return None
    c = max(colls, key=lambda c: max(v["wait_ns"] for r, v in c["ranks"].items() if r != late))
    waiting = sorted(r for r in c["ranks"] if r != late)
    wait_s = max(c["ranks"][r]["wait_ns"] for r in waiting) / 1e9
    timeout, source = _timeout_for(session, report.run_id, (c["group"],), memo)
    verdict = judge(wait_s, timeout, False, warn_fraction)
    f = TimeFinding("straggler", verdict, "", late, waiting, wait_s, timeout, source,
                    wait_s / timeout if timeout else None)
    f.collective = f"{c['ranks'][late].get('kernel') or c['kind']} #{c['seq']} of group {c['group']}"
    f.step, f.step_source = c.get("step"), "the profiler's step" if c.get("step") is not None else None
    # The late rank's window on its own clock: from its previous collective's end (else its step's start).
    offset = (matched.get("offsets") or {}).get(late, {}).get("offset_ns", 0)
    arrive = c["ranks"][late]["arrive_ns"] + offset
    before = [o["ranks"][late]["end_ns"] + offset for o in matched["collectives"]
              if late in o["ranks"] and o["ranks"][late]["end_ns"] + offset <= arrive]
    tid = (matched.get("ranks") or {}).get(late)
    events = load_events(session, tid) if tid is not None else []  # the late rank's trace, read once
    step_start = _step_start(events, f.step)
    t0 = max([*before, *([step_start] if step_start else [])], default=None)
    windows = _compile_windows(session, report.run_id, late)
    if t0 is not None:
        f.split_s = trace_split(events, t0, arrive, [(a, b) for a, b, _c, _n in windows]) if tid else {}
        f.place = _trace_place(events, c, late, offset) if tid else None
        peers = {e.compile_id for r in waiting for e in report.sequences.get(r, [])}
        reasons = {e.compile_id: (e.recompile_reason, e.frame) for e in report.sequences.get(late, [])}
        spent: dict[str, float] = {}
        for a, b, cid, _n in windows:
            m = _CID.match(cid or "")
            if m and int(m.group(2)) > 0 and cid not in peers and _overlap(a, b, t0, arrive):
                spent[cid] = spent.get(cid, 0.0) + _overlap(a, b, t0, arrive) / 1e9
        f.recompiles = [{"compile_id": cid, "frame": (reasons.get(cid) or (None, None))[1],
                         "reason": (reasons.get(cid) or (None, None))[0], "seconds": round(s, 3)}
                        for cid, s in sorted(spent.items())]
        lateness = (arrive - offset - min(v["arrive_ns"] for v in c["ranks"].values())) / 1e9
        if f.recompiles and sum(spent.values()) >= CAUSE_FRACTION * lateness:
            f.cause = ("rank {} recompiled alone before it: ".format(late) + "; ".join(
                f"compile {x['compile_id']}" + (f" of frame {x['frame']}" if x["frame"] else "")
                + f", {_d(x['seconds'], 1)}" + (f" (guard failed: {x['reason']})" if x["reason"] else "")
                for x in f.recompiles))
        elif f.split_s:
            f.cause = f"rank {late}'s time before it: " + ", ".join(
                f"{k} {_d(v)}" for k, v in f.split_s.items() if v)
    head = {"FAIL": "FAIL", "WARN": "WARN", "NOTE": "note"}[verdict]
    step = f"step {f.step}" if f.step is not None else "step unknown (the collective is in no profiler step)"
    f.message = (f"{head}: straggler at {step}: ranks {_ranks_text(waiting)} waited {_d(wait_s)} for rank {late} in "
                 f"{f.collective}" + (f" issued {f.place}" if f.place else "")
                 + f" ({f.share:.1%} of the {timeout:g} s collective timeout, {source})"
                 + (f"; cause: {f.cause}" if f.cause else ""))
    return f


def _step_start(events: list, step: int | None) -> int | None:
    if step is None:
        return None
    starts = [e.ts for e in events if e.name == f"ProfilerStep#{step}"]
    return min(starts) if starts else None


def _trace_place(events: list, c: dict, late: int, offset: int) -> str | None:
    """Where the late rank issued collective ``c``: the trace ranges (not on a backend worker
    thread) enclosing its start."""
    t = c["ranks"][late]["arrive_ns"] + offset
    worker = {(e.pid, e.tid) for e in events if e.name == c["ranks"][late].get("kernel")}
    around = [e for e in events if e.ts <= t < e.end and (e.pid, e.tid) not in worker]
    for part, names in reversed(_PLACES[1:]):
        if any(e.name.startswith(names) for e in around):
            return {"forward": "inside a compiled region", "backward": "in the backward",
                    "optimizer": "in the optimizer step", "data loading": "while loading data"}[part]
    return "outside the compiled regions" if around else None


#: The capture's window of time outside the compiled step (graphdeck.capture.heartbeat's; kept
#: here so that the checks import no capture): the latest steps, and the longest.
OUTSIDE_RECENT, OUTSIDE_KEPT = 32, 16
OUTSIDE_CAUSE = "outside the compiled step (data loader/eval)"


def _unlisted(mine: dict[int, float | None]) -> float | None:
    """At most the seconds a rank spent outside the compiled step at a step it went through that its
    heartbeat does not list: 0 while it lists every step (fewer than the capture's recent window),
    else its shortest kept longest time (the capture keeps the recent steps and the longest ones)."""
    if len(mine) < OUTSIDE_RECENT:
        return 0.0
    known = sorted(v for v in mine.values() if v is not None)
    return known[-min(OUTSIDE_KEPT, len(known))] if known else None


def outside_finding(session: Session, run, warn_fraction: float = WARN_FRACTION,
                    memo: dict | None = None) -> TimeFinding | None:
    """The step at which one rank spent longest outside the compiled step (NOTE: [Time outside
    the compiled step] in capture/heartbeat.py: from its last optimizer step to its next
    grad-enabled compiled call — its data loader, an evaluation it runs alone) beyond its peers',
    judged against the collective timeout (NOTE: [Time verdicts]): the peers waited about that
    difference in the step's first collective. Read from the ranks' heartbeats; None without two
    ranks' heartbeats, without a collective in the run's heartbeats, or under a WARN."""
    from graphdeck.analysis.ranks.live import heartbeats

    memo = {} if memo is None else memo
    beats = heartbeats(session, run.id)
    if len(beats) < 2 or not any((v.get("enqueued") or 0) > 0 for b in beats.values()
                                 for v in (b.get("groups") or {}).values()):
        return None
    outside: dict[int, dict[int, float]] = {}
    for r, b in beats.items():
        try:
            outside[r] = {int(k): (None if v is None else float(v)) for k, v in (b.get("outside") or {}).items()}
        except (TypeError, ValueError, AttributeError):
            outside[r] = {}
    best = None
    for step in sorted({k for o in outside.values() for k, v in o.items() if v is not None}):
        late = max(sorted(r for r, o in outside.items() if o.get(step) is not None), key=lambda r: outside[r][step])
        # peers that went through the step: its own time outside, listed or (not listed) short
        peers = {r: outside[r].get(step, _unlisted(outside[r])) for r, b in beats.items()
                 if r != late and (step in outside[r] or (b.get("step") or 0) >= step)}
        if not peers or None in peers.values():  # a peer's time there holds a collective: not comparable
            continue
        wait = outside[late][step] - max(peers.values())
        if best is None or wait > best[0]:
            best = (wait, step, late, peers)
    if best is None or best[0] <= 0:
        return None
    wait, step, late, peers = best
    hb_timeout = next((float(b["timeout_s"]) for b in beats.values() if b.get("timeout_s")), None)
    timeout, source = ((hb_timeout, "the default process group's timeout, from the ranks' heartbeats")
                       if hb_timeout else _timeout_for(session, run.id, (), memo))
    waiting = sorted(peers)
    died = any((beats[r].get("stalled") and beats[r].get("step") == step) for r in waiting)
    verdict = judge(wait, timeout, died, warn_fraction)
    if verdict == "NOTE":
        return None
    f = TimeFinding("outside skew", verdict, "", late, waiting, round(wait, 3), timeout, source,
                    wait / timeout if timeout else None, died)
    f.step, f.step_source = step, "the ranks' optimizer-step hooks (live watch)"
    f.place, f.cause = OUTSIDE_CAUSE, OUTSIDE_CAUSE
    f.split_s = {"outside": outside[late][step]}
    head = {"FAIL": "FAIL", "WARN": "WARN"}[verdict]
    theirs = ", ".join(f"rank {r} {v:.1f} s" for r, v in sorted(peers.items()))
    f.message = (f"{head}: time outside the compiled step at step {step}: rank {late} spent "
                 f"{outside[late][step]:.1f} s {OUTSIDE_CAUSE} before it ({theirs}); ranks {_ranks_text(waiting)} "
                 f"waited about {wait:.1f} s in the step's first collective: {f.share:.0%} of the {timeout:g} s "
                 f"collective timeout ({source})"
                 + ("; the job died there (a waiting rank stalled in that step)" if died else "")
                 + f"; cause: rank {late} {OUTSIDE_CAUSE}")
    return f


def time_findings(session: Session, report, skew, matched: dict | None,
                  warn_fraction: float = WARN_FRACTION) -> list[TimeFinding]:
    """The run's compile skew and traced straggler as :class:`TimeFinding` (NOTE: [Time
    verdicts]); ``skew``: :func:`~graphdeck.analysis.ranks.compile_skew.compile_skew` of the run,
    ``matched``: :func:`~graphdeck.analysis.traces.collectives.align_and_match`'s result (None
    under two traces). Raises ValueError for ``warn_fraction`` outside (0, 1]."""
    if not 0 < warn_fraction <= 1:
        raise ValueError(f"time_findings: warn_fraction must be in (0, 1] (got {warn_fraction})")
    from graphdeck.store.schema import Run

    memo: dict = {}
    run = session.get(Run, report.run_id)
    died = died_finding(session, run, warn_fraction, memo)
    first = skew_finding(session, run, skew, warn_fraction, memo)
    if died is not None and first is not None and first.died:
        first = None  # the same collective, the same wait: one finding (the per-collective windows)
    out = [died, first, outside_finding(session, run, warn_fraction, memo)]
    timing = (matched or {}).get("timing") or {}
    if matched and timing.get("straggler") is not None:
        out.append(straggler_finding(session, report, matched, timing, warn_fraction, memo))
    return [f for f in out if f is not None]


def judge_report(session: Session, report, skew, matched: dict | None, warn_fraction: float | None = None) -> list[str]:
    """Set ``report.time_findings`` (:func:`time_findings`) and return check-ranks' notes of
    time: the compile skew and straggler texts of those judged NOTE (a WARN or FAIL is shown as
    its finding instead, never twice), and the cause of each NOTE that has one."""
    timing = (matched or {}).get("timing") or {}
    report.time_findings = time_findings(session, report, skew, matched,
                                         WARN_FRACTION if warn_fraction is None else warn_fraction)
    judged = {f.kind for f in report.time_findings if f.verdict != "NOTE"}
    parts = [text for text in ((None if "compile skew" in judged else skew.finding),
                               *(timing.get("parts") or [timing.get("message")])) if text]
    parts = [p for p in parts if not ("straggler" in judged and p.startswith("straggler:"))]
    return parts + [f"{f.kind} explained: {f.message.removeprefix('note: ')}" for f in report.time_findings
                    if f.verdict == "NOTE" and f.cause] + hang_steps(session, report)


def _last_steps(session: Session, run_id: int, ranks: list[int]) -> dict[int, int]:
    """rank → the last step its gradient evidence recorded (its last backward's step)."""
    return dict(session.execute(select(GradStep.rank, func.max(GradStep.step_last)).where(
        GradStep.run_id == run_id, GradStep.rank.in_(ranks)).group_by(GradStep.rank)).all())


def hang_steps(session: Session, report, limit: int = 8) -> list[str]:
    """Per Flight Recorder mismatch (a hang; :mod:`~graphdeck.analysis.ranks.flight`): where in the
    step each side was — the place its entry was issued from (its stack: :func:`stack_place`) — and
    the training step each rank had reached by its gradient evidence (the last backward it
    recorded), as check-ranks notes; ``limit`` ranks a side. Empty without mismatches."""
    out = []
    for m in (report.flight.mismatches if report.flight else []):
        ranks = sorted({*m.reached, *m.not_reached})
        steps = _last_steps(session, report.run_id, ranks)
        sides = []
        for what, rs, refs in (("issued it", m.reached, m.issued), ("were instead in", m.not_reached, m.doing)):
            by: dict[str, list[int]] = {}
            for r in rs[:limit]:
                e = refs.get(r)
                if e is None:
                    continue
                place = stack_place(e.stack) or ("inside a compiled region" if e.compiled else None)
                head = "" if what == "issued it" else f"{e.op} #{e.seq} of group {e.group} "
                by.setdefault(f"{what} {head}{place or '(no stack recorded)'}", []).append(r)
            sides += [f"ranks {_ranks_text(rs2)} {text}" for text, rs2 in by.items()]
        told = ", ".join(f"rank {r} step {steps[r]}" for r in ranks[:limit] if r in steps)
        out.append(f"hang step: group {m.desc or m.group} collective #{m.seq} {m.op or ''}".rstrip() + ": "
                   + ("; ".join(sides) + "; " if sides else "")
                   + (f"the last backward each rank recorded: {told} (gradient evidence)" if told
                      else "step unknown (no gradient evidence or profiler step reaches the hang)"))
    return out
