"""Run B against run A: what changed in compiles, graphs, node times, memory, ranks and gradients
(issue 21 item 2; ``graphdeck diff-runs``, ``GET /api/diff``, the dashboard's ``#/diff`` page).

# NOTE: [Run diff]
Per rank, each run's graphs of one kind (``dynamo``, ``aot_forward``, ...) in capture order are
joined by structural hash and position: :class:`difflib.SequenceMatcher` aligns the two hash
sequences, so equal graphs pair up even when a graph break inserted graphs between them; the
graphs left in a differing stretch pair up by position (a *structure change*, with its first
differing node from the aligned node lists: op, target, shape, dtype, arguments — module path and
source line named) and the rest are *new* or *removed* graphs. AOT graphs whose Dynamo parent
changed (AOT graphs, DDP buckets, Inductor's graphs) are not reported again.

Findings (each with ``links``: the graph ids of both runs, so a page links both graph views):

* ``new_graph_break`` / ``removed_graph_break``: user-code breaks by (reason class, source line)
  from :func:`graphdeck.analysis.compilation.health.compile_health` (breaks inside torch, such as
  DDP's, are left out); ``new_recompiles``: a frame that recompiled more often, with the guards
  that failed only in run B;
* ``structure_changed`` / ``new_graph`` / ``removed_graph``;
* ``node_regression``: nodes slower beyond the noise floor (NOTE: [Noise floor] in
  :mod:`graphdeck.analysis.diff.times`), one finding per module (forward and backward nodes
  listed, over all ranks where they regressed); ``module_regression``: a module whose summed time
  regressed while none of its nodes did alone (it follows from the rank's node regressions when
  there are any, NOTE: [Interference]);
* ``peak_memory`` / ``saved_activations``: the largest graph-derived step peak
  (:func:`graphdeck.analysis.memory.core.step_memory` over each forward/backward pair) and the bytes
  saved for backward (summed over the rank's pairs), per rank, when they changed;
* ``new_rank_divergence``: a divergence or collective mismatch of
  :func:`graphdeck.analysis.ranks.core.rank_report` that run A does not have;
* ``new_grad_finding``: a gradient-path finding or failing parameter (graph-mode
  :func:`graphdeck.analysis.gradients.core.validate_backward`) that run A does not have.

``follows_from`` lists the ids of the findings a finding is a consequence of: a structure change,
new or removed graph on a rank with a new graph break or recompile follows from it, and one
holding a regressed node follows from that regression; a memory change follows from the rank's
structure changes. Findings with an empty ``follows_from`` are the *root* findings.

Each section says whether it could compare (``sections[name] = {"status": "compared" |
"INCOMPLETE", "why": ...}``): no trace in one run means no timing comparison, said, never "no
regression". Verdict: FAIL when a gate is passed; else INCOMPLETE when a gated section could not
compare; else PASS. Pure: reads the stores, returns data.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.diff.times import DEFAULT_K, DEFAULT_MIN_NS, compare_rank, rank_times
from graphdeck.errors import UsageError
from graphdeck.store.schema import Graph, Rank, Run

JOIN_KINDS = ("dynamo", "ddp_partition", "aot_forward", "aot_backward", "aot_inference", "inductor_post_grad")


@dataclass
class Gates:
    """CI gates; None / False = not checked. Percentages are of run A's value."""

    max_new_graph_breaks: int | None = None
    max_new_recompiles: int | None = None
    max_node_regression_pct: float | None = None
    max_peak_memory_increase_pct: float | None = None
    fail_on_new_divergence: bool = False
    fail_on_new_grad_findings: bool = False
    noise_k: float = DEFAULT_K
    min_regression_ns: int = DEFAULT_MIN_NS

    def __post_init__(self) -> None:
        for name in ("max_new_graph_breaks", "max_new_recompiles", "max_node_regression_pct",
                     "max_peak_memory_increase_pct", "min_regression_ns"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise UsageError(f"{name} must be a number >= 0 (got {v!r})")
        if isinstance(self.noise_k, bool) or not isinstance(self.noise_k, (int, float)) or self.noise_k < 0:
            raise UsageError(f"noise_k must be a number >= 0 (got {self.noise_k!r})")


@dataclass
class Finding:
    id: int
    kind: str
    message: str
    ranks: list[int] = field(default_factory=list)
    links: list[dict] = field(default_factory=list)  # {"a": graph id | None, "b": graph id | None, "node_a", "node_b"}
    detail: dict = field(default_factory=dict)
    follows_from: list[int] = field(default_factory=list)


@dataclass
class RunDiff:
    run_a: str
    run_b: str
    run_a_id: int
    run_b_id: int
    same_store: bool
    gates: Gates
    findings: list[Finding] = field(default_factory=list)
    improvements: list[Finding] = field(default_factory=list)
    graphs: dict = field(default_factory=dict)  # rank -> join counts
    timing: dict = field(default_factory=dict)  # rank -> {"nodes": top rows, "modules": rows, "source"}
    memory: dict = field(default_factory=dict)  # rank -> {"a": {...}, "b": {...}}
    sections: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # gates passed
    verdict: str = "PASS"

    @property
    def roots(self) -> list[Finding]:
        return [f for f in self.findings if not f.follows_from]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["roots"] = [f.id for f in self.roots]
        d["summary"] = {k: sum(1 for f in self.findings if f.kind == k) for k in sorted({f.kind for f in self.findings})}
        return d


def diff_runs(sa: Session, run_a: Run, sb: Session, run_b: Run, gates: Gates | None = None, *,
              same_store: bool = True, top_nodes: int = 30) -> RunDiff:
    """Diff run ``run_b`` (in session ``sb``) against ``run_a`` (in ``sa``); NOTE: [Run diff].

    Raises:
        UsageError: a gate is invalid, or the two runs are the same run of the same store.
    """
    gates = gates or Gates()
    if same_store and run_a.id == run_b.id:
        raise UsageError(f"run A and run B are the same run ({run_a.name!r}): nothing to compare")
    out = RunDiff(run_a.name, run_b.name, run_a.id, run_b.id, same_store, gates)
    ranks_a, ranks_b = _ranks(sa, run_a), _ranks(sb, run_b)
    add = _adder(out)
    if ranks_a != ranks_b:
        out.sections["ranks"] = {"status": "INCOMPLETE", "why": f"run A has ranks {sorted(ranks_a)}, run B "
                                 f"{sorted(ranks_b)}: ranks of one run only are not compared"}
    from graphdeck.analysis.diff.parts import (
        compile_findings,
        grad_findings,
        memory_findings,
        rank_findings,
        structure_findings,
    )

    joins = {r: join_graphs(sa, run_a.id, sb, run_b.id, r) for r in sorted(ranks_a & ranks_b)}
    partner = {(1, b): a for j in joins.values() for a, b, _ in j["pairs"]}
    partner.update({(0, a): b for j in joins.values() for a, b, _ in j["pairs"]})
    compile_ids = compile_findings(sa, run_a, sb, run_b, out, add, partner)
    out.graphs = {str(r): j["counts"] for r, j in joins.items()}
    regressions = _timing(sa, run_a, sb, run_b, sorted(ranks_a & ranks_b), out, add, top_nodes)
    structure_ids = structure_findings(sa, sb, joins, out, add, compile_ids, regressions)
    memory_findings(sa, run_a, sb, run_b, sorted(ranks_a & ranks_b), out, add, structure_ids)
    rank_findings(sa, run_a, sb, run_b, out, add)
    grad_findings(sa, run_a, sb, run_b, out, add)
    _link_unlinked(out, joins)
    _verdict(out)
    return out


def _ranks(s: Session, run: Run) -> set[int]:
    return (set(s.scalars(select(Rank.rank).where(Rank.run_id == run.id)))
            | set(s.scalars(select(Graph.rank).where(Graph.run_id == run.id).distinct())))


def _adder(out: RunDiff):
    def add(kind: str, message: str, *, ranks=(), links=(), detail=None, follows_from=(), improvement=False) -> Finding:
        f = Finding(len(out.findings) + len(out.improvements) + 1, kind, message, sorted(set(ranks)), list(links),
                    detail or {}, sorted(set(follows_from)))
        (out.improvements if improvement else out.findings).append(f)
        return f
    return add


# ---------------------------------------------------------------------------- graph join


def join_graphs(sa: Session, run_a: int, sb: Session, run_b: int, rank: int) -> dict:
    """Graphs of one rank joined across the runs (NOTE: [Run diff]): ``{"pairs": [(graph A,
    graph B, "same" | "changed")], "removed": [graph A], "added": [graph B], "counts": {...},
    "rows_a"/"rows_b": {graph id: (kind, hash, compile id, parent id, frame, name)}}``."""
    def rows(s, run):
        return {g[0]: g[1:] for g in s.execute(
            select(Graph.id, Graph.kind, Graph.structural_hash, Graph.compile_id, Graph.parent_id, Graph.frame_name,
                   Graph.name).where(Graph.run_id == run, Graph.rank == rank).order_by(Graph.ordinal, Graph.id))}

    ra, rb = rows(sa, run_a), rows(sb, run_b)
    pairs, removed, added = [], [], []
    for kind in JOIN_KINDS + tuple(sorted({v[0] for v in (*ra.values(), *rb.values())} - set(JOIN_KINDS))):
        ga = [g for g, v in ra.items() if v[0] == kind]
        gb = [g for g, v in rb.items() if v[0] == kind]
        ha = [ra[g][1] or f"?{g}" for g in ga]
        hb = [rb[g][1] or f"?{g}" for g in gb]
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ha, hb, autojunk=False).get_opcodes():
            if tag == "equal":
                pairs.extend((ga[i], gb[j], "same") for i, j in zip(range(i1, i2), range(j1, j2)))
                continue
            n = min(i2 - i1, j2 - j1)
            pairs.extend((ga[i1 + k], gb[j1 + k], "changed") for k in range(n))
            removed.extend(ga[i1 + n:i2])
            added.extend(gb[j1 + n:j2])
    counts = {"same": sum(1 for p in pairs if p[2] == "same"), "changed": sum(1 for p in pairs if p[2] == "changed"),
              "removed": len(removed), "added": len(added), "graphs_a": len(ra), "graphs_b": len(rb)}
    return {"pairs": pairs, "removed": removed, "added": added, "counts": counts, "rows_a": ra, "rows_b": rb}


# ---------------------------------------------------------------------------- timing


def _times_from(sources: dict[bool, list[str]]) -> str:
    """Where the node times came from (NOTE: [Node-time table] in graphdeck/store/node_times.py)."""
    table, events = len(sources[True]), sources[False]
    if not events:
        return f"; node times of {table} trace(s) from the table written at ingest" if table else ""
    return (f"; node times of {len(events)} trace(s) mapped from their events, {table} from the table written at "
            f"ingest (first reason: {events[0].removeprefix('trace events (').removesuffix(')')})")


def _timing(sa, run_a, sb, run_b, ranks, out: RunDiff, add, top_nodes: int) -> dict[tuple[int, int], int]:
    """Node-time findings; returns ``{(side, graph id): finding id}`` for graphs (of either run,
    side 0 = A, 1 = B) holding a regressed node."""
    g = out.gates
    missing, by_group, module_rows = [], defaultdict(list), []
    unknown_spread, drifts = [], []
    rank_t: dict[int, tuple] = {}  # rank -> (RankTimes A, RankTimes B)
    sources: dict[bool, list[str]] = {True: [], False: []}  # node times from the ingest table / the events
    for r in ranks:
        ta, tb = rank_times(sa, run_a.id, r), rank_times(sb, run_b.id, r)
        for side, t in (("A", ta), ("B", tb)):
            if t.missing:
                missing.append(f"run {side}: {t.missing}")
            if t.times_from:
                sources[t.times_from == "node-time table"].append(t.times_from)
        if ta.missing or tb.missing:
            continue
        if ta.steps < 2 or tb.steps < 2:
            unknown_spread.append(f"rank {r}: {min(ta.steps, tb.steps)} profiled step(s) in one run: no step-to-step "
                                  "spread, so no noise floor")
        cmp = compare_rank(ta, tb, k=g.noise_k, min_ns=g.min_regression_ns, top=top_nodes)
        rank_t[r] = (ta, tb)
        if not 1 / 1.5 <= cmp["drift"] <= 1.5:
            drifts.append(f"rank {r}: run B's nodes are x{cmp['drift']:g} run A's overall (median over "
                          f"{cmp['drift_nodes']} nodes: machine load, clock or a change slowing every node); "
                          "nodes are judged relative to it")
        regressed = [n for n in cmp["nodes"] if n["regression"]]
        for n in regressed:
            by_group[n["module"]].append((r, n))
        for m in cmp["modules"]:
            if m["regression"]:
                module_rows.append((r, m))
        out.timing[str(r)] = {"drift": cmp["drift"], "drift_nodes": cmp["drift_nodes"],
                              "source_a": ta.source, "source_b": tb.source, "trace_a": ta.trace_id,
                              "trace_b": tb.trace_id, "steps_a": ta.steps, "steps_b": tb.steps,
                              "times_a": ta.times_from, "times_b": tb.times_from,
                              "nodes": cmp["nodes"],
                              "modules": cmp["modules"]}
    why = "; ".join(missing + unknown_spread)
    out.sections["timing"] = ({"status": "INCOMPLETE", "why": why or "no rank in both runs"}
                              if why or not out.timing else
                              {"status": "compared", "why": f"noise floor: {g.noise_k:g} x run A's step-to-step spread, at least "
                               f"{g.min_regression_ns} ns" + "".join(f"; {d}" for d in drifts) + _times_from(sources)})
    graph_finding: dict[tuple[int, int], int] = {}
    regressed_modules: dict[int, set[str]] = defaultdict(set)
    for module, items in sorted(by_group.items()):
        worst = max(items, key=lambda x: x[1]["delta_ns"])[1]
        names = sorted({(n["phase"], n["b_node"]) for _, n in items})
        f = add("node_regression",
                f"module {module or '(top level)'} slower: {worst['phase']} {worst['target']} ({worst['b_node']}) "
                f"{worst['a_ns']} -> {worst['b_ns']} ns per step (+{worst['pct']}%"
                + (f", +{worst['pct_adjusted']}% after the run's drift)" if worst["pct_adjusted"] != worst["pct"] else ")")
                + (f", {len(names) - 1} more node(s)" if len(names) > 1 else ""),
                ranks=[r for r, _ in items],
                links=[{"a": n["a_graph"], "b": n["b_graph"], "node_a": n["a_node"], "node_b": n["b_node"]} for _, n in items],
                detail={"module": module, "phases": sorted({n["phase"] for _, n in items}),
                        "max_pct": max((n["pct_adjusted"] or 0) for _, n in items),
                        "delta_ns": sum(n["delta_ns"] for _, n in items), "source": worst["source"],
                        "nodes": [{"rank": r, **{k: n[k] for k in ("phase", "target", "a_node", "b_node", "a_ns", "b_ns", "delta_ns",
                                                                  "pct", "pct_adjusted", "floor_ns", "a_graph", "b_graph")}}
                                  for r, n in items]})
        for r, n in items:
            graph_finding[(0, n["a_graph"])] = graph_finding[(1, n["b_graph"])] = f.id
            regressed_modules[r].add(module)
    by_rank = defaultdict(set)
    for f in out.findings:
        if f.kind == "node_regression":
            by_rank.update({r: by_rank[r] | {f.id} for r in f.ranks})
    for r, m in module_rows:
        inside = [x for x in regressed_modules[r] if x == m["module"] or x.startswith(m["module"] + ".") or not m["module"]]
        if inside:
            continue
        # NOTE: [Interference] No node of the module is beyond the floor alone; when other nodes of
        # the rank regressed, their cache and memory-bandwidth pressure may explain the sum, so it
        # is listed as following from them rather than as a change of its own.
        add("module_regression", f"module {m['module'] or '(top level)'} slower in sum on rank {r}: {m['a_ns']} -> "
            f"{m['b_ns']} ns per step (+{m['pct']}%), no single node beyond the noise floor"
            + ("; other nodes of this rank regressed (interference?)" if by_rank[r] else ""), ranks=[r],
            links=_module_links(*rank_t[r], m["module"]),
            detail={"module": m["module"], "max_pct": m["pct_adjusted"] or 0, "delta_ns": m["delta_ns"], "floor_ns": m["floor_ns"]},
            follows_from=by_rank[r])
    return graph_finding


def _module_links(ta, tb, module: str, most: int = 8) -> list[dict]:
    """Links of a module's finding: each pair of graphs (run A, run B) holding nodes of ``module``
    (or a sub-module; ``""``: every node) timed in both runs, with the first such node of each
    pair; at most ``most``."""
    links: dict[tuple[int, int], dict] = {}
    for key in ta.keys:
        ia, ib = ta.info.get(key), tb.info.get(key)
        if ib is None or not (not module or ia.module == module or ia.module.startswith(module + ".")):
            continue
        links.setdefault((ia.graph_id, ib.graph_id), {"a": ia.graph_id, "b": ib.graph_id, "node_a": ia.node,
                                                      "node_b": ib.node})
    return list(links.values())[:most]


def _link_unlinked(out: RunDiff, joins: dict[int, dict]) -> None:
    """Every finding links both runs' graphs (docs/ci-gates.md): one that names no graph of its own
    (a gradient finding about a parameter with no cut, a collective mismatch) links its ranks'
    first joined graph pair (Dynamo's when there is one), ``"scope": "rank"``."""
    for f in (*out.findings, *out.improvements):
        if f.links:
            continue
        for r in f.ranks or sorted(joins):
            j = joins.get(r)
            if not j or not j["pairs"]:
                continue
            a, b, _ = next((p for p in j["pairs"] if j["rows_a"][p[0]][0] == "dynamo"), j["pairs"][0])
            f.links.append({"a": a, "b": b, "scope": "rank", "rank": r})


# ---------------------------------------------------------------------------- verdict


def _verdict(out: RunDiff) -> None:
    g, f = out.gates, out.findings
    checks = []  # (gate name, section, failed message or None)
    if g.max_new_graph_breaks is not None:
        n = sum(x.detail.get("count", 1) for x in f if x.kind == "new_graph_break")
        checks.append(("max-new-graph-breaks", "compile",
                       f"{n} new graph break(s) > {g.max_new_graph_breaks}" if n > g.max_new_graph_breaks else None))
    if g.max_new_recompiles is not None:
        n = sum(x.detail.get("added", 0) for x in f if x.kind == "new_recompiles")
        checks.append(("max-new-recompiles", "compile",
                       f"{n} new recompile(s) > {g.max_new_recompiles}" if n > g.max_new_recompiles else None))
    if g.max_node_regression_pct is not None:
        bad = [x for x in f if x.kind in ("node_regression", "module_regression")
               and x.detail.get("max_pct", 0) > g.max_node_regression_pct]
        checks.append(("max-node-regression-pct", "timing",
                       "; ".join(x.message for x in bad) if bad else None))
    if g.max_peak_memory_increase_pct is not None:
        bad = [x for x in f if x.kind == "peak_memory" and (x.detail.get("pct") or 0) > g.max_peak_memory_increase_pct]
        checks.append(("max-peak-memory-increase-pct", "memory", "; ".join(x.message for x in bad) if bad else None))
    if g.fail_on_new_divergence:
        bad = [x for x in f if x.kind == "new_rank_divergence"]
        checks.append(("fail-on-new-divergence", "ranks_check", "; ".join(x.message for x in bad) if bad else None))
    if g.fail_on_new_grad_findings:
        bad = [x for x in f if x.kind == "new_grad_finding"]
        checks.append(("fail-on-new-grad-findings", "grads", "; ".join(x.message for x in bad) if bad else None))
    incomplete = []
    for name, section, failed in checks:
        if failed:
            out.failures.append(f"--{name}: {failed}")
        elif out.sections.get(section, {}).get("status") == "INCOMPLETE":
            incomplete.append(name)
    out.sections["gates"] = {"status": "checked", "why": ", ".join(c[0] for c in checks) or "no gate given",
                             "incomplete": incomplete}
    # NOTE: [WARN is not PASS] (compilation/health.py): findings that no gate covers are WARN, exit 0.
    out.verdict = ("FAIL" if out.failures else "INCOMPLETE" if incomplete
                   else "WARN" if out.roots else "PASS")
