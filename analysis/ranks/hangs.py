"""The hang report: Flight Recorder's first mismatch per process group
(:mod:`graphdeck.analysis.ranks.flight`) joined to the compile records that explain it.

For each rank that did not reach a group's first mismatched collective, :func:`explain` adds
``why`` lines, from the run's compile comparison (:func:`graphdeck.analysis.ranks.core.rank_report`):

* a compile on one side only — a recompile on that rank (its guard/recompile reason), and the
  first node where its new graph differs from the graph the other ranks kept running (module,
  source line), e.g. the ``all_reduce`` the new graph no longer has;
* a different graph for the same compile (first differing node, module, source line), a failed
  compile;
* when every rank compiled the same graphs: that, and where the collective was issued — inside a
  compiled graph (then the graphs cannot explain it) or from non-compiled code at the line the
  stacks show (a data-dependent branch in Python), with the line the other rank went on to.
  Graph breaks recorded on the ranks are named (their code runs eagerly, between graphs).

:func:`hang_section` returns ``(FlightReport | None, missing evidence lines)`` for
``check-ranks``; it never raises on odd data (a run without FR dumps gives ``(None, [...])``).
It also marks the compile divergences that cannot hang the job (NOTE: [Recompiles that cannot
hang]) and names, as missing evidence, the frames whose live compiles cannot be told (NOTE:
[Live compiles] in :mod:`graphdeck.analysis.ranks.frame_compiles`).

# NOTE: [Recompiles that cannot hang]
A rank that recompiled where the others did not (a size, dtype or value guard) diverges in its
compile sequence, but a job hangs only when the ranks' *collectives* differ. A divergence is
marked ``harmless`` — a warning naming the recompiles and their guards, not a failure — when
every compile id that differs is a recompile (``F/c``, ``c > 0``: a frame's first compile that
differs is a different program) that did not fail and whose collectives are known (it has
graphs, or its ``compilation_metrics`` say ``graph_op_count`` 0); the predicted collective
schedules agree (no predicted mismatch, no frame whose live compiles are uncertain); and, where
the run holds Flight Recorder dumps, no process group's recorded collectives mismatch.
"""

from __future__ import annotations

import ast
import json
import linecache
import re
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.flight import FlightReport, GroupMismatch, flight_report, missing_evidence
from graphdeck.analysis.ranks.records import _ranks_phrase, _ranks_text
from graphdeck.store.schema import CompileEvent

if TYPE_CHECKING:
    from graphdeck.analysis.ranks.core import CompileEntry, Divergence, RankReport


def hang_section(session: Session, report: RankReport) -> tuple[FlightReport | None, list[str]]:
    """FR first mismatches (with their explanation) and missing evidence for ``report``'s run."""
    from graphdeck.analysis.ranks.predicted import uncertain_frames

    fr = flight_report(session, report.run_id)
    if fr is not None:
        for m in fr.mismatches:
            explain(session, report, m)
        from graphdeck.analysis.ranks.partial import one_sided

        one_sided(session, report, fr)  # NOTE: [One-sided collectives]: what the dumps that exist show
    uncertain = uncertain_frames(session, report)
    settle_recompiles(session, report, fr, {(f.rank, f.frame) for f in uncertain})
    return fr, missing_evidence(session, report.run_id, fr) + [f.missing() for f in uncertain]


_RECOMPILE = re.compile(r"/(\d+)(?:_\d+)?$")


def _recompile_number(cid: str | None) -> int | None:
    """``c`` of compile id ``F/c`` (``F/c_a`` retries too), None for an id that is no compile id."""
    m = _RECOMPILE.search(cid or "")
    return int(m.group(1)) if m else None


def _op_count(session: Session, run_id: int, rank: int, cid: str) -> int | None:
    """``graph_op_count`` of the compile's ``compilation_metrics`` record, None when unrecorded."""
    for (meta,) in session.execute(select(CompileEvent.metadata_json).where(
            CompileEvent.run_id == run_id, CompileEvent.rank == rank, CompileEvent.compile_id == cid,
            CompileEvent.name == "compilation_metrics")):
        try:
            m = json.loads(meta or "{}")
        except ValueError:
            continue
        m = m.get("compilation_metrics", m) if isinstance(m, dict) else {}
        if isinstance(m, dict) and isinstance(m.get("graph_op_count"), int):
            return m["graph_op_count"]
    return None


def settle_recompiles(session: Session, report: RankReport, fr: FlightReport | None,
                      uncertain: set[tuple[int, str]]) -> None:
    """Set ``harmless`` on each divergence of ``report`` that cannot hang the job (NOTE:
    [Recompiles that cannot hang]); leaves the others alone."""
    if report.collective_mismatches or (fr is not None and fr.mismatches):
        return
    from graphdeck.analysis.ranks.core import frame_of

    for d in report.divergences:
        ref, div = d.reference_ranks[0], d.ranks[0]
        a = {e.compile_id: e for e in report.sequences.get(ref, [])}
        b = {e.compile_id: e for e in report.sequences.get(div, [])}
        named: list[str] = []
        for cid in sorted(set(a) | set(b), key=lambda c: [int(x) for x in re.findall(r"\d+", c)]):
            ea, eb = a.get(cid), b.get(cid)
            if ea is not None and eb is not None and ea.signature() == eb.signature():
                continue
            if not _recompile_number(cid) or any(e is not None and e.failed for e in (ea, eb)):
                break  # a frame's first compile differs, or a compile failed: a different program
            if any((r, frame_of(cid)) in uncertain for r in (*d.ranks, *d.reference_ranks)):
                break
            sides = []
            for e, ranks, rank in ((ea, d.reference_ranks, ref), (eb, d.ranks, div)):
                if e is None:
                    continue
                if not e.graphs and _op_count(session, report.run_id, rank, cid) != 0:
                    break  # its collectives are unknown
                sides.append((e, ranks))
            else:
                e, ranks = sides[0] if len(sides) == 1 else (sides[1][0], d.ranks + d.reference_ranks)
                named.append(f"frame {e.frame or frame_of(cid)} compile {cid} on ranks {sorted(ranks)}"
                             + (f" (guard: {e.recompile_reason})" if e.recompile_reason else "")
                             + ("" if e.graphs else " (no graph ops)"))
                continue
            break
        else:
            if not named:
                continue
            n = {len(s) for s in report.schedules.values()}
            text = (f"recompiles only: {'; '.join(named)}. The collective schedules agree — predicted: every rank "
                    f"issues the same {n.pop() if len(n) == 1 else '?'} collective(s) a step")
            if fr is not None:
                text += (f"; recorded: the Flight Recorder dumps of ranks {fr.ranks} hold no mismatched collective "
                         f"({len(fr.groups_agree)} process group(s) agree"
                         + (f"; {len(fr.groups_incomplete)} cannot be told: ranks {fr.no_dump} wrote no dump"
                            if fr.groups_incomplete else "") + ")")
            else:
                text += "; no Flight Recorder dump to check it against"
            d.harmless = text + " — so no hang is expected from these recompiles"


NO_COMPILE = "so no compile explains this"


def agree_with_predictions(report: RankReport) -> None:
    """NOTE: [One answer to "which compile explains this hang"]: the Flight Recorder section (here,
    from the frames the dumps' stacks pass through) and the predicted-vs-recorded section
    (:mod:`graphdeck.analysis.ranks.predicted`, from the steady-state schedule of each rank's
    compiles) answer the same question for a group's first mismatch. Where the prediction names
    the compile that makes rank ``r`` skip the group's collective, its answer is the one both show:
    a "no compile explains this" line of ``r`` is replaced by it. Runs after
    :func:`~graphdeck.analysis.ranks.predicted.prediction_checks`, in place."""
    fr = report.flight
    if fr is None or not report.predictions:
        return
    checks = {p.group: p for p in report.predictions}
    for g, missing in fr.groups_incomplete.items():  # NOTE: [One-sided collectives]: the compile records' word
        p = checks.get(g)
        skip = sorted(set(p.predicted_skipping) & set(missing)) if p is not None and p.predicted_hang else []
        if skip and g in fr.shown:
            fr.shown[g] = (fr.shown[g].replace(", so these dumps alone do not explain a hang", "")
                           + f"; the compile records of ranks {skip} predict that they skip it: {p.predicted}")
    for m in fr.mismatches:
        p = checks.get(m.group)
        if p is None or not (p.predicted_hang or p.predicted_divergent):
            continue
        named = set(p.predicted_skipping) or set(p.predicted_divergent) or set(p.members)
        for r in m.not_reached:
            lines = m.why.get(r) or []
            if r in named and any(NO_COMPILE in x for x in lines):
                m.why[r] = [f"the predicted schedule of group {m.group} explains it: {p.predicted}"
                            if NO_COMPILE in x else x for x in lines]


def _functions(m: GroupMismatch, r: int) -> set[str]:
    """Function names in the stacks of the collective, of what rank ``r`` recorded instead and of
    what it went on to: a compile of another frame cannot explain this mismatch."""
    out: set[str] = set()
    for e in (*m.issued.values(), m.instead.get(r), m.doing.get(r)):
        for f in (e.stack if e is not None else ()):
            out.add(f.rsplit(" in ", 1)[-1])
    return out


def _relevant(report: RankReport, m: GroupMismatch, r: int) -> list[tuple[Divergence, bool]]:
    """Compile divergences between rank ``r`` and the ranks that reached, of a frame the stacks
    name (any frame when no stack was recorded); bool: ``r`` is on the diverging side."""
    out = []
    reached = m.reached
    names = _functions(m, r)
    for d in report.divergences:
        e = _entry(report, (d.ranks if d.what != "missing compile" else d.reference_ranks)[0], d.compile_id)
        frame = e.frame.split(" ")[0] if e is not None and e.frame else None
        if names and frame and frame not in names:
            continue
        if r in d.ranks and set(reached) & set(d.reference_ranks):
            out.append((d, True))
        elif r in d.reference_ranks and set(reached) & set(d.ranks):
            out.append((d, False))
    return out


def _entry(report: RankReport, rank: int, cid: str | None) -> CompileEntry | None:
    return next((e for e in report.sequences.get(rank, []) if e.compile_id == cid), None)


def _graph_of(entry: CompileEntry | None, kinds=("dynamo",)) -> int | None:
    if entry is None:
        return None
    return next((gid for k, _h, gid in entry.graphs if k in kinds), None)


def _recompile_text(session: Session, report: RankReport, d: Divergence, side: list[int], other: list[int]) -> list[str]:
    """A compile only ``side`` made: which, why, and how its graph differs from the one ``other``
    ran for the same frame."""
    from graphdeck.analysis.ranks.core import first_node_difference

    new = _entry(report, side[0], d.compile_id)
    frame = f" frame {new.frame}" if new is not None and new.frame else ""
    out = [f"ranks {_ranks_text(side)} recompiled{frame} (compile {d.compile_id}) and ranks {_ranks_text(other)} did not"
           + (f"; recompile reason: {d.recompile_reason}" if d.recompile_reason else "")]
    if new is None:
        return out
    frame_id = (d.compile_id or "").split("/")[0]
    kept = [e for e in report.sequences.get(other[0], []) if (e.compile_id or "").split("/")[0] == frame_id]
    gid_new, gid_old = _graph_of(new), _graph_of(kept[-1] if kept else None)
    if gid_new is None or gid_old is None:
        return out
    old_c, new_c = _collective_nodes(session, gid_old), _collective_nodes(session, gid_new)
    kinds_new = [k for _n, k, _s in new_c]
    for name, kind, src in old_c:
        if kind in kinds_new:
            kinds_new.remove(kind)
            continue
        out.append(f"its new graph {gid_new} issues no {kind} where ranks {other}' graph {gid_old} does: node {name}"
                   f"{' at ' + src if src else ''}")
        m = _FRAME.match(src or "")
        found = branch_in_source(m.group(1), int(m.group(2)), None) if m else None
        if found:
            out.append(f"the branch: {m.group(1)}:{found[0]} in {m.group(3)}: `{found[1]}` holds that {kind}; the "
                       "recompiled graph was traced the other way (its guard above)")
        return out
    a, b, change = first_node_difference(session, gid_old, gid_new)
    if change == "removed" and a is not None:
        out.append(f"its new graph {gid_new} lacks node {a.name} ({a.target}) that ranks {other}' graph {gid_old} "
                   f"runs{' in ' + a.module_path if a.module_path else ''}{' at ' + a.source if a.source else ''}")
    elif change == "added" and b is not None:
        out.append(f"its new graph {gid_new} adds node {b.name} ({b.target}){' at ' + b.source if b.source else ''}")
    elif change == "changed" and a is not None and b is not None:
        out.append(f"its new graph {gid_new} first differs at {b.name} ({b.target}) vs {a.name} ({a.target})"
                   f"{' at ' + (b.source or a.source) if (b.source or a.source) else ''}")
    return out


def _collective_nodes(session: Session, graph_id: int) -> list[tuple[str, str, str | None]]:
    """(node name, collective kind, source line) of the collectives graph ``graph_id`` issues."""
    from graphdeck.analysis.gradients.cuts import frames
    from graphdeck.analysis.ranks.core import collective_target_ids
    from graphdeck.analysis.ranks.flight import LIBRARY_FRAMES
    from graphdeck.store.schema import InternedString, Node

    ids = collective_target_ids(session)
    if not ids:
        return []
    rows = session.execute(select(Node.name, Node.target_id, InternedString.value)
                           .outerjoin(InternedString, InternedString.id == Node.stack_trace_id)
                           .where(Node.graph_id == graph_id, Node.target_id.in_(list(ids))).order_by(Node.idx))

    def user_line(stack: str | None) -> str | None:  # innermost frame of user code (not torch's)
        fr = frames(stack) or []
        for path, line, fn in reversed(fr):
            if not any(x in path for x in LIBRARY_FRAMES):
                return f"{path}:{line} in {fn}"
        return f"{fr[-1][0]}:{fr[-1][1]} in {fr[-1][2]}" if fr else None

    return [(n, ids[t], user_line(st)) for n, t, st in rows]


_FRAME = re.compile(r"^(.*):(\d+) in (.*)$")
_BRANCHES = (ast.If, ast.While, ast.For, ast.AsyncFor, ast.Try, ast.Match, ast.IfExp)


def _user_frames(stack: list[str]) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of the user frames of an FR stack (innermost first there),
    outermost first."""
    from graphdeck.analysis.ranks.flight import LIBRARY_FRAMES

    out = []
    for f in reversed(stack):
        m = _FRAME.match(f)
        if m and not any(x in f for x in LIBRARY_FRAMES):
            out.append((m.group(1), int(m.group(2)), m.group(3)))
    return out


def _arm(node: ast.AST, line: int) -> str | None:
    """Which part of compound statement ``node`` holds ``line``: "test", a branch arm, or None."""
    if not (node.lineno <= line <= (node.end_lineno or node.lineno)):
        return None
    for name in ("body", "orelse", "finalbody", "handlers", "cases"):
        part = getattr(node, name, None)
        if isinstance(part, list) and part:
            for i, x in enumerate(part):
                if x.lineno <= line <= (x.end_lineno or x.lineno):
                    return f"{name}{i if name in ('handlers', 'cases') else ''}"
        elif isinstance(part, ast.AST) and part.lineno <= line <= (part.end_lineno or part.lineno):
            return name
    return "test"


def branch_in_source(file: str, line_a: int, line_b: int | None) -> tuple[int, str] | None:
    """``(line, text)`` of the innermost branch (``if``/``while``/``for``/``try``/``match``) of
    Python source ``file`` that puts ``line_a`` and ``line_b`` on different sides (one inside an
    arm the other is not in); with ``line_b`` None, the innermost branch enclosing ``line_a``.
    Read with :mod:`linecache`; None when the file is not readable Python or no branch does."""
    if not file.endswith(".py"):
        return None
    source = "".join(linecache.getlines(file))
    if not source:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    best = None
    for node in ast.walk(tree):
        if not isinstance(node, _BRANCHES):
            continue
        a = _arm(node, line_a)
        if a is None or a == "test":
            continue
        if line_b is not None and _arm(node, line_b) == a:
            continue
        if best is None or node.lineno >= best.lineno:
            best = node
    if best is None:
        return None
    return best.lineno, linecache.getline(file, best.lineno).strip()


def branch_between(stack_a: list[str], stack_b: list[str]) -> str | None:
    """The source branch that sent two ranks different ways: the innermost user frame their FR
    stacks share (same file and function, outermost first) where their lines differ, and there
    the branch that separates the two lines (:func:`branch_in_source`); as
    ``"file:line in fn: `if ...:`"``, None when the stacks do not say (no stacks, e.g. JSON
    dumps) or the source is not readable here."""
    fa, fb = _user_frames(stack_a), _user_frames(stack_b)
    for (file, la, fn), (file_b, lb, fn_b) in zip(fa, fb):
        if (file, fn) != (file_b, fn_b):
            return None
        if la != lb:
            found = branch_in_source(file, la, lb)
            return f"{file}:{found[0]} in {fn}: `{found[1]}`" if found else None
    return None


def _python_branch(m: GroupMismatch, r: int, issued) -> list[str]:
    """A collective issued outside the graphs (by its stack) that rank ``r`` skipped: where it is
    issued, what ``r`` went on to, and the branch between the two (:func:`branch_between`)."""
    inst = m.instead.get(r) or m.doing.get(r)
    out = [f"it is issued from non-compiled code at {issued.line or '?'} on ranks {_ranks_text(m.reached)}; "
           f"rank {r} went on to {inst.describe() if inst else 'no collective'}"
           " — a data-dependent branch in Python code outside the graphs"]
    branch = branch_between(issued.stack, inst.stack) if inst is not None else None
    if branch:
        out.append(f"the branch: {branch}")
    elif not issued.stack or inst is None or not inst.stack:
        out.append("the branch's line cannot be found: the dumps hold no stacks for it (JSON dumps have none)")
    else:
        out.append("the branch's line cannot be found: the stacks part in no shared frame whose source is "
                   "readable here")
    return out


def explain(session: Session, report: RankReport, m: GroupMismatch) -> None:
    """Fill ``m.why`` for every rank that did not reach ``m``'s collective."""
    breaks = dict(session.execute(select(CompileEvent.rank, func.count()).where(
        CompileEvent.run_id == report.run_id, CompileEvent.name == "dynamo_graph_break_reason")
        .group_by(CompileEvent.rank)).all())
    has_compiles = any(report.sequences.get(r) for r in report.ranks)
    issued = next(iter(m.issued.values()), None)
    for r in m.not_reached:
        why: list[str] = []
        if m.cause.get(r) == "waiting" and m.doing.get(r) is not None:
            m.why[r] = [f"rank {r} never got here: it waits in {m.doing[r].describe()}, which comes first in its "
                        "program and which the other ranks skipped (see that group)"]
            continue
        layout_only: list[str] = []
        for d, r_diverges in _relevant(report, m, r):
            side, other = (d.ranks, d.reference_ranks) if r_diverges else (d.reference_ranks, d.ranks)
            consts = _per_rank_constants(session, report, d)
            if consts:  # NOTE: [A per-rank constant is no cause]
                layout_only.append(f"not the cause: compile {d.compile_id}'s graphs of ranks {_ranks_text(d.ranks)} and "
                                   f"{_ranks_text(d.reference_ranks)} differ only in per-rank constants ("
                                   + "; ".join(c.text() + (f" at {c.source}" if c.source else "") for c in consts[:3])
                                   + ") — a per-rank slice or offset (an expert slice, a stage, a shard) that issues "
                                   "the same collectives on every rank")
                continue
            if d.what == "extra compile":
                why += _recompile_text(session, report, d, side, other)
            elif d.what == "missing compile":
                why += _recompile_text(session, report, d, other, side)
            else:
                node = d.node or d.reference_node
                why.append(f"{d.what}: {d.message}"
                           + (f" (recompile reason: {d.recompile_reason})" if d.recompile_reason else "")
                           + (f" [node {node.name} in {node.module_path or '-'} at {node.source}]"
                              if node is not None and node.source and node.source not in d.message else ""))
        if not why and layout_only:
            why += _one_sided_compiles(session, report, m, r)
        if not why:
            if not has_compiles:
                why.append("no compile records for this run: import the ranks' TORCH_TRACE logs (or capture "
                           "with the agent) to join the hang to the graphs")
            elif report.divergences:
                why.append(f"the compiles of ranks {m.reached} and rank {r} differ only in frames these stacks do "
                           f"not pass through, {NO_COMPILE}")
            else:
                why.append(f"the graphs agree: ranks {m.reached} and rank {r} compiled the same "
                           f"{len(report.sequences.get(r, []))} graph(s) in the same order, {NO_COMPILE}")
            if issued is not None and issued.compiled:
                why.append(f"the collective is issued inside a compiled graph ({issued.line or 'no user frame'}); "
                           "look at the graphs' inputs on rank " + str(r))
            elif issued is not None:
                why += _python_branch(m, r, issued)
            nb = {k: v for k, v in breaks.items() if v}
            if nb:
                alike: dict[str, list[int]] = {}
                for k, v in sorted(nb.items()):
                    alike.setdefault(str(v), []).append(k)
                why.append("graph breaks recorded: " + ", ".join(f"{_ranks_phrase(ks)}: {v}" for v, ks in alike.items())
                           + " (the code between graphs runs eagerly)")
        m.why[r] = why + layout_only


# NOTE: [A per-rank constant is no cause]
# Two ranks' graphs of one compile that differ only in scalar constants (same ops, shapes and
# wiring: :func:`graphdeck.analysis.ranks.constants.constant_only_difference`, slice bounds
# included) issue the same collectives and read the same parameters: the difference — a rank's
# expert slice, its stage or shard offset, intended by the layout — cannot make a rank skip or add
# a collective. It is named as "not the cause", and the compiles that *do* differ in the frames the
# stacks pass through — a recompile on one side only, which the first-divergence comparison hides
# behind that constant — are looked at instead, with the branch their graphs' collective sits under.


def _per_rank_constants(session: Session, report: RankReport, d: Divergence) -> list:
    """The constants in which ``d``'s two graphs differ when that is all they differ in, else []."""
    from graphdeck.analysis.ranks.constants import constant_only_difference

    if "graph differs" not in (d.what or "") or not d.ranks or not d.reference_ranks:
        return []
    ga = _graph_of(_entry(report, d.reference_ranks[0], d.compile_id))
    gb = _graph_of(_entry(report, d.ranks[0], d.compile_id))
    return (constant_only_difference(session, ga, gb) or []) if ga is not None and gb is not None else []


def _one_sided_compiles(session: Session, report: RankReport, m: GroupMismatch, r: int) -> list[str]:
    """Compiles of the frames the stacks name that rank ``r`` or the first rank that reached ``m``
    made and the other did not, explained as recompiles (:func:`_recompile_text`)."""
    from types import SimpleNamespace

    names = _functions(m, r)
    ref = m.reached[0]
    a = {e.compile_id: e for e in report.sequences.get(ref, [])}
    b = {e.compile_id: e for e in report.sequences.get(r, [])}
    out: list[str] = []
    for cid, e, side, other in ([(c, e, [r], [ref]) for c, e in b.items() if c not in a]
                                + [(c, e, [ref], [r]) for c, e in a.items() if c not in b]):
        frame = (e.frame or "").split(" ")[0]
        if names and frame and frame not in names:
            continue
        out += _recompile_text(session, report, SimpleNamespace(compile_id=cid, recompile_reason=e.recompile_reason),
                               side, other)
    return out
