"""check-compile's report as text (for people) and JUnit XML (for CI systems; junitparser),
from a :class:`~graphdeck.analysis.compilation.health.CompileHealth`."""

from __future__ import annotations

from graphdeck.analysis.compilation.health import CompileHealth, FrameBudget
from graphdeck.analysis.ranks.records import _ranks_phrase, _ranks_text
from graphdeck.analysis.units import duration_text

CACHE_NAMES = {"fx_graph": "FX graph cache", "fx_graph_remote": "FX graph cache (remote)",
               "aot_autograd": "AOTAutograd cache", "aot_autograd_remote": "AOTAutograd cache (remote)"}


def _raised(x) -> bool:
    """A compile refused by the recompile limit that raised to the job (``fullgraph=True`` or the
    ``fail_on_recompile`` stance) instead of running the frame eagerly."""
    return "FailOnRecompile" in (x.fail_type or "")


def _frame_ranks(f: FrameBudget) -> str:
    """`` (ranks 1, 3)`` when every rank that compiled the frame has the numbers shown; else
    `` (rank 1, the most of ranks 1, 3)``: the numbers are the worst rank's (``per_rank``)."""
    if len(f.ranks) < 2:
        return ""
    alike = [r for r, v in f.per_rank.items() if v.get("recompiles") == f.recompiles and v.get("used") == f.used]
    if not f.per_rank or len(alike) == len(f.ranks):
        return f" (ranks {_ranks_text(f.ranks, brackets=False)})"
    return f" ({_ranks_phrase(alike)}, the most of ranks {_ranks_text(f.ranks, brackets=False)})"


def _other_ranks(f: FrameBudget) -> str:
    """The ranks whose own numbers differ from those shown, grouped: ``rank 3: 7 compiles used,
    6 recompile(s)``; empty when none differ."""
    groups: dict[tuple, list[int]] = {}
    for r, v in f.per_rank.items():
        if (v.get("recompiles"), v.get("used")) != (f.recompiles, f.used):
            groups.setdefault((v.get("used"), v.get("recompiles")), []).append(r)
    return "; ".join(f"{_ranks_phrase(rs)}: {used} of {f.limit} compiles used, {rec} recompile(s)"
                     for (used, rec), rs in groups.items())


def _frame_lines(f: FrameBudget, indent: str = "  ", raised: bool = False) -> list[str]:
    state = ("LIMIT HIT: the next compile raised to the job (fullgraph=True), nothing ran eagerly" if f.limit_hit and raised
             else "LIMIT HIT: later calls run eagerly" if f.limit_hit
             else "will hit the limit at this rate" if f.will_hit_limit else "")
    out = [f"{indent}{f.frame}{_frame_ranks(f)}: {f.used} of {f.limit} compiles used, {f.recompiles} recompile(s)"
           + (f" — {state}" if state else "") + f"; limit {f.limit_source}"]
    others = _other_ranks(f)
    if others:
        out.append(f"{indent}  other ranks: {others}")
    if f.classes:
        out.append(f"{indent}  budget spent on: " + ", ".join(f"{k} ({n})" for k, n in f.classes.items()))
    for g in f.guards[:5]:
        out.append(f"{indent}  guard {'STORM ' if g['storm'] else ''}x{g['count']} [{g['class']}]: {g['example']}"
                   + (f"  (from {g['source_line']})" if g.get("source_line") else ""))
    for s in f.steps[:12]:
        out.append(f"{indent}  {s['compile_id']}: {s['failed_guard']}"
                   + (f" (+{s['guards_failed'] - 1} more)" if s["guards_failed"] > 1 else ""))
    if len(f.steps) > 12:
        out.append(f"{indent}  … and {len(f.steps) - 12} more recompile(s) of this frame (all in --format json)")
    if f.hint:
        out.append(f"{indent}  hint: {f.hint}")
    return out


def to_text(h: CompileHealth) -> str:
    """Verdict first, then totals, then each rank's times and caches and missing evidence."""
    s = h.summary()
    th = h.thresholds
    gated = (th.max_graph_breaks is not None or th.max_recompiles_per_frame is not None or th.fail_on_eager_fallback
             or th.fail_on_ddp_no_overlap)
    lines = [f"check-compile {h.run}: {h.verdict}" + ("" if gated or h.verdict not in ("PASS", "WARN")
                                                       else " (no threshold given: a report; exit 0)")]
    lines += [f"FAIL: {x}" for x in h.findings]
    lines += [f"WARN: {x}" for x in h.warnings]
    if h.no_graph is not None:
        lines.append(f"  hint: {h.no_graph.hint}")
    lines += [f"INCOMPLETE: {x}" for x in h.missing_evidence]
    lines += [f"UNVERIFIED (md5 failed, record kept and read): {x}" for x in h.unverified]
    fw = (f"{s['framework_breaks']} inside frameworks ({', '.join(s['frameworks'])}), " if s["framework_breaks"]
          else "")
    lines.append(f"graph breaks: {s['graph_breaks']} distinct in user code ({s['graph_break_records']} record(s); "
                 f"{fw}{s['library_breaks']} distinct break(s) inside torch/stdlib, not counted)")
    for b in h.breaks:
        where = "library" if b.library else f"framework: {b.framework}" if b.framework else "user code"
        lines.append(f"  {b.source_line or '?'} [{b.reason_class}, {where}] x{b.count} on rank(s) "
                     f"{_ranks_text(b.ranks, brackets=False)}: {b.headline}")
        lines.append(f"    user frame: {b.user_frame or '?'}; compiled frames: {', '.join(b.frames) or '?'}"
                     + (" — Dynamo skipped the frame (falls back to eager)" if b.eager_fallback else ""))
        if not b.library:
            lines.append(f"    hint: {b.hint}")
    lines.append(f"recompiles: {s['recompiles']} over {s['frames']} frame(s); most in one frame: "
                 f"{s['max_recompiles_per_frame']} (torch records the first failing guard of each cache entry)")
    raised = {x.frame for x in h.fallbacks if _raised(x)}
    for f in h.frames:
        if f.recompiles or f.limit_hit:
            lines += _frame_lines(f, raised=f.frame in raised)
    lines.append(f"eager fallbacks and failed compiles: {len(h.fallbacks)}")
    # ranks whose lines read alike: one line, their ranks as range text (1,024 ranks: not 1,024 lines)
    alike: dict[str, list[int]] = {}
    for x in h.fallbacks:
        first = (x.reason.strip().splitlines() or [""])[0]
        alike.setdefault(f"{x.compile_id} {x.frame}: {x.kind}"
                         + (", raised to the job (fullgraph=True): not an eager fallback" if _raised(x) else "")
                         + f" ({x.fail_type}): {first[:200]}", []).append(x.rank)
    lines += [f"  {_ranks_phrase(rs)} {text}" for text, rs in alike.items()]
    restarts = [(r, x) for r, rh in h.ranks.items() for x in rh.restarts]
    lines.append(f"restarts: {len(restarts)}")
    alike = {}
    for r, x in restarts:
        alike.setdefault(f"{x['compile_id']}: {(x['reason'].strip().splitlines() or [''])[0][:200]}", []).append(r)
    lines += [f"  {_ranks_phrase(rs)} {text}" for text, rs in list(alike.items())[:20]]
    if len(alike) > 20:
        lines.append(f"  … and {len(alike) - 20} more (all in --format json)")
    lines.append("compile time (frames' forward compiles + backward compiles) and caches per rank:")
    same: dict[str, list[tuple[int, float, float, float]]] = {}
    for r, rh in h.ranks.items():
        st = rh.stats
        caches = ", ".join(f"{CACHE_NAMES[k]} {v['hit']} hit / {v['miss']} miss" for k, v in st.cache.items()
                           if v["hit"] or v["miss"] or v["bypass"]) or "no cache counts"
        split = " (frames {} + backward {})" if st.bwd_compile_s else ""
        same.setdefault(f"{st.compiles} compile(s), {{}}{split}; {caches} ({st.cache_source})", []).append(
            (r, st.compile_s, st.frame_compile_s, st.bwd_compile_s))

    def span(values) -> str:  # seconds as a range over the ranks alike (the spread line names them)
        lo, hi = min(values), max(values)
        return duration_text(lo) if duration_text(lo) == duration_text(hi) else f"{duration_text(lo)}-{duration_text(hi)}"

    for text, got in same.items():
        lines.append(f"  {_ranks_phrase([g[0] for g in got])}: "
                     + text.format(*(span([g[i] for g in got]) for i in (1, 2, 3))))
    ct = h.spread.get("compile_s")
    if ct and ct.get("spread") is not None:
        lines.append(f"  spread: compile time {duration_text(ct['spread'])} (rank {ct['min_rank']} "
                     f"{duration_text(ct['min'])} .. rank {ct['max_rank']} {duration_text(ct['max'])})")
    for k, v in h.spread.items():
        if k.endswith("_hit_rate") and v.get("spread") is not None:
            lines.append(f"  spread: {CACHE_NAMES[k[:-9]]} hit rate {v['min']:.0%} .. {v['max']:.0%}")
    return "\n".join(lines)


def to_junit(h: CompileHealth) -> str:
    """One test case per gate (graph breaks, recompiles of each frame, eager fallbacks, DDP overlap) and one
    for the recorded evidence; a passed threshold is a failure, missing evidence too (type
    ``incomplete``), an unchecked gate passes with its numbers in ``system-out``."""
    from junitparser import Failure, JUnitXml, TestCase, TestSuite

    cls = f"graphdeck.compile.{h.run}"
    suite = TestSuite(f"graphdeck check-compile {h.run}")
    th = h.thresholds

    def case(name: str, problems: list[str], out: str, ftype: str = "threshold") -> None:
        c = TestCase(name, classname=cls)
        if problems:
            c.result = [Failure("; ".join(problems), ftype)]
        c.system_out = out
        suite.add_testcase(c)

    case("graph breaks", [x for x in h.findings if "--max-graph-breaks" in x],
         "\n".join(f"{b.source_line} [{b.reason_class}] x{b.count}: {b.headline}" for b in h.user_breaks) or "none")
    for f in h.frames:
        case(f"recompiles {f.frame}", [x for x in h.findings if x.startswith(f"frame {f.frame}:")],
             "\n".join(_frame_lines(f, "", raised=any(_raised(x) and x.frame == f.frame for x in h.fallbacks))))
    case("eager fallbacks", [x for x in h.findings if "fell back to eager" in x] if th.fail_on_eager_fallback else [],
         "\n".join(f"rank {x.rank} {x.compile_id} {x.frame}: {x.kind}" for x in h.fallbacks) or "none")
    case("DDP communication overlap", [x for x in h.findings if x.startswith("--fail-on-ddp-no-overlap")],
         "\n".join(f.message for f in h.ddp_overlap) or "none")
    case("recorded evidence", h.missing_evidence, f"{len(h.ranks)} rank(s) with compile records", "incomplete")
    xml = JUnitXml()
    xml.add_testsuite(suite)
    got = xml.tostring()
    return got.decode() if isinstance(got, bytes) else got
