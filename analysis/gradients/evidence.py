"""Run-time gradient evidence in the gradient report: per step and rank, what arrived.

Reads ``grad_steps`` rows (written by :mod:`graphdeck.capture.grad_evidence`, see NOTE:
[Gradient evidence] there) and the ``graphdeck_watch`` compile record, and

* states the report's **coverage** (:func:`coverage`): ranks seen against the run's world size,
  steps and backward passes per rank, whether the parameter list is the model's own (capture)
  or only what graphs read (a log import), and whether each rank's capture finished;
* **applies** the evidence to the graph analysis' rows (:func:`apply_evidence`): a parameter that
  received an all-zero gradient from a compiled region whose outputs the loss skipped is
  ``DEAD_END`` from that step; one that received none is ``NO_GRAD`` (or stays ``NOT_IN_GRAPH``);
  one that got a gradient at every observed step is ``OK`` even if no graph reads it (eager code);
* and turns what differs between ranks, or repeats within one backward, into findings with the
  consequence for the job that ran (:func:`evidence_findings`).

A per-parameter strip (:func:`strips`) gives ``[step_first, step_last, state]`` segments per rank
for the API and the gradients page; states: ``ok``, ``none``, ``zero``, ``multi``, ``frozen``,
``unobserved``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.report import (
    DDP_UNUSED_ERROR,
    Finding,
    ParamRow,
    ddp_static_finding,
    ddp_unused_finding,
)
from graphdeck.analysis.ranks.records import _ranks_phrase, _ranks_text

DDP_READY_TWICE = "Expected to mark a variable ready only once"
BAD = ("none", "zero", "multi")


@dataclass
class Segment:
    """Steps ``first``…``last`` (0-based, inclusive) of one rank in one state."""

    first: int
    last: int
    n_backward: int
    state: dict
    closed: bool
    source: str


@dataclass
class Evidence:
    """The run's evidence by rank, and the ``graphdeck_watch`` records (by rank)."""

    by_rank: dict[int, list[Segment]] = field(default_factory=dict)
    watch: dict[int, dict] = field(default_factory=dict)
    graph_ranks: set[int] = field(default_factory=set)  # ranks that stored a compiled graph
    off: dict[int, str] = field(default_factory=dict)  # rank -> why the capture observed nothing
    backward_done: set[int] = field(default_factory=set)  # ranks with a graphdeck_grads_observed record
    ca_ranks: set[int] = field(default_factory=set)  # ranks read at each step under compiled autograd
    imported: bool = False  # graphs from an imported TORCH_TRACE log (its parameters: what graphs read)

    def __bool__(self) -> bool:
        return bool(self.by_rank)


def load(session: Session, run_id: int) -> Evidence:
    """The ``grad_steps`` rows of ``run_id`` (unreadable state JSON: the row is kept with an empty
    state and counted in ``state["unreadable"]``)."""
    ev = Evidence()
    from sqlalchemy import inspect

    ev.imported = session.execute(text(
        "SELECT 1 FROM graphs WHERE run_id = :r AND meta_json LIKE '%\"source\": \"torch_trace\"%' LIMIT 1"),
        {"r": run_id}).first() is not None
    if not inspect(session.connection()).has_table("grad_steps"):  # a store older than schema 3
        return ev
    for rank, first, last, n, source, closed, state in session.execute(text(
            "SELECT rank, step_first, step_last, n_backward, step_source, closed, state_json FROM grad_steps "
            "WHERE run_id = :r ORDER BY rank, step_first, id"), {"r": run_id}):
        try:
            st = json.loads(state or "{}")
        except ValueError:
            st = {"unreadable": 1}
        ev.by_rank.setdefault(rank, []).append(Segment(first, last, n, st, bool(closed), source))
    ev.graph_ranks = {r for (r,) in session.execute(text("SELECT DISTINCT rank FROM graphs WHERE run_id = :r"),
                                                    {"r": run_id})}
    for rank, payload in session.execute(text(
            "SELECT rank, payload FROM compile_events WHERE run_id = :r AND name = 'graphdeck_watch' ORDER BY id"),
            {"r": run_id}):
        try:
            ev.watch[rank] = json.loads(payload or "{}")
        except ValueError:
            ev.watch[rank] = {}
        if ev.watch[rank].get("evidence_off"):
            ev.off[rank] = ev.watch[rank]["evidence_off"]
    ev.backward_done = {r for (r,) in session.execute(text(
        "SELECT DISTINCT rank FROM compile_events WHERE run_id = :r AND name = 'graphdeck_grads_observed'"),
        {"r": run_id})}
    ev.ca_ranks = {r for (r,) in session.execute(text(  # NOTE: [Evidence under compiled autograd] (capture/grad_fsdp.py)
        "SELECT DISTINCT rank FROM compile_events WHERE run_id = :r AND name = 'graphdeck_evidence_mode'"), {"r": run_id})}
    for rank, payload in session.execute(text(
            "SELECT rank, payload FROM compile_events WHERE run_id = :r AND name = 'graphdeck_evidence_off'"),
            {"r": run_id}):
        try:
            ev.off[rank] = json.loads(payload or "{}").get("reason") or "the capture stopped observing"
        except ValueError:
            ev.off[rank] = "the capture stopped observing"
    return ev


def _param_state(seg: Segment, names: list[str]) -> str:
    st = seg.state
    if st.get("partial") and any(n in st.get("none", ()) for n in names):
        return "unobserved"  # the backward died before reaching it
    for key in ("none", "zero"):
        if any(n in st.get(key, ()) for n in names):
            return key
    if any(n in (st.get("multi") or {}) for n in names):
        return "multi"
    if any(n in st.get("frozen", ()) for n in names):
        return "frozen"
    if any(n in st.get("unobserved", ()) for n in names):
        return "unobserved"
    return "ok"


# NOTE: [Several backward passes in one step]
# A row of the evidence is one or more backward passes with one state; an optimizer step that runs
# several (gradient accumulation, one backward per model or per microbatch) whose states differ
# gives several rows of that step. What the optimizer sees at the step is what they accumulated:
# a gradient if any of them gave one. So a step's state combines its rows: ``multi`` (accumulated
# twice in one backward: a finding of its own) first, then ``ok`` (a real gradient arrived), then
# ``zero``, ``none``; ``frozen``/``unobserved`` only when nothing else was seen.
_COMBINE_ORDER = ("multi", "ok", "zero", "none", "unobserved", "frozen")


def _combine(a: str, b: str) -> str:
    return a if _COMBINE_ORDER.index(a) <= _COMBINE_ORDER.index(b) else b


def timeline(ev: Evidence, rank: int, names: list[str]) -> list[list]:
    """``[[first, last, state], …]`` of one parameter (any of its tied ``names``) on ``rank``, one
    state per step (rows of one step combined: NOTE: [Several backward passes in one step]),
    adjacent segments of one state merged."""
    out: list[list] = []
    for seg in ev.by_rank.get(rank, []):
        state = _param_state(seg, names)
        first, last = seg.first, seg.last
        if out and out[-1][1] >= first:  # this row shares step(s) with the previous one
            pa, pb, ps = out.pop()
            if pa < first:
                out.append([pa, first - 1, ps])
            both = min(pb, last)
            out.append([first, both, _combine(ps, state)])
            if pb > both:
                out.append([both + 1, pb, ps])
            first = both + 1
            if first > last:
                continue
        out.append([first, last, state])
    merged: list[list] = []
    for a, b, st in out:
        if merged and merged[-1][2] == st and merged[-1][1] >= a - 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b, st])
    return merged


def _fmt_steps(tl: list[list], state: str) -> str:
    parts = [f"{a}" if a == b else f"{a}–{b}" for a, b, s in tl if s == state]
    return ", ".join(parts)


def coverage(ev: Evidence, *, world_size: int | None, ranks: list[int], params_known: bool,
             expected_params: bool) -> tuple[dict, list[str]]:
    """(coverage dict for the report, reasons the evidence is incomplete)."""
    cov: dict = {"world_size": world_size, "ranks_with_graphs_or_params": ranks,
                 "ranks_with_evidence": sorted(ev.by_rank), "steps": {}, "finished": {},
                 "parameter_list": None}
    missing: list[str] = []
    for rank, segs in sorted(ev.by_rank.items()):
        cov["steps"][rank] = {"first": min(s.first for s in segs), "last": max(s.last for s in segs),
                              "backward_passes": sum(s.n_backward for s in segs), "numbered_by": segs[-1].source,
                              "records": len(segs)}
        cov["finished"][rank] = segs[-1].closed
    expected_ranks = set(range(world_size)) if world_size else set(ranks)
    seen = set(ranks) | set(ev.by_rank)
    if world_size and seen - expected_ranks:
        expected_ranks |= seen
    if expected_ranks - seen:
        missing.append(f"rank(s) {_ranks_text(sorted(expected_ranks - seen))} of world size {world_size} left no record: "
                       "their gradients were not seen")
    watched = {r for r, w in ev.watch.items() if w.get("complete", True)}
    partial_list = {r for r, w in ev.watch.items() if not w.get("complete", True)}
    if expected_params:
        cov["parameter_list"] = "given (--expect-params)"
    elif watched >= seen and seen:
        cov["parameter_list"] = "the model's own (captured with Agent.watch)"
    elif params_known and watched:
        cov["parameter_list"] = f"the model's own on rank(s) {_ranks_text(sorted(watched))} only"
        missing.append(f"rank(s) {_ranks_text(sorted(seen - watched))}: the parameter list holds only what graphs read "
                       "(parameters no graph reads cannot be seen): capture with Agent.watch(model) or pass "
                       "--expect-params FILE")
    elif params_known and not partial_list and not ev.imported:
        cov["parameter_list"] = "stored, but not known to be the model's own"
        missing.append("the store does not say whether its parameter list is the model's own (an older capture, or "
                       "one without Agent.watch(model)): a parameter no graph reads may be missing; capture with "
                       "Agent.watch(model), or pass --expect-params FILE")
    else:
        cov["parameter_list"] = "only the parameters compiled graphs read"
        missing.append("the parameter list is incomplete: it holds only the parameters that compiled graphs read, "
                       "so a parameter no graph reads (the cause of DDP's 'Expected to have finished reduction') "
                       "cannot be seen: capture with Agent.watch(model), or pass --expect-params FILE "
                       "(one name per line, e.g. from `python -c \"...print(*dict(model.named_parameters()), sep=chr(10))\"`)")
    no_ev = sorted(seen - set(ev.by_rank))
    off = {r: why for r, why in ev.off.items() if r in no_ev}
    if off:
        missing.append(f"no run-time gradient evidence on rank(s) {_ranks_text(sorted(off))}: {next(iter(off.values()))}")
    no_ev = [r for r in no_ev if r not in off]
    ca = [r for r in no_ev if r in ev.ca_ranks]
    if ca:
        missing.append(f"no run-time gradient evidence on rank(s) {_ranks_text(ca)}: compiled autograd runs the backward "
                       "there, so gradients are read at each optimizer step (hooks would change its graph), and no step "
                       "was read (no optimizer step ran before the job ended without close())")
        no_ev = [r for r in no_ev if r not in ca]
    died = [r for r in no_ev if ev.watch.get(r, {}).get("evidence")]  # watched, evidence on, nothing recorded
    if died:
        # A compiled rank writes graphdeck_grads_observed at the end of its first backward: none, it never finished one.
        ended = [r for r in died if r not in ev.backward_done and r in ev.graph_ranks]
        missing.append(
            f"no run-time gradient evidence on rank(s) {_ranks_text(died)}: the job was captured (Agent.watch(model) ran there, "
            "evidence on) but "
            + (f"rank(s) {_ranks_text(ended)} never finished a backward: the job died in (or before) its first backward, so no "
               "step's gradients were observed" if ended else "no step's state was recorded (the job died before "
               "its first optimizer step and did not reach close() or a normal exit, or never ran a backward)")
            + "; the findings come from the compiled graphs alone")
        no_ev = [r for r in no_ev if r not in died]
    if no_ev:
        missing.append(f"no run-time gradient evidence on rank(s) {_ranks_text(no_ev)}: which gradients arrived (or were "
                       "zero-filled by a compiled backward) at which step is unknown; capture the job with "
                       "graphdeck's Agent (agent.watch(model)) through at least one backward")
    fsdp2 = sorted(r for r, segs in ev.by_rank.items() if any(seg.state.get("fsdp2") for seg in segs))
    if fsdp2:  # NOTE: [FSDP2 evidence] (capture/grad_evidence.py)
        cov["limits"] = [f"rank(s) {_ranks_text(fsdp2)} (FSDP2): gradients were read at each optimizer step (FSDP2 assigns them "
                         "after its reduce-scatter), so a gradient zero-filled by a compiled backward, or one "
                         "accumulated twice in a backward, cannot be told from a real one there"]
        cov.setdefault("notes", []).extend(cov["limits"])
    ca_read = sorted(r for r, segs in ev.by_rank.items() if any(seg.state.get("compiled_autograd") for seg in segs))
    if ca_read:  # NOTE: [Evidence under compiled autograd] (capture/grad_fsdp.py)
        cov.setdefault("limits", []).append(
            f"rank(s) {_ranks_text(ca_read)} (compiled autograd): gradients were read at each optimizer step (the "
            "capture's hooks would be traced into compiled autograd's graph), so a gradient zero-filled by a compiled "
            "backward, or one accumulated twice in a backward, cannot be told from a real one there")
        cov.setdefault("notes", []).append(cov["limits"][-1])
    # one note per step for all the ranks it holds for (1,024 ranks that died: not 1,024 notes)
    partial: dict[int, list[int]] = defaultdict(list)
    for rank, segs in sorted(ev.by_rank.items()):
        for seg in segs:
            if seg.state.get("partial"):
                partial[seg.first].append(rank)
    for step, rks in sorted(partial.items()):
        cov.setdefault("notes", []).append(
            f"{_ranks_phrase(rks)}: the backward of step {step} did not finish (it raised, or the job died in it): "
            "parameters it had not reached yet were not observed")
    unfinished: dict[int, list[int]] = defaultdict(list)
    for rank, done in sorted(cov["finished"].items()):
        if not done:
            unfinished[cov["steps"][rank]["last"]].append(rank)
    for last, rks in sorted(unfinished.items()):
        cov.setdefault("notes", []).append(
            f"{_ranks_phrase(rks)}: the capture did not finish (the job died, or close() was not called): evidence "
            f"through step {last}")
    return cov, missing


def apply_evidence(rows: list[ParamRow], ev: Evidence) -> None:
    """Set each row's status from what arrived at run time (see the module docstring)."""
    for row in rows:
        if row.status == "BUFFER" or row.rank not in ev.by_rank:
            continue
        names = row.aliases or [row.fqn]
        tl = timeline(ev, row.rank, names)
        row.steps = tl
        states = {s for _, _, s in tl}
        bad = [seg for seg in tl if seg[2] in ("none", "zero")]
        row.first_bad_step = bad[0][0] if bad else None
        if row.status == "FROZEN" and states <= {"ok"}:
            continue  # frozen when watched and never made trainable: not hooked, never listed
        if not states or states <= {"frozen"}:
            if states:
                row.status, row.reason, row.fix, row.cut = "FROZEN", "requires_grad was False at every observed step", None, None
            continue
        if states <= {"unobserved", "frozen"} and row.rank in ev.graph_ranks:
            row.notes.append(f"not observed at run time at step(s) {_fmt_steps(tl, 'unobserved')}: judged from graphs")
            continue
        if states <= {"unobserved", "frozen"}:
            row.status, row.cut, row.fix = "UNKNOWN", None, None
            row.reason = (f"not observed at step(s) {_fmt_steps(tl, 'unobserved')}: the backward did not reach it "
                          "(it raised, or the job died in it) or it became trainable after watch()")
            continue
        if "zero" in states:
            segs = ev.by_rank[row.rank]
            site = next((s.state.get("sites") or {} for s in segs if any(n in s.state.get("zero", ()) for n in names)), {})
            row.status, row.paths = "DEAD_END", 0
            row.zero_filled = True
            row.reason = (f"received an all-zero gradient at step(s) {_fmt_steps(tl, 'zero')}: the compiled region's "
                          f"output(s) {', '.join(site.get('skipped_outputs') or ['?'])} that it feeds were not used by "
                          "the loss, and the compiled backward fills their gradient with zeros")
            row.reason += _branch_text(site)
            if site.get("loss"):
                row.reason += f"; backward() called at {site['loss']}"
            if site.get("output"):
                row.reason += f"; output produced by {site['output']}"
            row.fix = ("use that output in the loss at every step on every rank (e.g. add 0 * out.sum() when the "
                       "term is skipped), or do not compute it when it is not used")
        elif "none" in states:
            skipped = _fmt_steps(tl, "none")
            if "ok" in states or "multi" in states:  # it is used, but not at every step
                row.status, row.cut = "NO_GRAD", None
                site = next((s.state.get("sites") or {} for s in ev.by_rank[row.rank]
                             if any(n in s.state.get("none", ()) for n in names)), {})
                row.reason = (f"no gradient arrived at step(s) {skipped} (it did at step(s) "
                              f"{_fmt_steps(tl, 'ok') or _fmt_steps(tl, 'multi')}): the code that uses it was skipped "
                              "at those steps" + _branch_text(site))
                row.fix = ("use it in the loss at every step (e.g. add 0 * out.sum() for a skipped term), or freeze it "
                           "for the steps that do not train it")
            elif row.status == "OK" or not (row.graphs or row.grad_graphs):
                eager = not any(row.rank == r for r in ev.graph_ranks)
                row.status = "NOT_IN_GRAPH" if not eager and not row.graphs else "NO_GRAD"
                row.reason = (f"no gradient arrived at any observed step ({skipped})"
                              + (": nothing that ran connects it to the loss (its module was not called, or its "
                                 "output was not used by the loss)" if eager else
                                 "" if row.graphs else ": no compiled graph reads it and no eager code gave it a "
                                                      "gradient (an unused module, or a branch not taken on this rank)"))
            else:  # the graph analysis explains it (a cut, NOT_IN_GRAPH); the evidence confirms it
                row.reason = f"no gradient arrived at any observed step ({skipped}); {row.reason}"
        else:  # ok (multi counts are a finding, not a status)
            if row.status != "OK":
                row.notes.append(f"graph analysis said {row.status}: {row.reason}")
            row.status, row.cut, row.fix = "OK", None, None
            row.paths = row.paths or 1
            row.reason = (f"a gradient arrived at every observed step ({_fmt_steps(tl, 'ok') or _fmt_steps(tl, 'multi')})"
                          + (f"; frozen at step(s) {_fmt_steps(tl, 'frozen')}" if "frozen" in states else ""))
        if "multi" in states:
            row.notes.append(f"accumulated more than once in one backward at step(s) {_fmt_steps(tl, 'multi')}")


def mark_unobserved_ranks(rows: list[ParamRow], ev: Evidence) -> None:
    """A rank with neither a compiled graph nor run-time evidence (an eager rank killed before it
    wrote any): the graph analysis' NOT_IN_GRAPH means nothing there, so its rows are UNKNOWN."""
    for row in rows:
        if row.rank in ev.by_rank or row.rank in ev.graph_ranks or row.status != "NOT_IN_GRAPH":
            continue
        row.status, row.cut, row.fix = "UNKNOWN", None, None
        row.reason = "nothing was observed on this rank: no compiled graph and no run-time gradient evidence"


def evidence_findings(rows: list[ParamRow], ev: Evidence, *, ddp: bool, find_unused: bool | None,
                      fsdp) -> list[Finding]:
    """Rank divergence, DDP's reduction error and "marked ready twice", from the evidence.
    ``fsdp``: truthy under FSDP2 — a :class:`graphdeck.analysis.gradients.mesh.Wrapping` (its groups name
    the reduce-scatter) or a bool (NOTE: [Wrapper words])."""
    out: list[Finding] = []
    by_fqn: dict[str, list[ParamRow]] = defaultdict(list)
    for r in rows:
        if r.rank in ev.by_rank and r.status != "BUFFER":
            by_fqn[r.fqn].append(r)
    n_ranks = len(ev.by_rank)
    diverge: dict[tuple, list[str]] = defaultdict(list)
    unused_everywhere: list[str] = []
    for fqn, group in sorted(by_fqn.items()):
        states = {r.rank: {s for _, _, s in (r.steps or [])} for r in group}
        bad_ranks = sorted(rk for rk, s in states.items() if s & {"none", "zero"})
        if not bad_ranks:
            continue
        good_ranks = sorted(rk for rk, s in states.items() if not (s & {"none", "zero"}) and s - {"frozen"})
        kind = "zero" if any("zero" in states[rk] for rk in bad_ranks) else "none"
        first = min(r.first_bad_step for r in group if r.first_bad_step is not None)
        if good_ranks:
            diverge[(kind, tuple(bad_ranks), tuple(good_ranks), first)].append(fqn)
        elif kind == "none" and len(group) == n_ranks and not any(r.allowed for r in group):
            unused_everywhere.append(fqn)
    for (kind, bad, good, first), params in sorted(diverge.items(), key=lambda kv: (kv[0][3], kv[1])):
        rows_of = [r for r in rows if r.fqn in params]
        site = _site(ev, bad, params)
        msg = (f"{', '.join(params)}: a gradient arrived on rank(s) {_ranks_text(list(good))} but "
               f"{'an all-zero gradient (compiled backward, output unused by the loss)' if kind == 'zero' else 'none'} "
               f"on rank(s) {_ranks_text(list(bad))}, first at step {first}; ")
        hang = False
        if kind == "zero":
            if fsdp:
                msg += ("FSDP2's reduce-scatter still runs (the compiled backward filled zeros), so nothing fails: "
                        f"rank(s) {_ranks_text(list(bad))} silently contribute zeros to these parameters' averaged gradients")
            elif ddp:
                msg += ("no error: DDP's hooks fire on the zero-filled gradient, so the all-reduce matches, and rank(s) "
                        f"{_ranks_text(bad)} silently average zeros into these parameters (their update is diluted, the "
                        "ranks train on different losses)")
            else:
                msg += f"rank(s) {_ranks_text(list(bad))} get zeros where the others get a gradient"
            fix = ("add the skipped term on every rank (e.g. loss = loss + 0 * out.sum() when the local batch has "
                   "nothing for that head) so every rank's gradient is the real one")
        elif fsdp:
            hang = True
            from graphdeck.analysis.gradients.mesh import fsdp2_consequence, fsdp2_fix

            group = fsdp.group_of(params[0]) if hasattr(fsdp, "group_of") else None
            msg += fsdp2_consequence(", ".join(params), list(bad), group)
            fix = fsdp2_fix(params)
        elif ddp and find_unused:
            msg += ("find_unused_parameters=True makes DDP all-reduce zeros for it on those ranks: the job runs, but "
                    "the ranks train different models")
            fix = "make the code path that uses it run on every rank (or add 0 * out.sum() for the skipped term)"
        elif ddp:
            hang = True
            msg += (f"rank(s) {_ranks_text(list(bad))} never mark it ready, so its bucket's all-reduce is not launched there: "
                    f"rank(s) {_ranks_text(list(good))} wait in it (hang until the timeout) and rank(s) {_ranks_text(list(bad))} raise "
                    f"'{DDP_UNUSED_ERROR}…' at step {first + 1}")
            fix = ("make the code path that uses it run on every rank (add 0 * out.sum() for the skipped term), or "
                   "DistributedDataParallel(..., find_unused_parameters=True)")
        else:
            msg += "a data-parallel all-reduce of these gradients would not match across ranks"
            fix = "make the code path that uses it run on every rank"
        msg += _branch_text(site)
        if site.get("loss"):
            msg += f"; backward() called at {site['loss']}"
        if site.get("output"):
            msg += f"; skipped output produced by {site['output']}"
        ranks = {r.rank: r.status for r in sorted(rows_of, key=lambda r: r.rank) if r.fqn == params[0]}
        src = (site.get("branch") or site.get("loss") or "").split(" in ")[0] or None
        out.append(Finding(kind="RANK_DIVERGENCE", severity="error", message=msg, params=params, ranks=ranks,
                           source=src, fix=fix))
        if hang:  # the hang is the prediction a later step refutes; the divergence itself stands
            out.append(Finding(kind="PREDICTED_HANG", severity="error", params=params, ranks=ranks, source=src, fix=fix,
                               raises_at=first,
                               message=(f"the gradient collective of {', '.join(params)} is issued on rank(s) "
                                        f"{_ranks_text(good)} only (first at step {first}): it will not be matched")))
        for r in rows_of:
            if r.rank in bad:
                r.fix = f"it gets a gradient on rank(s) {_ranks_text(list(good))} but not here: {fix}"
    static = bool(ev.watch) and all(w.get("static_graph") for w in ev.watch.values())
    if unused_everywhere and ddp and not find_unused and not fsdp:
        first = min(r.first_bad_step for r in rows if r.fqn in unused_everywhere and r.first_bad_step is not None)
        fix = (f"remove or freeze {', '.join(unused_everywhere)} (requires_grad_(False)), or wrap with "
               "DistributedDataParallel(..., find_unused_parameters=True)")
        if static:  # DDP's static graph finds them unused in its first iteration: no error
            out.append(ddp_static_finding(unused_everywhere, fix))
        elif find_unused is None:  # the record does not say which DDP options ran: assert neither outcome
            out.append(ddp_unused_finding([r for r in rows if r.fqn in unused_everywhere], None))
        else:
            out.append(Finding(kind="DDP_UNUSED_ERROR", severity="error", params=unused_everywhere, fix=fix,
                               ranks=sorted(ev.by_rank), raises_at=first + 1,
                               message=(f"no gradient arrived for {', '.join(unused_everywhere)} on any rank at step "
                                        f"{first}: under DDP with find_unused_parameters=False step {first + 1} raises "
                                        f"'{DDP_UNUSED_ERROR}…' on every rank")))
    out += _ready_twice(rows, ev, ddp=ddp, static=static, find_unused=find_unused)
    from graphdeck.analysis.gradients.outcome import refute_by_run

    refute_by_run(out, ev)  # NOTE: [Predictions the run contradicts]
    return out


def _branch_text(site: dict) -> str:
    """The loss code's branch that skipped the output (NOTE: [The branch that skipped an output]
    in ``capture/grad_branch.py``), as a clause; empty when the capture could not tell it."""
    return f"; the loss code skipped it at the branch {site['branch']}" if site.get("branch") else ""


def _site(ev: Evidence, ranks, params) -> dict:
    for rank in ranks:
        for seg in ev.by_rank.get(rank, []):
            st = seg.state
            if any(p in st.get("zero", ()) or p in st.get("none", ()) for p in params):
                return st.get("sites") or {}
    return {}


def _ready_twice(rows: list[ParamRow], ev: Evidence, *, ddp: bool, static: bool = False,
                 find_unused: bool | None = None) -> list[Finding]:
    """READY_TWICE from the ``multi`` counts, its DDP consequence as NOTE: [READY_TWICE under DDP]
    says; where the run itself went past the backward that accumulated twice, DDP did not raise:
    the finding says what happened instead (the second accumulation stayed local, the replicas'
    gradients silently diverge)."""
    from graphdeck.analysis.gradients.outcome import ran_past

    hits: dict[str, dict] = {}
    for rank, segs in ev.by_rank.items():
        for seg in segs:
            for fqn, n in (seg.state.get("multi") or {}).items():
                h = hits.setdefault(fqn, {"ranks": set(), "n": n, "step": seg.first, "site": None})
                h["ranks"].add(rank)
                h["step"] = min(h["step"], seg.first)
                h["site"] = h["site"] or ((seg.state.get("sites") or {}).get("multi") or {}).get(fqn)
    if not hits:
        return []
    params = sorted(hits)
    first = min(h["step"] for h in hits.values())
    ranks = sorted({r for h in hits.values() for r in h["ranks"]})
    sites = sorted({h["site"] for h in hits.values() if h["site"]})
    where = f" in the checkpointed region(s) {', '.join(sites)}" if sites else ""
    head = (f"{', '.join(params)} accumulated a gradient more than once in one backward (up to "
            f"{max(h['n'] for h in hits.values())}×, from step {first}){where}: reentrant activation checkpointing "
            "runs one backward per checkpointed call, so a parameter used in two such calls is accumulated twice")
    raises_at, severity = None, "error" if ddp and not static else "warning"
    went = ran_past(ev, ranks, first) if ddp and not static else {}
    if not ddp:
        msg = head
    elif static:
        msg = head + "; this job's DDP has static_graph=True, which handles it (no error, the replicas agree)"
    elif went:
        msg = (f"the replicas' gradients of {', '.join(params)} silently diverge (no error): DDP finished its "
               f"iteration before the second accumulation, which stays local to each rank — this run went on "
               f"through step {max(went.values())}, so DDP did not raise. {head}")
    elif find_unused:
        raises_at = first
        msg = (f"the first backward raises '{DDP_READY_TWICE}…' (find_unused_parameters=True marks parameters used "
               f"only inside reentrant checkpoints unused, then their accumulation marks them twice). {head}")
    elif all(not any(sg.last > first for sg in ev.by_rank.get(r, []))
             and any(sg.state.get("partial") for sg in ev.by_rank.get(r, [])) for r in ranks):
        raises_at = first  # the run's own evidence agrees: no rank finished that backward or went on
        msg = (f"the backward at step {first} raises '{DDP_READY_TWICE}…' (DDP with find_unused_parameters=False "
               f"was still collecting that iteration when the second accumulation came; this run's backward of "
               f"step {first} did not finish on rank(s) {ranks}). {head}")
    else:
        raises_at = first
        msg = (f"under DDP with find_unused_parameters=False the backward at step {first} raises "
               f"'{DDP_READY_TWICE}…' when the second accumulation comes before DDP finished its iteration; if it "
               f"comes after, it stays local and the replicas' gradients silently diverge (no error). {head}")
    return [Finding(kind="READY_TWICE", severity=severity, message=msg, params=params, ranks=ranks,
                    source=sites[0] if sites else None, raises_at=raises_at,
                    fix="use torch.utils.checkpoint(..., use_reentrant=False), or DDP(static_graph=True), or do not "
                        "reuse the parameter across checkpointed calls")]
