"""The run overview (issue 23 item 2): every check's verdict with a count and a link, then the
slowest ranks and steps — one document for the run page, ``GET /api/runs/{id}/summary`` and
``graphdeck summary RUN``, so a CI log and the page say the same.

# NOTE: [Run overview]
Each check is the library call behind its own CLI command and page, run here unchanged:

* ``gradients`` — :func:`graphdeck.analysis.gradients.core.gradient_report` (``check-grads --run``):
  PASS / FAIL / INCOMPLETE as the report says; count = parameters that get no gradient (distinct
  names, any rank) plus error findings. Link: the gradient page (``#/runs/<id>/grads``).
* ``ranks`` — :func:`graphdeck.analysis.ranks.core.rank_report` (``check-ranks``): OK is read as PASS;
  count = harmful divergences + collective-schedule mismatches + Flight Recorder mismatches.
  Link: ``#/runs/<id>/ranks``.
* ``compile`` — :func:`graphdeck.analysis.compilation.health.compile_health` with no gates (as
  ``check-compile`` without ``--max-*`` flags: PASS means "no evidence missing", said so in the
  headline); count = distinct graph breaks in user code (FAIL: gates passed). Link: the run
  page's compile-health panel (``#/runs/<id>?section=compile-health``).
* ``traces`` — trace coverage (NOTE: [Trace coverage] in analysis/traces/coverage.py): per rank,
  the share of its newest usable trace's GPU kernel time of compiled graphs, or of the ops' own
  CPU time in compiled regions (CPU traces), that :func:`graphdeck.analysis.traces.mapping.map_trace`
  maps to graph nodes; time outside compiled graphs by design (eager optimizer, communication and
  DDP hooks, data loading, other eager code) and the CPU time between the ops are named apart in
  the headline and ``detail``, never counted against it. PASS when every rank with graphs has a trace mapped at least
  :data:`MIN_COVERAGE`; otherwise INCOMPLETE (time the overlays cannot attribute is missing
  evidence, not a fault of the job) — never FAIL. Count = ranks without a trace or under the bar.
  Link: the lowest rank's trace page.
* ``layout`` — the parallel layout (:func:`graphdeck.analysis.parallel.layout.load_layout`) when any rank
  recorded one: PASS when every rank did, INCOMPLETE naming those that did not
  (:func:`graphdeck.analysis.ranks.mesh.layout_gaps`); ``N/A`` (neutral, not green) without any
  record. Peers are compared per mesh dimension by ``check-ranks``. Link: ``#/runs/<id>/map``.

Defensive: a check that raises is reported as ``ERROR`` with the exception's text (never PASS),
and the session is rolled back so the next check reads normally. Each check has a time budget
(:data:`BUDGETS_S`, seconds): ``elapsed_s`` and ``budget_s`` are reported, a check that ran over is
noted, and the per-rank trace loop stops at its budget (the ranks left are INCOMPLETE).

The run's verdict and exit code: FAIL (1) when any check fails; else INCOMPLETE (3) when any is
INCOMPLETE or ERROR; else PASS (0). ``N/A`` counts for nothing.

Slowest (:func:`slowest`): step times per rank from each trace's ``ProfilerStep#N`` ranges
(:func:`graphdeck.analysis.traces.analyze.step_times`; the CPU range, else the GPU span of its
kernels), through :func:`graphdeck.analysis.traces.collectives.align_and_match` when two or more
ranks have traces (which also names the straggler the others waited for).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.units import ns_text
from graphdeck.store.schema import Graph, GradStep, Rank, Run, Trace

log = logging.getLogger(__name__)

#: Check keys in their canonical order.
CHECKS = ("gradients", "ranks", "compile", "traces", "layout")
#: Time budget per check, seconds (``slowest`` is the step-time section).
BUDGETS_S = {"gradients": 30.0, "ranks": 30.0, "compile": 15.0, "traces": 30.0, "layout": 5.0, "slowest": 30.0}
#: Trace coverage bar: the share of a rank's GPU kernel time of compiled graphs / ops' own CPU time in
#: compiled regions mapped to graph nodes (NOTE: [Trace coverage]).
MIN_COVERAGE = 0.9
#: Verdicts, worst first (the overview lists checks in this order); ``N/A``: the check has nothing to check.
SEVERITY = ("FAIL", "ERROR", "INCOMPLETE", "WARN", "PASS", "N/A")
EXIT_CODES = {"PASS": 0, "WARN": 0, "FAIL": 1, "INCOMPLETE": 3}
TOP_STEPS = 5
#: Ranks listed in ``slowest["ranks"]`` (the slowest first; ``ranks_total`` counts them all): a
#: 1,024-rank run's page shows the rank heatmap, not 1,024 rows.
TOP_RANKS = 10
#: What :func:`run_check` answers: a check, or the slowest steps.
PARTS = (*CHECKS, "slowest")


@dataclass
class CheckSummary:
    """One check's line. ``verdict``: PASS | FAIL | INCOMPLETE | ERROR | N/A; ``native_verdict``:
    what the check's own report says (``OK`` for check-ranks); ``count`` of ``count_label``
    (``None`` when the check did not run); ``headline``: one sentence; ``reasons``: the first
    findings / missing-evidence lines (at most 5, ``more`` says how many were left out);
    ``link``: the dashboard route with the details (None: nothing to open); ``command``: the CLI
    command giving the full report (or gathering the missing evidence); ``api``: its JSON route; ``elapsed_s`` / ``budget_s`` in seconds; ``error``: the
    exception text for ERROR; ``detail``: check-specific data (per-rank coverage, ...)."""

    key: str
    title: str
    verdict: str
    count: int | None
    count_label: str
    headline: str
    link: str | None
    command: str
    api: str | None
    native_verdict: str | None = None
    reasons: list[str] = field(default_factory=list)
    more: int = 0
    elapsed_s: float = 0.0
    budget_s: float = 0.0
    over_budget: bool = False
    error: str | None = None
    detail: dict = field(default_factory=dict)

    def line(self) -> str:
        """The CLI's line: ``VERDICT  key  count label — headline``."""
        count = "" if self.count is None else f"{self.count} {self.count_label} — "
        return f"{self.verdict:<10} {self.key:<9} {count}{self.headline}"


@dataclass
class RunSummary:
    """The overview of one run: ``checks`` worst first (FAIL, ERROR, INCOMPLETE, PASS, N/A; within
    a verdict in :data:`CHECKS` order), ``slowest`` (see :func:`slowest`), ``elapsed_s``."""

    run_id: int
    run: str
    world_size: int | None
    ranks: list[int]
    checks: list[CheckSummary]
    slowest: dict
    elapsed_s: float = 0.0

    @property
    def verdict(self) -> str:
        verdicts = {c.verdict for c in self.checks}
        if "FAIL" in verdicts:
            return "FAIL"
        return ("INCOMPLETE" if verdicts & {"INCOMPLETE", "ERROR"} else "WARN" if "WARN" in verdicts
                else "PASS")

    @property
    def exit_code(self) -> int:
        """0 PASS, 1 FAIL, 3 INCOMPLETE (some check lacks evidence or raised, none failed)."""
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict:
        counts = {v: sum(1 for c in self.checks if c.verdict == v) for v in SEVERITY}
        return {"run_id": self.run_id, "run": self.run, "world_size": self.world_size, "ranks": self.ranks,
                "verdict": self.verdict, "exit_code": self.exit_code, "counts": counts,
                "checks": [asdict(c) for c in self.checks], "slowest": self.slowest,
                "elapsed_s": round(self.elapsed_s, 3), "budgets_s": BUDGETS_S}

    def to_text(self, store: str | None = None) -> str:
        """One line per check, worst first, then the slowest steps and the exit code."""
        where = f" in {store}" if store else ""
        lines = [f"graphdeck summary {self.run}{where}: {self.verdict}"]
        for c in self.checks:
            lines.append(c.line())
            lines += [f"{'':21}{r}" for r in c.reasons[:2]]
        s = self.slowest
        if s.get("steps"):
            lines.append("slowest steps: " + ", ".join(
                f"rank {x['rank']} step {x['step'] if x['step'] is not None else '?'} {ns_text(x['dur_ns'])}"
                for x in s["steps"][:3]))
        if s.get("straggler_message"):
            lines.append(s["straggler_message"])
        elif s.get("reason"):
            lines.append(f"slowest steps: {s['reason']}")
        lines.append(f"exit {self.exit_code} ({self.verdict})")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- the checks


def _reasons(c: CheckSummary, lines: list[str], limit: int = 5) -> CheckSummary:
    lines = [str(x) for x in lines if x]
    c.reasons, c.more = lines[:limit], max(0, len(lines) - limit)
    return c


def _names(items: list[str], limit: int = 4) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


#: Graph kinds that hold (or imply) a backward: a run with none but aot_inference has no gradients to check.
_BACKWARD_KINDS = {"aot_forward", "aot_backward", "aot_joint", "compiled_autograd"}


def check_gradients(session: Session, run: Run, deadline: float) -> CheckSummary:
    from graphdeck.analysis.gradients.core import gradient_report

    rep = gradient_report(session, run)
    failing: dict[str, set] = {}
    for row in rep.failures:
        failing.setdefault(row.fqn, set()).add(row.status)
    statuses = sorted({s for v in failing.values() for s in v})
    link = f"#/runs/{run.id}/grads" + (f"?status={statuses[0]}" if len(statuses) == 1 else "")
    verdict, errors = rep.verdict, rep.errors  # properties over every row: read once (28k rows at 1,024 ranks)
    c = CheckSummary("gradients", "Gradient paths", verdict, len(failing) + len(errors),
                     "failing parameter(s)" if not errors else "failing parameter(s) and error finding(s)", "",
                     link, f"graphdeck check-grads STORE --run {run.name}", f"/api/runs/{run.id}/gradients",
                     native_verdict=verdict)
    names = sorted(failing)
    checked = sorted({r.fqn for r in rep.rows if r.status != "BUFFER"})
    if verdict == "FAIL" and not names and {f.kind for f in errors} == {"NOTHING_CHECKED"}:
        # A run with nothing to check (a trace alone, logs without parameters): the evidence is
        # missing, not a parameter failing — INCOMPLETE here; check-grads still refuses to pass it.
        c.verdict, c.count, c.count_label = "INCOMPLETE", 0, "parameter(s) checked"
        c.headline = "nothing to check: the run holds no parameter records (capture it with Agent.watch(model))"
        c.detail = {"summary": rep.summary, "failing": [], "statuses": []}
        return _reasons(c, [f.message for f in errors])
    kinds = set(session.scalars(select(Graph.kind).where(Graph.run_id == run.id).distinct()))
    if verdict == "FAIL" and "aot_inference" in kinds and not kinds & _BACKWARD_KINDS \
            and session.scalar(select(GradStep.id).where(GradStep.run_id == run.id).limit(1)) is None:
        # An inference-only log (imported TORCH_TRACE, no backward anywhere): gradient paths do not
        # apply; a training job whose compiled region ran without grad shows the same, so the rows
        # that tell where grad mode was off stay as reasons (issue 40 item 5).
        c.verdict, c.count, c.count_label = "N/A", 0, "parameter(s) checked"
        c.headline = ("no backward in this run: its compiled graphs are inference graphs only (aot_inference: "
                      "grad mode off or no input requires grad); if the job trains, check-grads shows where "
                      "grad mode was off")
        c.detail = {"summary": rep.summary, "failing": [], "statuses": []}
        return _reasons(c, [f"{r.fqn} (rank {r.rank}): {r.reason}" for r in rep.failures][:2])
    if verdict == "FAIL":
        parts = []
        if names:
            parts.append(f"{_names(names)} get no gradient ({', '.join(statuses)})")
        if errors:
            parts.append(f"{len(errors)} error finding(s): {errors[0].kind}")
        c.headline = "; ".join(parts)
    elif verdict == "INCOMPLETE":
        c.headline = f"no failing parameter among {len(checked)}, but the evidence does not cover the run"
    else:
        c.headline = f"all {len(checked)} parameters get a gradient on every rank"
    first = [f"{r.fqn} (rank {r.rank}): {r.reason}" for r in rep.failures][:2]
    c.detail = {"summary": rep.summary, "failing": names, "statuses": statuses}
    return _reasons(c, first + [f.message for f in errors] + [f"INCOMPLETE: {g}" for g in rep.gaps])


def check_ranks(session: Session, run: Run, deadline: float) -> CheckSummary:
    from graphdeck.analysis.ranks.core import rank_report

    rep = rank_report(session, run)
    harmful = [d for d in rep.divergences if not d.harmless]  # the divergences RankReport.diverged_ranks counts
    flight = list(rep.flight.mismatches) if rep.flight else []
    n = len(harmful) + len(rep.collective_mismatches) + len(flight)
    verdict = {"OK": "PASS"}.get(rep.verdict, rep.verdict)
    c = CheckSummary("ranks", "Rank consistency", verdict, n, "mismatch(es)", "", f"#/runs/{run.id}/ranks",
                     f"graphdeck check-ranks STORE --run {run.name}", f"/api/runs/{run.id}/rank-consistency",
                     native_verdict=rep.verdict)
    lines = [f"ranks {d.ranks} vs {d.reference_ranks}: {d.message}" for d in harmful]
    lines += [m.message for m in rep.collective_mismatches]
    lines += [f"Flight Recorder: group {m.desc or m.group} collective #{m.seq}: ranks {m.not_reached} did not "
              f"reach {m.op or 'it'} ({m.kind})" for m in flight]
    timed = [f.message for f in rep.time_findings if f.verdict in ("FAIL", "WARN")]  # NOTE: [Time verdicts]
    n += len(timed)
    lines += timed
    if n:
        c.headline = lines[0]
    elif len(rep.ranks) < 2:
        c.headline = f"{len(rep.ranks)} rank: nothing to compare"
    elif verdict == "INCOMPLETE" and rep.traces_only:  # no records: say what was compared
        c.headline = f"{len(rep.ranks)} ranks: {rep.traces_only}"
    elif verdict == "INCOMPLETE":
        c.headline = f"{len(rep.ranks)} ranks show no difference, but evidence is missing"
    else:
        c.headline = (f"{len(rep.ranks)} ranks agree: compile sequences and collective schedules"
                      + (f" ({len(rep.groups)} program groups)" if len(rep.groups) > 1 else ""))
    c.detail = {"ranks": rep.ranks, "groups": rep.groups}
    return _reasons(c, (lines[1:] if n else []) + [f"INCOMPLETE: {m}" for m in rep.missing_evidence]
                    + [f"UNVERIFIED: {m}" for m in rep.unverified])


def check_compile(session: Session, run: Run, deadline: float) -> CheckSummary:
    from graphdeck.analysis.compilation.health import compile_health

    rep = compile_health(session, run)
    s = rep.summary()
    c = CheckSummary("compile", "Compile health", rep.verdict, len(rep.findings) if rep.findings else s["graph_breaks"],
                     "gate(s) failed" if rep.findings else "graph break(s) in user code", "",
                     f"#/runs/{run.id}?section=compile-health", f"graphdeck check-compile STORE --run {run.name}",
                     f"/api/runs/{run.id}/compile-health", native_verdict=rep.verdict)
    from graphdeck.analysis.ranks.records import _ranks_phrase

    c.headline = (("no graph produced on " + _ranks_phrase(s["no_graph_ranks"]) + ": nothing is compiled, the job "
                   "runs eager; " if s["no_graph_ranks"] else "")
                  + (f"{s['graph_breaks']} graph break(s) in user code, " if rep.findings else "")
                  + (f"{s['framework_breaks']} inside {_names(s['frameworks'], 2)} (not user code), "
                     if s["framework_breaks"] else "")
                  + f"{s['recompiles']} recompile(s), "
                  f"{s['eager_fallbacks']} eager fallback(s), {s['restarts']} restart(s)"
                  + (f"; recompile limit hit in {_names(s['limit_hit'], 2)}" if s["limit_hit"] else "")
                  + ("" if rep.findings else " (no gates set: check-compile --max-* makes them fail)")
                  + (f"; compiled DDP cannot overlap its gradient all-reduces ({s['ddp_no_overlap']} graph(s))"
                     if s.get("ddp_no_overlap") else ""))
    c.detail = {"summary": s}
    return _reasons(c, rep.findings + [f"INCOMPLETE: {m}" for m in rep.missing_evidence]
                    + [f"WARN: {m}" for m in rep.warnings] + [f"UNVERIFIED: {m}" for m in rep.unverified])


def check_traces(session: Session, run: Run, deadline: float, memo: dict | None = None) -> CheckSummary:
    """Trace coverage (NOTE: [Run overview]). ``memo``: trace id → a rank's mapped coverage
    (``device``, ``total_ns``, ``mapped_ns``, ``fraction``, ``top``: the largest unmapped name),
    read for the traces it holds and filled with those mapped now — a caller that keeps it (the
    server, at 1,024 ranks ~0.13 s CPU a trace) never maps a trace twice."""
    from graphdeck.analysis.ranks.records import _ranks_phrase, _ranks_text
    from graphdeck.analysis.traces.collectives import run_traces
    from graphdeck.analysis.traces.coverage import COVERS, coverage
    from graphdeck.analysis.traces.data import load_events
    from graphdeck.analysis.traces.mapping import map_trace

    traces = run_traces(session, run.id)
    statuses = dict(session.execute(select(Trace.rank, Trace.status).where(Trace.run_id == run.id)).all())
    with_graphs = sorted(set(session.scalars(select(Graph.rank).where(Graph.run_id == run.id).distinct())))
    missing = [r for r in with_graphs if r not in traces]
    c = CheckSummary("traces", "Trace coverage", "INCOMPLETE", None, "rank(s) without a trace or under "
                     f"{MIN_COVERAGE:.0%}", "", f"#/runs/{run.id}/timeline", "", None)
    if not traces:
        unusable = sorted(r for r, st in statuses.items() if st not in ("ok", "truncated"))
        c.count = len(with_graphs)
        c.link = None  # nothing to open
        c.command = f"graphdeck ingest-trace TRACE.json --store STORE --run {run.name} --rank N"
        c.headline = ("no trace recorded: time cannot be put on graph nodes (profile with Agent.profile, or "
                      "graphdeck ingest-trace)" + (f"; rank(s) {_ranks_text(unusable)}: trace not usable ({statuses[unusable[0]]})"
                                                   if unusable else ""))
        return c
    per_rank, lines, skipped = [], [], []
    empty: dict[str, list[int]] = {}
    cut: list[int] = []
    for rank, tid in sorted(traces.items()):
        got = memo.get(tid) if memo is not None else None
        if got is None:
            if time.perf_counter() > deadline:
                skipped.append(rank)
                continue
            events = load_events(session, tid, with_args=False)
            cov = coverage(map_trace(session, tid, events), events)
            top = next(iter(cov.unmapped), None)
            got = {"device": cov.device, "total_ns": cov.total_ns, "mapped_ns": cov.covered_ns, "fraction": cov.fraction,
                   "covers": cov.covers, "outside_ns": cov.outside, "overhead_ns": cov.overhead_ns,
                   "top": None if top is None else str(top)}
            if memo is not None:
                memo[tid] = got
        frac = got["fraction"]
        per_rank.append({"rank": rank, "trace_id": tid, "device": got["device"], "status": statuses.get(rank),
                         "total_ns": got["total_ns"], "mapped_ns": got["mapped_ns"], "fraction": frac,
                         "covers": got.get("covers"), "outside_ns": got.get("outside_ns", {}),
                         "overhead_ns": got.get("overhead_ns", 0), "link": f"#/traces/{tid}"})
        what = COVERS[got["device"]]
        if frac is None:
            empty.setdefault(what, []).append(rank)
        elif frac < MIN_COVERAGE:
            top = got["top"]
            lines.append(f"rank {rank}: {frac:.1%} of {what} mapped to graph nodes (under {MIN_COVERAGE:.0%})"
                         + (f"; largest unmapped: {top}" if top else ""))
        if statuses.get(rank) == "truncated":
            cut.append(rank)
    # ranks alike in one line each, as range text (1,024 ranks: not 1,024 lines)
    lines += [f"{_ranks_phrase(rks)}: {'its trace has' if len(rks) == 1 else 'their traces have'} no "
              f"{what.removeprefix('the ')} to map"
              for what, rks in empty.items()]
    lines += [f"{_ranks_phrase(cut)}: {'its trace file' if len(cut) == 1 else 'their trace files'} ended early "
              "(truncated)"] if cut else []
    if missing:
        lines.insert(0, f"rank(s) {_ranks_text(missing, brackets=False)} have graphs but no usable trace")
    if skipped:
        lines.append(f"rank(s) {_ranks_text(skipped, brackets=False)} not mapped: the check's time budget was spent")
    short = {p["rank"] for p in per_rank if p["fraction"] is None or p["fraction"] < MIN_COVERAGE
             or p["status"] == "truncated"}
    c.count = len(short | set(missing) | set(skipped))
    c.verdict = "INCOMPLETE" if c.count else "PASS"
    fracs = [p for p in per_rank if p["fraction"] is not None]
    worst = min(fracs, key=lambda p: p["fraction"], default=None)
    what = COVERS["gpu" if per_rank and per_rank[0]["device"] == "gpu" else "cpu"]
    c.headline = (f"{worst['fraction']:.1%} of {what} mapped to graph nodes on the lowest rank ({worst['rank']}); "
                  + _fractions_text(fracs) + _outside_text(worst)
                  if worst else f"no {what.removeprefix('the ')} to map in {len(per_rank)} trace(s)")
    if not with_graphs and not fracs and per_rank and not skipped and _nothing_compiled(session, run.id):
        # Nothing compiled on any rank (NOTE: [No graph produced]): coverage has nothing to cover.
        device = "GPU" if what == COVERS["gpu"] else "CPU"
        c.verdict, c.count, c.link, c.api = "N/A", None, f"#/traces/{per_rank[0]['trace_id']}", None
        c.headline = (f"nothing compiled to map: no rank produced a graph, so the {len(per_rank)} {device} trace(s) "
                      "hold only eager work (see the compile check)")
        lines = [ln for ln in lines if "to map" not in ln]
    if worst:
        c.link, c.api = worst["link"], f"/api/traces/{worst['trace_id']}/analysis"
    c.detail = {"ranks": per_rank, "min_coverage": MIN_COVERAGE}
    return _reasons(c, lines)


def _nothing_compiled(session: Session, run_id: int) -> bool:
    from graphdeck.analysis.compilation.no_graph import nothing_compiled

    return nothing_compiled(session, run_id)


def _outside_text(p: dict) -> str:
    """``; not counted (outside compiled graphs by design, rank 0): eager optimizer step 3.1 ms, …``
    (NOTE: [Trace coverage]), or ``""``."""
    parts = [f"{k} {ns_text(ns)}" for k, ns in sorted((p.get("outside_ns") or {}).items(), key=lambda kv: -kv[1])
             if ns > 0]
    if p.get("overhead_ns"):
        parts.append(f"between and around the ops (dispatch, wrapper code, profiler callbacks, descheduling) {ns_text(p['overhead_ns'])}")
    return f"; not counted (rank {p['rank']}): " + ", ".join(parts) if parts else ""


def _fractions_text(fracs: list[dict], limit: int = 8) -> str:
    """``ranks 0-48, 50-63 100.0%, rank 12 93.1%``: ranks whose shown share is the same in one
    entry, the lowest share first, at most ``limit`` entries."""
    from graphdeck.analysis.ranks.records import _ranks_phrase

    same: dict[str, list[int]] = {}
    for p in sorted(fracs, key=lambda p: (p["fraction"], p["rank"])):
        same.setdefault(f"{p['fraction']:.1%}", []).append(p["rank"])
    shown = [f"{_ranks_phrase(rks)} {share}" for share, rks in list(same.items())[:limit]]
    return ", ".join(shown) + (f" and {len(same) - limit} more" if len(same) > limit else "")


def check_layout(session: Session, run: Run, deadline: float) -> CheckSummary:
    from graphdeck.analysis.parallel.layout import load_layout
    from graphdeck.analysis.ranks.mesh import layout_gaps

    layout = load_layout(session, run.id)
    c = CheckSummary("layout", "Parallel layout", "N/A", None, "rank(s) without a layout record", "",
                     f"#/runs/{run.id}/map", f"graphdeck check-ranks STORE --run {run.name}",
                     f"/api/runs/{run.id}/layout")
    if layout is None:
        from graphdeck.analysis.parallel.replicas import replica_layout

        replica = replica_layout(session, run)  # NOTE: [Replica row]: what the map draws without a mesh
        c.headline = ("no parallel layout recorded (no device mesh, DTensor, FSDP2 group or pipeline stage)"
                      + (f"; {replica['text']} — drawn on the parallel map as one replica row" if replica else ""))
        if replica:
            c.detail = {"replica": replica}
        return c
    ranks = _run_ranks(session, run.id)
    gaps = layout_gaps(layout, ranks)
    # The meshes something is placed on (NOTE: [Dimensions nothing is placed on]): torchtitan's
    # "world" is the root its data/tensor-parallel meshes were cut from; those are named instead.
    skip = layout.container_dims()
    shown = [m for m in layout.meshes if set(m["dim_names"]) - skip]
    shown = [m for m in shown if not m.get("flattened")] or shown or layout.meshes
    meshes = list(dict.fromkeys(f"{'×'.join(m['dim_names'])} ({'×'.join(map(str, m['shape']))})" for m in shown))
    c.count = len(layout.missing_ranks)
    c.verdict = "INCOMPLETE" if gaps else "PASS"
    c.headline = ((f"mesh {', '.join(meshes)}; " if meshes else "")
                  + (f"{len(layout.ranks)} of {layout.world_size} ranks recorded their layout" if gaps
                     else f"every rank ({layout.world_size}) recorded its layout")
                  + (f"; pipeline of {len({layout.stage_of(r) for r in layout.ranks} - {None})} stages"
                     if layout.has_pipeline() else "") + "; peers compared per mesh dimension by check-ranks")
    c.detail = {"meshes": meshes, "missing_ranks": layout.missing_ranks}
    return _reasons(c, [f"INCOMPLETE: {g}" for g in gaps])


_CHECKERS = {"gradients": check_gradients, "ranks": check_ranks, "compile": check_compile,
             "traces": check_traces, "layout": check_layout}
_TITLES = {"gradients": "Gradient paths", "ranks": "Rank consistency", "compile": "Compile health",
           "traces": "Trace coverage", "layout": "Parallel layout"}


def _run_ranks(session: Session, run_id: int) -> list[int]:
    return sorted(set(session.scalars(select(Rank.rank).where(Rank.run_id == run_id)))
                  | set(session.scalars(select(Graph.rank).where(Graph.run_id == run_id).distinct())))


def _guarded(key: str, session: Session, run: Run, budget_s: float, **kw) -> CheckSummary:
    """Run one check (``kw``: its own keyword arguments); an exception becomes an ERROR line (the
    session rolled back)."""
    t0 = time.perf_counter()
    try:
        c = _CHECKERS[key](session, run, t0 + budget_s, **kw)
    except Exception as exc:  # noqa: BLE001 - any failure of a check is reported, never taken as a pass
        log.exception("summary: check %s of run %s raised", key, run.name)
        session.rollback()
        c = CheckSummary(key, _TITLES[key], "ERROR", None, "", f"the check raised {type(exc).__name__}: {exc}"[:500],
                         f"#/runs/{run.id}", "", None, error=f"{type(exc).__name__}: {exc}"[:2000])
    c.elapsed_s = round(time.perf_counter() - t0, 3)
    c.budget_s = budget_s
    if c.elapsed_s > budget_s:
        c.over_budget = True
        c.reasons.append(f"took {c.elapsed_s:.1f} s, over its {budget_s:.0f} s budget")
    return c


# ---------------------------------------------------------------------------- slowest steps


def slowest(session: Session, run: Run, budget_s: float = BUDGETS_S["slowest"], top: int = TOP_STEPS) -> dict:
    """The slowest steps and ranks from the run's traces.

    Returns ``{"available": bool, "reason": str | None, "steps": [{"rank", "step", "dur_ns",
    "source": "cpu" | "gpu", "trace_id", "link"}] (the ``top`` longest, longest first),
    "ranks": [{"rank", "steps", "median_ns", "max_ns", "total_ns"}] (slowest median first, the
    first :data:`TOP_RANKS`), "ranks_total": ranks with a timed step,
    "straggler": rank | None, "straggler_message": str | None, "link", "elapsed_s", "budget_s"}``;
    durations in ns: the ``ProfilerStep#N`` CPU range, else the GPU span of the step's kernels. A
    failure reading the traces gives ``available`` False with the reason (never an empty "no slow step")."""
    from graphdeck.analysis.ranks.heatmap import matched_run
    from graphdeck.analysis.traces.analyze import TraceData, step_times
    from graphdeck.analysis.traces.collectives import run_traces

    t0 = time.perf_counter()
    out: dict = {"available": False, "reason": None, "steps": [], "ranks": [], "straggler": None,
                 "straggler_message": None, "link": f"#/runs/{run.id}/timeline", "budget_s": budget_s}
    try:
        traces = run_traces(session, run.id)
        if not traces:
            out["reason"] = "no usable trace in this run"
            return out
        if len(traces) > 1:
            traces, aligned = matched_run(session, run.id)  # shared with the rank heatmap
            per_rank = aligned["step_times"]
            timing = aligned.get("timing") or {}
            out["straggler"], out["straggler_message"] = timing.get("straggler"), timing.get("message")
        else:
            (rank, tid), = traces.items()
            per_rank = {rank: step_times(TraceData(session, tid))}
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        log.exception("summary: step times of run %s", run.name)
        session.rollback()
        out["reason"] = f"step times could not be read: {type(exc).__name__}: {exc}"[:500]
        return out
    finally:
        out["elapsed_s"] = round(time.perf_counter() - t0, 3)
    steps, ranks = [], []
    for rank, entries in sorted(per_rank.items()):
        durs = []
        for e in entries:
            dur, src = (e["cpu_dur_ns"], "cpu") if e.get("cpu_dur_ns") is not None else (e.get("gpu_span_ns"), "gpu")
            if dur is None:
                continue
            durs.append(dur)
            tid = traces[rank]
            steps.append({"rank": rank, "step": e["step"], "dur_ns": dur, "source": src, "trace_id": tid,
                          "link": f"#/traces/{tid}/replay" + (f"?step={e['step']}" if e["step"] is not None else "")})
        if durs:
            ranks.append({"rank": rank, "steps": len(durs), "median_ns": int(statistics.median(durs)),
                          "max_ns": max(durs), "total_ns": sum(durs), "link": f"#/traces/{traces[rank]}"})
    steps.sort(key=lambda x: (-x["dur_ns"], x["rank"]))
    ranks.sort(key=lambda x: (-x["median_ns"], x["rank"]))
    out.update(available=bool(steps), steps=steps[:top], ranks=ranks[:TOP_RANKS], ranks_total=len(ranks),
               reason=None if steps else "the traces have no timed step (no ProfilerStep range, no kernel)")
    if out["elapsed_s"] > budget_s:
        out["over_budget"] = f"took {out['elapsed_s']:.1f} s, over its {budget_s:.0f} s budget"
    return out


# ---------------------------------------------------------------------------- the overview


def run_summary(session: Session, run: Run, *, budgets_s: dict[str, float] | None = None) -> RunSummary:
    """Every check of ``run`` and its slowest steps (NOTE: [Run overview]). ``budgets_s``
    overrides :data:`BUDGETS_S` per key. Raises nothing for a check's failure (it becomes an
    ERROR line); NotFoundError only through the caller's run lookup."""
    budgets = {**BUDGETS_S, **(budgets_s or {})}
    t0 = time.perf_counter()
    checks = [_guarded(k, session, run, budgets[k]) for k in CHECKS]
    checks.sort(key=lambda c: (SEVERITY.index(c.verdict), CHECKS.index(c.key)))
    slow = slowest(session, run, budgets["slowest"])
    return RunSummary(run.id, run.name, run.world_size, _run_ranks(session, run.id), checks, slow,
                      time.perf_counter() - t0)


def run_check(session: Session, run: Run, part: str, *, budgets_s: dict[str, float] | None = None,
              memo: dict | None = None) -> dict:
    """One part of the overview, for a page that draws each as it arrives: a check of
    :data:`CHECKS` (its :class:`CheckSummary` as a dict, run as :func:`run_summary` runs it: an
    exception is an ERROR line) or ``"slowest"`` (:func:`slowest`'s dict). The run's verdict is
    :attr:`RunSummary.verdict` over the checks' verdicts. ``memo``: for ``traces``, the per-trace
    coverage kept between calls (:func:`check_traces`).

    Raises:
        BadInputError: ``part`` is not one of :data:`PARTS` (HTTP 400).
    """
    from graphdeck.errors import BadInputError

    if part not in PARTS:
        raise BadInputError(f"unknown overview part {part!r}: use one of {', '.join(PARTS)}")
    budgets = {**BUDGETS_S, **(budgets_s or {})}
    if part == "slowest":
        return slowest(session, run, budgets["slowest"])
    return asdict(_guarded(part, session, run, budgets[part], **({"memo": memo} if part == "traces" else {})))
