"""Text and JUnit XML renderings of a :class:`graphdeck.analysis.diff.runs.RunDiff`."""

from __future__ import annotations

from graphdeck.analysis.diff.runs import RunDiff

SECTIONS = ("compile", "graphs", "timing", "memory", "ranks_check", "grads")


def to_text(d: RunDiff) -> str:
    """People's summary: sections and their status, root findings, then the findings that follow
    from them (naming which), improvements, gates and the verdict."""
    lines = [f"diff-runs: A = {d.run_a} (id {d.run_a_id}), B = {d.run_b} (id {d.run_b_id})"
             + ("" if d.same_store else " [two stores]")]
    for name in SECTIONS:
        sec = d.sections.get(name)
        if sec:
            lines.append(f"  {name:<12} {sec['status'].upper() if sec['status'] == 'INCOMPLETE' else sec['status']}: {sec['why']}")
    if "ranks" in d.sections:
        lines.append(f"  ranks        INCOMPLETE: {d.sections['ranks']['why']}")
    roots = d.roots
    lines.append(f"{len(roots)} finding(s)" + (f", {len(d.findings) - len(roots)} following from them" if
                                               len(d.findings) > len(roots) else "") + ":")
    for f in d.findings:
        lines.append(f"  [{f.id}] {f.kind}: {f.message}" + (f" (ranks {_ranks(f.ranks)})" if f.ranks else ""))
        if f.follows_from:
            lines.append(f"      follows from {', '.join(f'[{i}]' for i in f.follows_from)}")
        for link in f.links[:2]:
            lines.append("      graphs: A " + _gid(link.get("a"), link.get("node_a")) + ", B " + _gid(link.get("b"), link.get("node_b")))
        hint = f.detail.get("hint")
        if hint:
            lines.append(f"      hint: {hint}")
    for f in d.improvements:
        lines.append(f"  better [{f.id}] {f.kind}: {f.message}")
    timing = d.sections.get("timing", {})
    if timing.get("status") == "INCOMPLETE":
        lines.append(f"timing: INCOMPLETE ({timing['why']}): no claim is made about node times")
    for fail in d.failures:
        lines.append(f"FAIL {fail}")
    gates = d.sections.get("gates", {})
    for name in gates.get("incomplete", []):
        lines.append(f"INCOMPLETE --{name}: the evidence it needs is missing")
    if d.verdict == "WARN":
        lines.append(f"WARN: {len(d.roots)} finding(s) and no gate covers them (exit 0; --max-new-graph-breaks, "
                     "--max-node-regression-pct, … make them fail)")
    else:
        lines.append(d.verdict)
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    """Range text (``0-24, 26-63``), the checks' (past 8 ranks ``a..b`` read as every rank between)."""
    from graphdeck.analysis.ranks.records import _ranks_text

    return _ranks_text(ranks, brackets=False)


def _gid(gid, node) -> str:
    if gid is None:
        return "-"
    return f"#{gid}" + (f" node {node}" if node else "")


def to_junit(d: RunDiff) -> str:
    """JUnit XML: one test case per gate given (failure = the gate passed, skipped = its evidence
    is missing) and one per section that could not compare."""
    from junitparser import Failure, JUnitXml, Skipped, TestCase, TestSuite

    suite = TestSuite(f"graphdeck diff-runs {d.run_a} {d.run_b}")
    gates = d.sections.get("gates", {})
    names = [n for n in gates.get("why", "").split(", ") if n and n != "no gate given"]
    for name in names:
        case = TestCase(name, classname="graphdeck.diff_runs")
        failed = [x for x in d.failures if x.startswith(f"--{name}:")]
        if failed:
            case.result = [Failure(failed[0].split(": ", 1)[1][:4000])]
        elif name in gates.get("incomplete", []):
            case.result = [Skipped("INCOMPLETE: the evidence this gate needs is missing")]
        suite.add_testcase(case)
    for name in SECTIONS:
        sec = d.sections.get(name)
        if sec and sec["status"] == "INCOMPLETE":
            case = TestCase(f"{name} evidence", classname="graphdeck.diff_runs")
            case.result = [Skipped(sec["why"][:4000])]
            suite.add_testcase(case)
    xml = JUnitXml()
    xml.add_testsuite(suite)
    raw = xml.tostring()
    return raw.decode() if isinstance(raw, bytes) else raw
