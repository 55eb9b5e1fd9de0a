"""The N-way rank diff (issue 42): one graph across all ranks of a run, drawn once, with the nodes
where any rank differs, the ranks that differ grouped into classes of identical ranks, the
layout's explanation where one exists, and a per-rank column of node time.

# NOTE: [N-way rank diff]
*The same graph on every rank* is the graph at the same compile id, kind and position among that
compile's graphs of that kind (what ``/api/graphs/{id}/counterparts`` pairs, and check-ranks'
compile sequences line up). Its key reads ``"0/0:aot_forward:0"``.

1. **Fingerprints first.** The ranks' graphs are grouped by their structural hash (computed at
   capture or import), so 1,024 identical ranks are one class and nothing else is read for them.
   Hashes some rank lacks are re-hashed the ways check-ranks does — device indices removed (NOTE:
   [Rank-local device indices]), a mesh dimension's process-group names replaced (NOTE: [Process
   group names in graphs]), FSDP's uneven shards (NOTE: [Rank-dependent shard shapes]) — and the
   classes equal up to these merge, with a note saying so. Nodes are read once per distinct hash.
2. **The base** is the largest class (ties: the one holding the lowest rank), or the class of the
   rank asked for; every other class is diffed against it (:func:`~graphdeck.analysis.graphs.diff.diff_views`,
   NOTE: [Node matching]) and folded into one merged view (NOTE: [Merged N-way graph]). At most
   :data:`MAX_CLASSES` classes are diffed node by node; the rest are listed by their ranks only.
3. **The layout's explanation** (NOTE: [Peers per mesh dimension]), with check-ranks' own
   functions: a class on another pipeline stage runs another program by design; a tensor-parallel
   peer whose graph is the same program with the local shapes its placements give, or whose
   constants are offsets of its coordinate (a vocab or expert slice, NOTE: [Per-rank constants]),
   is a NOTE. Anything else is a divergence.
4. **Time per rank**: each shown rank's node times from its newest mapped trace
   (:func:`~graphdeck.analysis.traces.mapping.node_time_ns`), for at most :data:`MAX_TIME_RANKS`
   ranks — those of the differing classes first.

Verdict (check-ranks' words and exit codes): FAIL (1) when a class diverges; INCOMPLETE (3) when
none does but a chosen rank stored no graph at all; WARN (0) when ranks that compiled other graphs
have none at this key (a recompile on some ranks only: check-ranks judges whether it can hang);
else OK (0; NOTEs allowed).

Pure: reads the store, returns data; the CLI (``graphdeck diff-ranks``), the route
(``GET /api/runs/{run}/graphs/nway``) and the page (``#/runs/<run>/nway``) render it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.records import CompileEntry, _ranks_text
from graphdeck.errors import NotFoundError, UsageError
from graphdeck.store.schema import Graph, Run, Trace

#: Classes diffed node by node against the base; more are listed by their ranks only.
MAX_CLASSES = 32
#: Ranks whose node times are read (one trace mapping each).
MAX_TIME_RANKS = 16
#: Rows of the text's time table besides the differing nodes (the slowest nodes).
TEXT_TIME_ROWS = 10
EXIT_CODES = {"OK": 0, "WARN": 0, "FAIL": 1, "INCOMPLETE": 3}


@dataclass
class RankClass:
    """Ranks whose graph at the key is the same. ``status``: ``base``; ``same`` (equal to the base
    up to device indices, process-group names or FSDP shard shapes: ``why``); ``note`` (differs as
    the layout explains: ``why``); ``differs``; ``missing`` (the ranks compiled other graphs but
    none at this key). ``fingerprints``: the structural hashes merged into the class."""

    ranks: list[int]
    graph_id: int | None
    status: str
    why: str = ""
    fingerprints: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # the graph diff's counts against the base


@dataclass
class NodeDiffers:
    """At one node of the merged graph, ranks ``ranks`` (one or more classes) do ``kind`` (``absent``,
    ``added``, ``replaced``, ``changed``: NOTE: [Merged N-way graph]), as ``detail`` says;
    ``status``: ``differs`` or ``note`` (the layout explains it)."""

    ranks: list[int]
    kind: str
    detail: str
    status: str


@dataclass
class NwayNode:
    """A node of the merged graph where some rank differs: ``id`` (the merged view's node id; the
    base graph's FX name for base nodes), ``target``, ``in_base``, ``differs`` (grouped by what
    they do), ``mark`` (``changed`` / ``removed`` / ``added`` / ``note``: what the SVG draws)."""

    id: str
    target: str
    in_base: bool
    differs: list[NodeDiffers]
    mark: str


@dataclass
class NwayReport:
    run_id: int
    run: str
    key: str  # "compile_id:kind:position"
    kind: str
    ranks: list[int]  # the ranks compared
    base_rank: int | None
    classes: list[RankClass]
    nodes: list[NwayNode]  # differing nodes, in merged graph order
    times: dict[str, dict[str, int]] = field(default_factory=dict)  # node id -> {rank: ns}
    time_ranks: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    missing_evidence: list[str] = field(default_factory=list)
    merged: object = None  # MergedGraph (not serialised: the SVG route draws it)

    @property
    def verdict(self) -> str:
        """FAIL (a class differs), INCOMPLETE (a chosen rank stored no graph), WARN (ranks that
        compiled other graphs lack this one: a compile only some ranks made, which check-ranks
        judges for hangs), else OK — check-ranks' order."""
        if any(c.status == "differs" for c in self.classes):
            return "FAIL"
        if self.missing_evidence:
            return "INCOMPLETE"
        return "WARN" if any(c.status == "missing" for c in self.classes) else "OK"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def marks(self) -> dict[str, str]:
        """Merged node id → the SVG renderer's mark (``diff-changed`` etc., ``diff-note``)."""
        return {n.id: n.mark for n in self.nodes}

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "run": self.run, "key": self.key, "kind": self.kind, "ranks": self.ranks,
                "base_rank": self.base_rank, "verdict": self.verdict, "exit_code": self.exit_code,
                "classes": [asdict(c) for c in self.classes], "nodes": [asdict(n) for n in self.nodes],
                "times": self.times, "time_ranks": self.time_ranks, "notes": self.notes,
                "missing_evidence": self.missing_evidence}

    def lines(self) -> list[str]:
        """The report as text lines (the CLI prints them)."""
        out = [f"graph {self.key} of run {self.run}: {len(self.ranks)} ranks, {len(self.classes)} class(es)"]
        for c in self.classes:
            head = c.status.upper()
            counts = (" (" + ", ".join(f"{v} {k}" for k, v in c.counts.items() if v and k != "same") + ")"
                      if c.counts and any(v for k, v in c.counts.items() if k != "same") else "")
            out.append(f"  {head} ranks {_ranks_text(c.ranks)}"
                       + (f" graph #{c.graph_id}" if c.graph_id is not None else "") + counts
                       + (f": {c.why}" if c.why else ""))
        for n in self.nodes:
            for d in n.differs:
                word = "differ" if d.status == "differs" else "differ (note)"
                out.append(f"  node {n.id}: ranks {_ranks_text(d.ranks, brackets=False)} {word}: {d.detail}")
        if self.time_ranks and self.times:
            out.append("  node time per rank (us): " + " ".join(f"r{r}" for r in self.time_ranks))
            marked = {n.id for n in self.nodes}
            slow = sorted(self.times, key=lambda k: -max(self.times[k].values()))
            for node in [k for k in slow if k in marked] + [k for k in slow if k not in marked][:TEXT_TIME_ROWS]:
                row = self.times[node]
                out.append(f"    {'*' if node in marked else ' '} {node}: "
                           + " ".join(f"{row[str(r)] / 1e3:.1f}" if str(r) in row else "-" for r in self.time_ranks))
        out += [f"  note: {x}" for x in self.notes]
        out += [f"  INCOMPLETE: {x}" for x in self.missing_evidence]
        out.append({"OK": "OK: every rank has the same graph here" + (" (notes above)" if any(
                        c.status in ("note", "same") for c in self.classes) else ""),
                    "WARN": "WARN: some ranks did not compile this graph (see check-ranks for whether it can hang)",
                    "FAIL": "FAIL: ranks differ", "INCOMPLETE": "INCOMPLETE: evidence missing"}[self.verdict])
        return out

    def to_text(self) -> str:
        return "\n".join(self.lines())


# ---------------------------------------------------------------- keys


def graph_keys(session: Session, run_id: int) -> dict[str, dict[int, tuple[int, str | None]]]:
    """Every graph key of the run (NOTE: [N-way rank diff]) → ``{rank: (graph id, structural
    hash)}``, keys in the order the lowest rank captured them. One query for all ranks."""
    out: dict[str, dict[int, tuple[int, str | None]]] = {}
    first: dict[str, tuple[int, int]] = {}
    seen: dict[tuple, int] = defaultdict(int)
    rows = session.connection().execute(
        select(Graph.rank, Graph.id, Graph.ordinal, Graph.kind, Graph.compile_id, Graph.structural_hash)
        .where(Graph.run_id == run_id).order_by(Graph.rank, Graph.ordinal, Graph.id))
    for rank, gid, ordinal, kind, cid, h in rows:
        cid = cid or f"graph{ordinal}"
        n = seen[(rank, cid, kind)]
        seen[(rank, cid, kind)] = n + 1
        key = f"{cid}:{kind}:{n}"
        out.setdefault(key, {})[rank] = (gid, h)
        first.setdefault(key, (rank, ordinal))
    return {k: out[k] for k in sorted(out, key=first.__getitem__)}


def resolve_key(session: Session, run: Run, graph: str, keys: dict[str, dict]) -> str:
    """``graph``: a key (``0/0:aot_forward`` means position 0) or a graph id of the run → its key.

    Raises:
        NotFoundError: no graph of the run has that key or id.
    """
    text = graph.strip()
    if text.isdigit():
        gid = int(text)
        for key, members in keys.items():
            if any(g == gid for g, _h in members.values()):
                return key
        raise NotFoundError(f"graph {gid} is not a graph of run {run.name!r}", resource="graph", id=gid)
    if text.count(":") == 1:
        text += ":0"
    if text not in keys:
        shown = ", ".join(list(keys)[:6]) + (" ..." if len(keys) > 6 else "")
        raise NotFoundError(f"no graph {graph!r} in run {run.name!r} (keys: {shown or 'none'})",
                            resource="graph", id=graph)
    return text


# ---------------------------------------------------------------- classes


def _classes(session: Session, run: Run, key: str, members: dict[int, tuple[int, str | None]],
             ranks: list[int], base_rank: int | None) -> tuple[list[RankClass], list[str]]:
    """Group ``ranks`` holding the graph by fingerprint, merge what check-ranks' re-hashes make
    equal (NOTE: [N-way rank diff] 1.), pick the base; notes on what merged."""
    from graphdeck.analysis.parallel.layout import load_layout
    from graphdeck.analysis.ranks.sequences import NodeKeys, _neutralise_device_indices
    from graphdeck.analysis.ranks.shard_shapes import absorb_shard_shapes

    cid, kind, _pos = key.rsplit(":", 2)
    have = [r for r in ranks if r in members]
    seqs = {r: [CompileEntry(compile_id=cid, graphs=[(kind, members[r][1], members[r][0])])] for r in have}
    keys = NodeKeys(session)
    notes: list[str] = []
    if len({members[r][1] for r in have}) > 1:
        _neutralise_device_indices(session, seqs, keys)
        layout = load_layout(session, run.id)
        if layout is not None:
            from graphdeck.analysis.ranks.mesh import _neutralise_group_names

            present = set(have)
            sets = [[r for r in peers if r in present] for peers in layout.program_peers()]
            _neutralise_group_names(session, seqs, layout, [s for s in sets if s], keys)
        notes += [x.message for x in absorb_shard_shapes(session, run.id, have, seqs, set())]
    by_hash: dict[str | None, list[int]] = defaultdict(list)
    for r in have:
        by_hash[seqs[r][0].graphs[0][1]].append(r)
    groups = sorted(by_hash.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    if base_rank is not None:
        groups.sort(key=lambda kv: base_rank not in kv[1])
    classes = []
    for i, (h, rs) in enumerate(groups):
        raw = list(dict.fromkeys(members[r][1] or "" for r in rs))
        why = ""
        if len(raw) > 1:
            why = ("equal once device indices are removed" if str(h).startswith("dn:")
                   else "equal once process-group names are read as their mesh dimension" if str(h).startswith("mn:")
                   else "equal but for FSDP's uneven shard shapes" if str(h).startswith("shard:") else "")
            notes.append(f"ranks {_ranks_text(rs)}: {len(raw)} fingerprints {why} (NOTE: [N-way rank diff])")
        classes.append(RankClass(ranks=rs, graph_id=members[rs[0]][0], status="base" if i == 0 else "differs",
                                 why=why, fingerprints=raw))
    return classes, notes


def _explain(session: Session, run: Run, key: str, base: RankClass, cls: RankClass) -> str | None:
    """Why ``cls`` differs from ``base`` as the parallel layout intends (NOTE: [N-way rank diff] 3.),
    with check-ranks' own explanations; None when nothing explains it."""
    from graphdeck.analysis.parallel.layout import load_layout

    layout = load_layout(session, run.id)
    if layout is None:
        return None
    rb, rc = base.ranks[0], cls.ranks[0]
    sb, sc = layout.stage_of(rb), layout.stage_of(rc)
    if sb is not None and sc is not None and sb != sc:
        return (f"pipeline stage {sc} vs stage {sb}: ranks of different stages run different programs by design "
                "(a stage slice)")
    if cls.graph_id is None:
        return None
    from graphdeck.analysis.ranks.constants import explain_constants
    from graphdeck.analysis.ranks.mesh import _explained, _sharding_coords

    if _sharding_coords(layout, rb) == _sharding_coords(layout, rc):
        return None  # replicas must agree exactly
    cid, kind, _pos = key.rsplit(":", 2)
    a = CompileEntry(compile_id=cid, graphs=[(kind, "base", base.graph_id)])
    b = CompileEntry(compile_id=cid, graphs=[(kind, "other", cls.graph_id)])
    why = _explained(session, layout, a, b, rb, rc)
    if why:
        return f"tensor-parallel peers: the same program with the local shapes their placements give ({why})"
    why = explain_constants(session, layout, a, b, rb, rc)
    if why:
        return f"tensor-parallel peers: only per-rank constants their mesh coordinate explains ({why})"
    return None


# ---------------------------------------------------------------- the report


def nway_report(session: Session, run: Run, graph: str, ranks: str | None = None, base_rank: int | None = None,
                times: bool = True) -> NwayReport:
    """The N-way rank diff of graph ``graph`` (a key or a graph id: :func:`resolve_key`) over
    ``ranks`` (``"0,2-5"``; None: every rank of the run), based on ``base_rank``'s class when given
    (NOTE: [N-way rank diff]). ``times``: read per-rank node times (one trace mapping per rank,
    at most :data:`MAX_TIME_RANKS`).

    Raises:
        NotFoundError: no such graph in the run.
        UsageError: a bad ``ranks`` spec, a rank not in the run, or ``base_rank`` not among them.
    """
    keys = graph_keys(session, run.id)
    key = resolve_key(session, run, graph, keys)
    return _report(session, run, key, keys, _run_ranks(session, run, ranks), base_rank, times)


def nway_reports(session: Session, run: Run, ranks: str | None = None, times: bool = False) -> list[NwayReport]:
    """:func:`nway_report` of every graph key of the run, in capture order (the CLI without
    ``--graph``). Keys whose ranks all share one fingerprint cost one row each."""
    keys = graph_keys(session, run.id)
    chosen = _run_ranks(session, run, ranks)
    return [_report(session, run, k, keys, chosen, None, times) for k, m in keys.items() if any(r in m for r in chosen)]


def _run_ranks(session: Session, run: Run, spec: str | None) -> list[int]:
    from graphdeck.analysis.traces.export import parse_ranks
    from graphdeck.store.schema import Rank

    have = set(session.scalars(select(Rank.rank).where(Rank.run_id == run.id))) | set(
        session.scalars(select(Graph.rank).where(Graph.run_id == run.id).distinct()))
    return parse_ranks(spec, have, missing_is="are not ranks of this run", have_are="ranks")


def _report(session: Session, run: Run, key: str, keys: dict, ranks: list[int], base_rank: int | None,
            times: bool) -> NwayReport:
    if base_rank is not None and base_rank not in ranks:
        raise UsageError(f"base rank {base_rank} is not among the ranks compared ({_ranks_text(ranks)})")
    members = keys[key]
    if base_rank is not None and base_rank not in members:
        raise UsageError(f"base rank {base_rank} has no graph {key}")
    classes, notes = _classes(session, run, key, members, ranks, base_rank)
    report = NwayReport(run_id=run.id, run=run.name, key=key, kind=key.rsplit(":", 2)[1], ranks=ranks,
                        base_rank=classes[0].ranks[0] if classes else None, classes=list(classes), nodes=[],
                        notes=notes)
    absent = [r for r in ranks if r not in members]
    if absent:
        busy = set(session.scalars(select(Graph.rank).where(Graph.run_id == run.id, Graph.rank.in_(absent)).distinct()))
        bare = [r for r in absent if r not in busy]
        if bare:
            report.missing_evidence.append(f"ranks {_ranks_text(bare)} stored no graph at all: not compared")
        missing = RankClass(ranks=[r for r in absent if r in busy], graph_id=None, status="missing",
                            why=f"these ranks compiled other graphs but none at {key}")
        if missing.ranks and classes:
            missing.why = _explain(session, run, key, classes[0], missing) or missing.why
            missing.status = "note" if missing.why.startswith("pipeline") else "missing"
            report.classes.append(missing)
    if not classes:
        raise NotFoundError(f"none of ranks {_ranks_text(ranks)} has graph {key} in run {run.name!r}",
                            resource="graph", id=key)
    base = classes[0]
    from graphdeck.analysis.graphs.view import graph_view

    base_view = graph_view(session, base.graph_id)
    versions, diffed = [], []
    for c in classes[1:]:
        why = _explain(session, run, key, base, c)
        if why:
            c.status, c.why = "note", why
        if len(diffed) >= MAX_CLASSES:
            continue
        from graphdeck.analysis.graphs.diff import diff_views

        view = graph_view(session, c.graph_id)
        d = diff_views(base_view, view)
        c.counts = d.counts
        if c.status == "differs" and not any(d.counts[k] for k in ("changed", "removed", "added")):
            c.status, c.why = "same", "the same nodes, shapes and inputs (the fingerprints differ in arguments)"
        versions.append((f"r{c.ranks[0]}", view, d))
        diffed.append(c)
    if len(classes) - 1 > len(diffed):
        rest = [r for c in classes[1 + len(diffed):] for r in c.ranks]
        report.notes.append(f"{len(classes) - 1} classes differ from the base; the first {len(diffed)} are diffed "
                            f"node by node, ranks {_ranks_text(rest)} are listed by class only")
    from graphdeck.analysis.graphs.merge import merge_views

    merged = merge_views(base_view, versions)
    report.merged = merged
    report.nodes = _nodes(merged, diffed, {n.id for n in base_view.nodes})
    for c in diffed:
        if c.status == "differs":
            c.why = _class_summary(merged, diffed.index(c))
    if times:
        _times(session, run, report, members, classes, diffed, merged)
    return report


def _class_summary(merged, v: int) -> str:
    shown = [f"{node}: {ch.detail}" for node, chs in merged.changes.items() for ch in chs if ch.version == v]
    return "; ".join(shown[:3]) + (f" (+{len(shown) - 3} more)" if len(shown) > 3 else "")


def _nodes(merged, diffed: list[RankClass], base_ids: set[str]) -> list[NwayNode]:
    out = []
    by_id = {n.id: n for n in merged.view.nodes}
    for n in merged.view.nodes:
        chs = merged.changes.get(n.id)
        if not chs:
            continue
        grouped: dict[tuple, list[int]] = {}
        for ch in chs:
            status = "note" if diffed[ch.version].status in ("note", "same") else "differs"
            grouped.setdefault((ch.kind, ch.detail, status), []).extend(diffed[ch.version].ranks)
        differs = [NodeDiffers(ranks=sorted(rs), kind=k, detail=d, status=s)
                   for (k, d, s), rs in sorted(grouped.items(), key=lambda kv: min(kv[1]))]
        real = [d for d in differs if d.status == "differs"]
        in_base = n.id in base_ids
        mark = ("note" if not real else "added" if not in_base
                else "removed" if all(d.kind == "absent" for d in real) else "changed")
        out.append(NwayNode(id=n.id, target=by_id[n.id].target, in_base=in_base, differs=differs, mark=mark))
    return out


def _times(session: Session, run: Run, report: NwayReport, members: dict, classes: list[RankClass],
           diffed: list[RankClass], merged) -> None:
    """Per-rank node time (NOTE: [N-way rank diff] 4.), on the merged view's node ids."""
    from graphdeck.analysis.traces.mapping import node_time_ns

    traced = set(session.scalars(select(Trace.rank).where(Trace.run_id == run.id,
                                                          Trace.status.in_(("ok", "truncated"))).distinct()))
    order = [r for c in classes[1:] for r in c.ranks] + classes[0].ranks
    chosen = [r for r in order if r in traced and r in members][:MAX_TIME_RANKS]
    if not traced:
        report.notes.append("no profiler trace stored: no per-rank node time")
        return
    shown_traced = [r for r in report.ranks if r in traced and r in members]
    if len(shown_traced) > len(chosen):
        report.notes.append(f"node time shown for {len(chosen)} of the {len(shown_traced)} traced ranks "
                            f"(at most {MAX_TIME_RANKS}; the differing classes first)")
    name_map = {r: merged.names[diffed.index(c)] for c in diffed for r in c.ranks}
    for r in sorted(chosen):
        names = name_map.get(r)
        for node, ns in node_time_ns(session, members[r][0]).items():
            mid = names.get(node) if names is not None else node
            if mid is not None:
                report.times.setdefault(mid, {})[str(r)] = int(ns)
    report.time_ranks = sorted(chosen)


def report_json(reports: list[NwayReport]) -> str:
    """Reports as the CLI's ``--json``: one object, or ``{"verdict", "graphs": [...]}`` for many."""
    if len(reports) == 1:
        return json.dumps(reports[0].to_dict(), indent=1)
    verdict = worst([r.verdict for r in reports])
    return json.dumps({"verdict": verdict, "exit_code": EXIT_CODES[verdict],
                       "graphs": [r.to_dict() for r in reports]}, indent=1)


def worst(verdicts: list[str]) -> str:
    """FAIL over INCOMPLETE over WARN over OK."""
    return next((v for v in ("FAIL", "INCOMPLETE", "WARN") if v in verdicts), "OK")
