"""The gradient-path report: one object for graph mode (from the store) and eager mode (from a
live module), with text, JSON and JUnit XML renderings.

A report holds one :class:`ParamRow` per trainable parameter storage per rank (tied weights are
one row with ``aliases``), and run-level :class:`Finding` s (a predicted DDP error or hang, a
collective whose result is never waited on, an intermediate output that is not an autograd
ancestor after compilation, a compiled gradient that differs from the eager one).

Statuses:

* ``OK``: a gradient reaches it (``paths`` counts the ops that carry one: 2 for a tied
  embedding/output projection).
* ``NO_GRAD``: it is read, but the backward returns no gradient for it; ``cut`` names the first
  op on the forward data path where gradient flow stops (``detach``/``.data``, an op run under
  ``no_grad``, an integer/bool output such as ``argmax``).
* ``NOT_IN_GRAPH``: no graph reads it (an unused module, a branch not taken on this rank).
* ``DEAD_END``: it is read, but everything computed from it ends in outputs that never reach the
  loss.
* ``UNKNOWN``: run-time evidence exists but never reached it (the backward raised before it):
  not failing, but it makes the verdict INCOMPLETE.
* ``FROZEN``: ``requires_grad`` is false. ``BUFFER``: a buffer, not a parameter (listed only on
  request).

``FAILING`` statuses make ``ok`` false unless the row matches an ``--allow`` pattern. Example::

    >>> rep = GradReport(mode="eager", run="m", rows=[ParamRow(rank=0, fqn="w", status="OK", paths=1)])
    >>> rep.ok, rep.summary["OK"], rep.to_text().splitlines()[0]
    (True, 1, 'gradient paths of m (eager mode), ranks [0]: PASS · OK 1')
"""

from __future__ import annotations

import fnmatch
import json
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields

STATUSES = ("OK", "NO_GRAD", "NOT_IN_GRAPH", "DEAD_END", "FROZEN", "BUFFER", "UNKNOWN")
FAILING = frozenset({"NO_GRAD", "NOT_IN_GRAPH", "DEAD_END"})

_XML_FORBIDDEN = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")

DDP_UNUSED_ERROR = "Expected to have finished reduction in the prior iteration before starting a new one"


@dataclass
class Cut:
    """Where gradient flow stops on the forward data path from a parameter.

    ``kind``: ``detach`` | ``no_grad`` | ``integer_output`` | ``dead_output`` | ``unused_result`` |
    ``non_differentiable`` | ``not_read``. ``op`` is the op (``aten.detach.default``,
    ``argmax``, ``linear``); ``node`` its graph node name (graph mode) and ``graph_id``;
    ``source`` ``"file.py:LINE"`` of the user code that ran it, ``code`` that line's text;
    ``region`` the ``with torch.no_grad()`` line for a ``no_grad`` cut; ``path`` the node names
    from the parameter to the cut (the graph page highlights them).
    """

    kind: str
    op: str | None = None
    node: str | None = None
    graph_id: int | None = None
    source: str | None = None
    code: str | None = None
    module_path: str | None = None
    region: str | None = None
    detail: str | None = None
    path: list[str] = field(default_factory=list)


@dataclass
class ParamRow:
    """One parameter storage on one rank. ``shape`` in elements, ``dtype`` as torch prints it
    without ``torch.``; ``bucket`` is the DDP bucket index (``None`` outside DDP or when no
    bucket holds it); ``reduced`` whether its gradient reaches an in-graph ``all_reduce`` /
    ``reduce_scatter`` (``None`` when the backward has no collectives)."""

    rank: int
    fqn: str
    status: str
    paths: int = 0
    aliases: list[str] = field(default_factory=list)
    shape: list = field(default_factory=list)
    dtype: str | None = None
    requires_grad: bool = True
    reason: str = ""
    fix: str | None = None
    cut: Cut | None = None
    bucket: int | None = None
    reduced: bool | None = None
    graphs: list[int] = field(default_factory=list)  # graphs that read it
    grad_graphs: list[int] = field(default_factory=list)  # backward graphs that bind its gradient
    first_use: str | None = None  # 'File "x.py", line N, in f' of its first use
    grad_max_abs_diff: float | None = None  # numeric mode: |eager - compiled| max
    allowed: bool = False
    notes: list[str] = field(default_factory=list)
    # Run-time evidence (analysis.gradients.evidence): [[step_first, step_last, state], ...] with state
    # ok | none | zero | multi | frozen | unobserved; the first step without a real gradient.
    steps: list | None = None
    first_bad_step: int | None = None
    zero_filled: bool = False
    # Eager mode's backward check: times its gradient is accumulated in one backward (2 when two
    # reentrant-checkpointed calls use it; 0 when frozen); None when no backward was run.
    accumulations: int | None = None

    @property
    def failing(self) -> bool:
        return self.status in FAILING and not self.allowed


@dataclass
class Finding:
    """A run-level problem. ``kind``: ``NOTHING_CHECKED`` | ``PREDICTED_HANG`` | ``RANK_DIVERGENCE`` | ``DDP_UNUSED_ERROR`` |
    ``COLLECTIVE_NOT_WAITED`` | ``GRAD_NOT_REDUCED`` | ``OUTPUT_NOT_ANCESTOR`` | ``GRAD_MISMATCH`` | ``READY_TWICE`` |
    ``DANGLING_OUTPUT`` | ``INPLACE_ON_DETACHED_ALIAS`` | ``GRAD_ENABLED_IN_INFERENCE_GRAPH`` | ``REQUIRES_GRAD_CHANGED``;
    ``severity``: ``error`` (fails the check) or ``warning``."""

    kind: str
    severity: str
    message: str
    params: list[str] = field(default_factory=list)
    ranks: dict[int, str] | list[int] = field(default_factory=list)
    source: str | None = None
    fix: str | None = None
    graph_id: int | None = None
    node: str | None = None
    allowed: bool = False
    # NOTE: [Predictions the run contradicts] (outcome.py): the 0-based step at which this finding
    # predicts the job raises or hangs (None: it predicts no stop); ``refuted_by``: what the run
    # did instead, when its own evidence went past that step (the finding is then a warning).
    raises_at: int | None = None
    refuted_by: str | None = None


@dataclass
class GradReport:
    """The report of one run (graph mode) or one module (eager mode); iterating gives the rows."""

    mode: str  # "graph" | "eager"
    run: str
    rows: list[ParamRow] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    run_id: int | None = None
    allow: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: What the report saw (ranks, steps, parameter list; see analysis.gradients.evidence.coverage).
    coverage: dict = field(default_factory=dict)
    #: Why the evidence is incomplete; non-empty makes the verdict INCOMPLETE (not PASS).
    incomplete: list[str] = field(default_factory=list)
    allow_incomplete: bool = False

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    # Compatibility with the first report's field names.
    @property
    def params(self) -> list[ParamRow]:
        return self.rows

    @property
    def ranks(self) -> list[int]:
        return sorted({r.rank for r in self.rows})

    @property
    def summary(self) -> dict[str, int]:
        out = {s: 0 for s in STATUSES}
        for r in self.rows:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    @property
    def failures(self) -> list[ParamRow]:
        return [r for r in self.rows if r.failing]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error" and not f.allowed]

    @property
    def gaps(self) -> list[str]:
        """Why the evidence is incomplete: ``incomplete`` plus rows nothing observed."""
        unknown = [f"rank {r.rank} {r.fqn}" for r in self.rows if r.status == "UNKNOWN" or (
            r.steps and r.status != "FROZEN" and all(st in ("unobserved", "frozen") for _, _, st in r.steps))]
        return self.incomplete + ([f"{len(unknown)} parameter(s) were never observed: {', '.join(unknown[:8])}"
                                   + (" …" if len(unknown) > 8 else "")] if unknown else [])

    @property
    def verdict(self) -> str:
        """``FAIL`` (a failing row or error finding), ``INCOMPLETE`` (nothing failed, but the
        evidence does not cover the run: see ``incomplete``), else ``PASS``."""
        if self.failures or self.errors:
            return "FAIL"
        if self.gaps and not self.allow_incomplete:
            return "INCOMPLETE"
        return "PASS"

    @property
    def ok(self) -> bool:
        return self.verdict == "PASS"

    @property
    def problems(self) -> list[dict]:
        """Failing rows and error findings as flat dicts (rank, fqn, status, reason, ...)."""
        out = [{"rank": r.rank, "fqn": r.fqn, "status": r.status, "reason": r.reason, "fix": r.fix,
                "first_use": r.first_use, "source": r.cut.source if r.cut else None}
               for r in self.failures]
        out += [{"fqn": ", ".join(f.params), "status": f.kind, "reason": f.message, "fix": f.fix,
                 "ranks": f.ranks, "source": f.source} for f in self.errors]
        return out

    def apply_allow(self, patterns: list[str] | tuple[str, ...]) -> GradReport:
        """Mark rows (and findings about only such parameters) whose name or an alias matches an
        ``fnmatch`` pattern (``extra.*``, ``*.bias``) as allowed: listed, but not failing."""
        self.allow = list(patterns)
        if not patterns:
            return self

        def hit(name: str) -> bool:
            return any(fnmatch.fnmatchcase(name, p) for p in patterns)

        for r in self.rows:
            r.allowed = any(hit(a) for a in [r.fqn, *r.aliases])
        for f in self.findings:
            f.allowed = bool(f.params) and all(hit(p) for p in f.params)
        return self

    # ------------------------------------------------------------------ renderings
    def to_dict(self) -> dict:
        return {"mode": self.mode, "run": self.run, "run_id": self.run_id, "ranks": self.ranks, "ok": self.ok,
                "verdict": self.verdict, "coverage": self.coverage, "incomplete": self.gaps,
                "allow_incomplete": self.allow_incomplete, "summary": self.summary, "allow": self.allow, "notes": self.notes,
                "problems": self.problems,
                "findings": [asdict(f) for f in self.findings],
                "params": [asdict(r) | {"failing": r.failing} for r in self.rows]}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    @classmethod
    def from_dict(cls, d: dict) -> GradReport:
        """The report :meth:`to_dict` gave (derived keys such as ``ok``, ``summary``, ``problems``
        are recomputed, unknown keys ignored; a finding's ``ranks`` keys, strings in JSON, become
        ints again). Raises ``ValueError`` when ``d`` is not such a dict (no ``mode``/``run``,
        ``params`` or ``findings`` not lists of objects)."""
        if not isinstance(d, dict) or not isinstance(d.get("mode"), str) or "run" not in d:
            raise ValueError("not a gradient report: expected an object with 'mode', 'run' and 'params'")
        rows, findings = d.get("params", []), d.get("findings", [])
        if not isinstance(rows, list) or not isinstance(findings, list) or \
                not all(isinstance(x, dict) for x in rows + findings):
            raise ValueError("not a gradient report: 'params' and 'findings' must be lists of objects")

        def build(kind, src: dict):
            names = {f.name for f in fields(kind)}
            return kind(**{k: v for k, v in src.items() if k in names})

        try:
            out_rows = []
            for r in rows:
                row = build(ParamRow, r)
                if isinstance(row.cut, dict):
                    row.cut = build(Cut, row.cut)
                out_rows.append(row)
            out_findings = []
            for f in findings:
                finding = build(Finding, f)
                if isinstance(finding.ranks, dict):
                    finding.ranks = {int(k) if str(k).lstrip("-").isdigit() else k: v for k, v in finding.ranks.items()}
                out_findings.append(finding)
            rep = build(cls, {k: v for k, v in d.items() if k not in ("rows", "findings")})
        except TypeError as exc:  # a required field is missing
            raise ValueError(f"not a gradient report: {exc}") from None
        rep.rows, rep.findings = out_rows, out_findings
        return rep

    @classmethod
    def from_json(cls, text: str) -> GradReport:
        """The report :meth:`to_json` wrote. Raises ``ValueError`` (``json.JSONDecodeError`` is
        one) when ``text`` is not JSON or not a report."""
        return cls.from_dict(json.loads(text))

    def to_text(self) -> str:
        """Human summary: a verdict line, then one line per failing row and finding."""
        counts = " · ".join(f"{k} {v}" for k, v in self.summary.items() if v)
        from graphdeck.analysis.ranks.records import _ranks_text

        ranks = self.ranks
        if len(ranks) > 1 and self.rows:  # the counts are of (parameter, rank) rows: said so
            counts += f" (of {len({r.fqn for r in self.rows})} parameters × {len(ranks)} ranks)"
        # a store's report of a job with no compiled graph read (eager): its evidence is the run-time steps
        mode = "eager job, run-time evidence" if self.mode == "graph" and self.rows and all(
            not r.graphs and not r.grad_graphs for r in self.rows) else f"{self.mode} mode"
        lines = [f"gradient paths of {self.run} ({mode}), ranks {_ranks_text(ranks)}: "
                 f"{self.verdict} · {counts}"]
        lines += _coverage_lines(self.coverage)
        lines += [f"  note: {n}" for n in self.notes]
        for why in self.gaps:
            lines.append(f"  {'not seen (allowed)' if self.allow_incomplete else 'INCOMPLETE'}: {why}")
        same: dict[tuple, list] = {}  # rows that read alike but for their rank: one entry (1,024 ranks)
        for r in self.rows:
            if r.status not in FAILING and not r.grad_max_abs_diff:
                continue
            tag = "allowed " if r.allowed else ""
            head = (f"{tag}{r.status:<12s}", r.fqn
                    + (f" (= {', '.join(a for a in r.aliases if a != r.fqn)})" if len(r.aliases) > 1 else ""))
            body = [f"      {r.reason}"]
            if r.cut and r.cut.source:
                where = r.cut.source + (f" in {r.cut.module_path}" if r.cut.module_path else "")
                body.append(f"      cut: {r.cut.kind} at {where}" + (f": {r.cut.code}" if r.cut.code else ""))
            if r.cut and r.cut.region:
                body.append(f"      no_grad region opened at {r.cut.region}")
            same.setdefault((*head, *body), []).append(r.rank)
        for (status, what, *body), rks in same.items():
            who = f"rank {rks[0]}" if len(rks) == 1 else f"ranks {_ranks_text(rks, brackets=False)}"
            lines += [f"  {status} {who} {what}", *body]
            if r.first_bad_step is not None:
                lines.append("      steps: " + ", ".join(f"{a}" + (f"–{b}" if b != a else "") + f" {st}"
                                                        for a, b, st in (r.steps or [])))
            if r.fix:
                lines.append(f"      fix: {r.fix}")
        for f in self.findings:
            tag = "allowed " if f.allowed else ""
            lines.append(f"  {tag}{f.kind} ({f.severity}): {f.message}")
            if f.source:
                lines.append(f"      at {f.source}")
            if f.fix:
                lines.append(f"      fix: {f.fix}")
        return "\n".join(lines)

    def to_junit(self) -> str:
        """JUnit XML (the Ant/Jenkins schema CI systems read): one ``testsuite`` per rank with one
        ``testcase`` per parameter, and a ``run`` suite with one ``testcase`` per finding. Failing
        rows and error findings carry a ``<failure type=STATUS>``; allowed ones a ``<skipped>``."""
        root = ET.Element("testsuites", name=f"graphdeck check-grads {self.run}")
        by_rank: dict[int, list[ParamRow]] = defaultdict(list)
        for r in self.rows:
            by_rank[r.rank].append(r)
        total = fails = 0
        for rank in sorted(by_rank):
            rows = by_rank[rank]
            suite = ET.SubElement(root, "testsuite", name=f"{self.run}.rank{rank}", tests=str(len(rows)),
                                  failures=str(sum(1 for r in rows if r.failing)), errors="0",
                                  skipped=str(sum(1 for r in rows if r.allowed and r.status in FAILING)))
            for r in rows:
                case = ET.SubElement(suite, "testcase", classname=f"{self.run}.rank{rank}", name=r.fqn)
                if r.status in FAILING:
                    text = "\n".join(filter(None, [r.reason, r.cut and r.cut.source and f"cut at {r.cut.source}",
                                                   r.fix and f"fix: {r.fix}"]))
                    if r.allowed:
                        ET.SubElement(case, "skipped", message=f"{r.status} (allowed)")
                    else:
                        ET.SubElement(case, "failure", type=r.status, message=f"{r.status}: {r.reason}").text = text
            total += len(rows)
            fails += sum(1 for r in rows if r.failing)
        if self.findings:
            suite = ET.SubElement(root, "testsuite", name=f"{self.run}.run", tests=str(len(self.findings)),
                                  failures=str(len(self.errors)), errors="0", skipped="0")
            for i, f in enumerate(self.findings):
                case = ET.SubElement(suite, "testcase", classname=f"{self.run}.run", name=f"{f.kind}[{i}]")
                if f.severity == "error" and not f.allowed:
                    ET.SubElement(case, "failure", type=f.kind, message=f.message).text = \
                        "\n".join(filter(None, [f.message, f.source, f.fix and f"fix: {f.fix}"]))
                else:
                    ET.SubElement(case, "system-out").text = f.message
            total += len(self.findings)
            fails += len(self.errors)
        root.set("tests", str(total))
        root.set("failures", str(fails))
        for el in root.iter():  # characters XML 1.0 forbids (NUL, U+FFFF, lone surrogates) dropped
            el.text = _XML_FORBIDDEN.sub("", el.text) if el.text else el.text
            for k, v in el.attrib.items():
                el.attrib[k] = _XML_FORBIDDEN.sub("", v)
        ET.indent(root)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _coverage_lines(cov: dict) -> list[str]:
    """One line on what the report saw: ranks, steps, parameter list."""
    if not cov:
        return []
    from graphdeck.analysis.ranks.records import _ranks_text

    steps = cov.get("steps") or {}
    same: dict[str, list[int]] = {}  # ranks that saw the same steps: one entry (1,024 ranks)
    for r, s in sorted(steps.items(), key=lambda kv: int(kv[0])):
        same.setdefault(f"steps {s['first']}–{s['last']} ({s['backward_passes']} backward)", []).append(int(r))
    seen = ", ".join(f"{'rank' if len(rks) == 1 else 'ranks'} {_ranks_text(rks, brackets=False)}: {what}"
                     for what, rks in same.items())
    out = [f"  saw: {seen or 'no run-time gradient evidence'}; parameter list: {cov.get('parameter_list')}"]
    rep = cov.get("replicas") or {}
    compared = [f"{_ranks_text(g)} (data parallel)" for g in rep.get("groups") or []]
    compared += [f"{_ranks_text(t['ranks'])} (Replicate on {t['dim']!r})" for t in rep.get("tp") or []]
    if compared:  # NOTE: [Replica agreement] (replicas.py)
        out.append(f"  replicas compared: {', '.join(compared)} at fingerprinted step(s) "
                   f"{rep.get('fingerprinted_steps') or 'none'}")
    out += [f"  note: {n}" for n in cov.get("notes", [])]
    return out


def divergence_findings(rows: list[ParamRow], *, ddp: bool, find_unused: bool = False,
                        compiled: bool = False, fsdp=None) -> list[Finding]:
    """Parameters whose status differs between ranks. Under DDP (or any data-parallel all-reduce
    of gradients) the ranks then all-reduce different sets of buckets: the first backward hangs
    (``PREDICTED_HANG``). Under DDP with ``find_unused_parameters=True`` (``find_unused``) DDP
    all-reduces zeros for the ranks that skipped the parameter, so nothing hangs, but the ranks
    compute different models (``RANK_DIVERGENCE``, an error too). With ``compiled`` (graph mode),
    ranks whose only trouble is ``DEAD_END`` get a zero-filled gradient from the compiled backward:
    the collectives match, no hang (``RANK_DIVERGENCE``: those ranks silently contribute zeros). Sources: the first use on the
    ranks where it is read, else the cut. The rows of such a parameter on the ranks without a
    gradient get the finding's fix (their own, "remove or freeze it", would miss the cause).
    ``fsdp``: a :class:`graphdeck.analysis.gradients.mesh.Wrapping` with FSDP2 groups — the
    consequence and fix are then FSDP2's (NOTE: [Wrapper words]: the group's reduce-scatter)."""
    from graphdeck.analysis.ranks.records import _ranks_phrase, _ranks_text

    by_fqn: dict[str, list[ParamRow]] = defaultdict(list)
    for r in rows:
        by_fqn[r.fqn].append(r)
    out = []
    for fqn, group in sorted(by_fqn.items()):
        if len({r.status for r in group}) <= 1 or len(group) < 2:
            continue
        per_rank = {r.rank: r.status for r in sorted(group, key=lambda r: r.rank)}
        with_grad = [r.rank for r in group if r.status == "OK"]
        without = [r.rank for r in group if r.status != "OK"]
        src = next((r.first_use for r in group if r.first_use), None) or next(
            (r.cut.source for r in group if r.cut and r.cut.source), None)
        from graphdeck.analysis.gradients.cuts import enclosing_branch

        branch = enclosing_branch(src) if src else None
        zero_filled = compiled and all(r.status == "DEAD_END" for r in group if r.status != "OK")
        if zero_filled:
            # A compiled region's output the loss skipped gets a zero gradient, not none: hooks fire,
            # collectives match, nothing hangs (issue 17).
            consequence = (f"its compiled backward fills a zero gradient on rank(s) {_ranks_text(without)} (the output is unused "
                           "there), so no collective is left unmatched: those ranks silently contribute zeros")
        elif fsdp is not None and fsdp.fsdp2:
            from graphdeck.analysis.gradients.mesh import fsdp2_consequence

            consequence = fsdp2_consequence(fqn, without, fsdp.group_of(fqn))
        elif ddp and find_unused:
            consequence = ("find_unused_parameters=True makes DDP all-reduce zeros for it on rank(s) "
                           f"{_ranks_text(without)}, so the job runs, but the ranks compute different models and its averaged "
                           "gradient is diluted")
        elif ddp:
            consequence = "DDP's bucket all-reduce then differs between ranks: predicted hang at the first backward"
        else:
            consequence = "a data-parallel gradient all-reduce would not match across ranks (predicted hang)"
        by_status: dict[str, list[int]] = defaultdict(list)
        for k, v in per_rank.items():
            by_status[v].append(k)
        message = (f"{fqn}: gradient on rank(s) {_ranks_text(with_grad)} but not on rank(s) {_ranks_text(without)} "
                   f"({', '.join(f'{_ranks_phrase(ks)}: {v}' for v, ks in by_status.items())}); " + consequence)
        if branch:
            message += f"; the use depends on the branch at {branch}"
        fsdp2 = fsdp is not None and fsdp.fsdp2 and not zero_filled
        if fsdp2:
            from graphdeck.analysis.gradients.mesh import fsdp2_fix

            fix = fsdp2_fix([fqn])
        else:
            fix = ("make the branch that uses it take the same path on every rank (or touch the parameter on every "
                   "rank, e.g. add 0 * p.sum())")
        for r in group:  # the row's own fix (remove, freeze, eager mode) would miss the cause
            if r.status != "OK":
                r.fix = f"it gets a gradient on rank(s) {_ranks_text(with_grad)} but not here: {fix}"
        out.append(Finding(kind="RANK_DIVERGENCE" if (ddp and find_unused) or zero_filled else "PREDICTED_HANG",
                           severity="error",
                           message=message, params=[fqn], ranks=per_rank,
                           source=branch.split(": ", 1)[0] if branch else (_short_source(src) if src else None),
                           fix=fix if (ddp and find_unused) or zero_filled or fsdp2
                           else fix + ", or use find_unused_parameters=True"))
    return out


def _short_source(frame_line: str) -> str:
    """'File "/a/b/x.py", line 12, in f' → 'x.py:12 (f)'; other text unchanged."""
    import re

    m = re.search(r'File "(?:.*[\\/])?([^\\/"]+)", line (\d+)(?:, in (\S+))?', frame_line)
    if not m:
        return frame_line
    return f"{m.group(1)}:{m.group(2)}" + (f" ({m.group(3)})" if m.group(3) else "")


def ddp_unused_finding(rows: list[ParamRow], find_unused: bool | None = False,
                       static_graph: bool = False) -> Finding | None:
    """Parameters that get no gradient on every rank under DDP. ``find_unused=False`` (known):
    the next iteration raises DDP's 'Expected to have finished reduction …' on every rank
    (``DDP_UNUSED_ERROR``). ``None`` (the record does not say which DDP options ran, e.g. an
    imported log): what happens under each setting, asserting neither (``DDP_UNUSED_DEPENDS``)."""
    by_fqn: dict[str, list[ParamRow]] = defaultdict(list)
    for r in rows:
        by_fqn[r.fqn].append(r)
    # Only parameters missing on every rank (a rank-dependent one is a predicted hang instead).
    missing = sorted(fqn for fqn, group in by_fqn.items()
                     if all(r.status in ("NOT_IN_GRAPH", "NO_GRAD") and not r.allowed for r in group))
    if not missing:
        return None
    fix = (f"remove or freeze {', '.join(missing)} (requires_grad_(False)), or wrap with "
           "DistributedDataParallel(..., find_unused_parameters=True)")
    if static_graph:  # real torch 2.13: no step raises (tests/test_verdicts_ddp.py, unused_static)
        return ddp_static_finding(missing, fix)
    if find_unused is None:
        return Finding(kind="DDP_UNUSED_DEPENDS", severity="warning", params=missing,
                       message=(f"{', '.join(missing)} get no gradient on every rank, and the record does not say "
                                "which DDP options ran: with find_unused_parameters=False (DDP's default) the next "
                                f"iteration raises '{DDP_UNUSED_ERROR}…' on every rank; with "
                                "find_unused_parameters=True DDP marks them ready and the job runs (they are never "
                                "trained)"),
                       fix=fix)
    return Finding(kind="DDP_UNUSED_ERROR", severity="error", params=missing,
                   message=(f"under DDP with find_unused_parameters=False the next iteration raises "
                            f"'{DDP_UNUSED_ERROR}…' on every rank: {', '.join(missing)} get no gradient"),
                   fix=fix)


def ddp_static_finding(missing: list[str], fix: str) -> Finding:
    """Parameters unused on every rank under DDP with ``static_graph=True``: DDP records them as
    unused in its first iteration, so nothing raises (``DDP_UNUSED_STATIC``, a warning)."""
    return Finding(kind="DDP_UNUSED_STATIC", severity="warning", params=missing, fix=fix,
                   message=(f"{', '.join(missing)} get no gradient on any rank: DDP's static_graph=True records them "
                            "as unused in its first iteration, so no step raises; they are never trained"))


def combine(reports: list[GradReport], *, run: str | None = None, ddp: bool = True,
            labels: list[str] | None = None) -> GradReport:
    """One report over several ranks' eager reports (each rank validates its own batch): rows and
    findings concatenated, rank-divergence findings added. Reports that all claim the same single
    rank (eager mode without a process group says rank 0) are renumbered in list order, with a note
    naming each report by ``labels`` (the CLI's ``--combine`` files) when given."""
    ranks = [rep.ranks for rep in reports]
    renumber = len(reports) > 1 and all(len(r) == 1 for r in ranks) and len({r[0] for r in ranks}) == 1
    if renumber:  # eager reports made without a process group all say rank 0: number them in order
        for k, rep in enumerate(reports):
            for row in rep.rows:
                row.rank = k
    rows = [r for rep in reports for r in rep.rows]
    findings = [f for rep in reports for f in rep.findings if f.kind not in ("PREDICTED_HANG", "RANK_DIVERGENCE")]
    out = GradReport(mode=reports[0].mode if reports else "eager", run=run or (reports[0].run if reports else ""),
                     rows=rows, findings=findings, notes=[n for rep in reports for n in rep.notes])
    if renumber:
        order = (", ".join(f"{name} -> {k}" for k, name in enumerate(labels)) if labels
                 else f"0..{len(reports) - 1}")
        out.notes.append(f"every report said rank {ranks[0][0]}: ranks numbered by "
                         f"{'--combine' if labels else 'list'} order ({order})")
    out.findings += divergence_findings(rows, ddp=ddp)
    return out
