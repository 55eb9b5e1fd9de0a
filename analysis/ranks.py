"""Cross-rank consistency: do all ranks of a run compile the same graphs and issue the same
collectives in the same order?

In SPMD training a rank whose graph differs (a data-dependent branch, another dynamic shape, a
recompile on one rank only, a failed compile) issues a different collective sequence, and the job
hangs in the first collective that does not match. This module reads what the store holds per
rank and answers, before that hang:

* **compile sequence** per rank: every compile id in order (from the captured or imported graphs
  and the ``compilation_metrics`` records), each with the structural hash of each of its graphs,
  its failure (``fail_type``/``fail_reason``) and its recompile reason;
* **groups**: ranks with identical compile sequences; for each group other than the reference
  (the group holding the lowest rank), the first compile that differs and — when both sides have
  a graph there — the first differing node, with its source line and module path;
* **collective schedule** per rank: the collectives the graphs that run in steady state issue in
  order — per frame its latest compile, a graph replaced by a recompile adding none (NOTE:
  [Recompiles replace graphs]); each collective names its compile id — (functional
  collectives ``_c10d_functional.*`` and ``torch.distributed`` calls: kind, process group, output
  bytes), Inductor's ``inductor_collective_schedule`` where it was imported, and DDP's bucket
  all-reduces (one per bucket, in bucket order); the first position where ranks disagree is a
  predicted hang, naming the collective and the ranks on each side;
* **shape-only differences** (:mod:`graphdeck.analysis.shard_shapes`): graphs equal but for
  tensor shapes are classified (NOTE: [Rank-dependent shard shapes]): FSDP's uneven shards
  (dim 0, an even-then-remainder split, no collective involved) are a note and the ranks agree;
  a shape difference feeding a collective, or any other one, is a divergence that says so.

The structural hash is computed at capture or import time (see
:func:`graphdeck.capture.fxrecord.record_graph`), so comparing ranks reads one row per graph and
loads nodes only for the first differing pair.

Pure: reads the store, returns data; the CLI and the server render it.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from graphdeck.analysis.grad_cuts import frames
from graphdeck.store.schema import CompileEvent, Graph, InternedString, Node, Partition, Rank, Run

if TYPE_CHECKING:
    from graphdeck.analysis.flight import FlightReport
    from graphdeck.analysis.shard_shapes import ShardShapes

#: Longest differing middle (nodes) that :func:`first_node_difference` aligns with difflib.
ALIGN_LIMIT = 3000

#: Graph kinds that run (their collectives execute), best first per compile id. A compile whose
#: AOTAutograd graphs were captured is read from those; otherwise from the next tier.
EXECUTED_TIERS: tuple[tuple[str, ...], ...] = (
    ("aot_forward", "aot_backward", "aot_inference"),
    ("inductor_post_grad",),
    ("ddp_partition",),
    ("dynamo",),
)

#: Collective ops by the last component of their target (``_c10d_functional.all_reduce.default``,
#: ``torch.distributed.all_reduce``, ``funcol.all_gather_tensor`` ...). ``wait_tensor`` is not a
#: collective of its own and is left out of the schedule.
COLLECTIVE_KINDS: tuple[str, ...] = (
    "all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
    "all_gather_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
    "reduce_scatter", "all_to_all_single", "all_to_all", "broadcast", "reduce", "scatter", "gather",
    "send", "recv", "isend", "irecv", "barrier", "permute_tensor",
)
_COLLECTIVE_RE = re.compile(
    r"(?:^|\.)(" + "|".join(sorted(COLLECTIVE_KINDS, key=len, reverse=True)) + r")(?:_?)(?:\.default|\.\w+)?$")
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "torch.distributed", "_functional_collectives", "funcol")


@dataclass
class NodeRef:
    """One FX node named for a human: where it is and what it computes."""

    graph_id: int
    idx: int
    name: str
    op: str
    target: str
    shape: str | None
    dtype: str | None
    module_path: str | None
    source: str | None  # last ``File "...", line N, in fn`` of its stack trace


@dataclass
class CompileEntry:
    """One compile id on one rank: its graphs (kind → structural hash) and how it ended."""

    compile_id: str
    graphs: list[tuple[str, str | None, int]]  # (kind, structural hash, graph id), capture order
    failed: str | None = None  # "fail_type: fail_reason" of a failed compile
    recompile_reason: str | None = None
    frame: str | None = None

    def signature(self) -> tuple:
        return (self.compile_id, tuple((k, h) for k, h, _ in self.graphs), self.failed is not None)


@dataclass
class Divergence:
    """Where ranks ``ranks`` first differ from ``reference_ranks``."""

    ranks: list[int]
    reference_ranks: list[int]
    position: int  # index in the compile sequence
    # "graph differs" | "shapes differ" (same program, different shapes) | "collective shapes differ"
    # | "extra compile" | "missing compile" | "compile failed" | "compile sequence differs"
    what: str
    message: str
    compile_id: str | None = None
    reference_graph_id: int | None = None
    graph_id: int | None = None
    kind: str | None = None
    reference_node: NodeRef | None = None
    node: NodeRef | None = None
    recompile_reason: str | None = None
    # why it cannot make the job hang (a recompile whose collective schedules agree), set by
    # analysis.hangs; such a divergence is a warning, not a failure
    harmless: str | None = None


@dataclass
class Collective:
    """One collective a rank issues, in schedule order."""

    index: int
    kind: str
    group: str | None
    size_bytes: int | None
    shape: str | None
    dtype: str | None
    source: str  # "graph" | "inductor_collective_schedule" | "ddp_bucket" | "fsdp_group"
    compile_id: str | None = None
    graph_id: int | None = None
    node: str | None = None
    line: str | None = None

    def signature(self) -> tuple:
        return (self.kind, self.group, self.size_bytes, self.dtype)

    def describe(self) -> str:
        parts = [self.kind]
        if self.group:
            parts.append(f"group {self.group}")
        if self.size_bytes is not None:
            parts.append(f"{self.size_bytes} bytes")
        if self.dtype:
            parts.append(self.dtype)
        where = f" at {self.node} (graph {self.graph_id})" if self.node else ""
        return ", ".join(parts) + where


@dataclass
class CollectiveMismatch:
    """First position where the ranks' collective schedules disagree: a predicted hang."""

    index: int
    variants: list[dict]  # [{"ranks": [...], "collective": Collective | None}]
    message: str


@dataclass
class RankReport:
    run_id: int
    run: str
    ranks: list[int]
    groups: list[list[int]]
    sequences: dict[int, list[CompileEntry]]
    divergences: list[Divergence]
    schedules: dict[int, list[Collective]]
    collective_mismatches: list[CollectiveMismatch]
    notes: list[str] = field(default_factory=list)
    shard_shapes: list[ShardShapes] = field(default_factory=list)
    flight: FlightReport | None = None  # Flight Recorder's first mismatches, joined (analysis.hangs)
    missing_evidence: list[str] = field(default_factory=list)  # dropped records, ranks without a dump
    predictions: list = field(default_factory=list)  # PredictionCheck per group (analysis.predicted)

    @property
    def ok(self) -> bool:
        """True when every rank compiled the same sequence and issues the same collectives, the
        recorded collectives match, and no evidence is missing."""
        return self.verdict == "OK"

    @property
    def verdict(self) -> str:
        """FAIL (ranks diverge or a recorded collective mismatches), INCOMPLETE (nothing found, but
        evidence is missing: never "agree"), else OK."""
        if (any(not d.harmless for d in self.divergences) or self.collective_mismatches
                or (self.flight and self.flight.mismatches)):
            return "FAIL"
        return "INCOMPLETE" if self.missing_evidence else "OK"

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "run_id": self.run_id,
            "run": self.run,
            "ranks": self.ranks,
            "groups": self.groups,
            "sequences": {str(r): [asdict(e) for e in seq] for r, seq in self.sequences.items()},
            "divergences": [asdict(d) for d in self.divergences],
            "schedules": {str(r): [asdict(c) for c in sch] for r, sch in self.schedules.items()},
            "collective_mismatches": [asdict(m) for m in self.collective_mismatches],
            "shard_shapes": [asdict(x) for x in self.shard_shapes],
            "notes": self.notes,
            "verdict": self.verdict,
            "flight": self.flight.to_dict() if self.flight else None,
            "missing_evidence": self.missing_evidence,
            "predictions": [p.to_dict() for p in self.predictions],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        lines = [f"run {self.run}: {len(self.ranks)} ranks {self.ranks}; "
                 f"{len(self.groups)} group(s): " + " | ".join(",".join(map(str, g)) for g in self.groups)]
        for r in self.ranks:
            seq = self.sequences.get(r, [])
            failed = sum(1 for e in seq if e.failed)
            segs = schedule_segments(self.schedules.get(r, []))
            lines.append(f"  rank {r}: {len(seq)} compiles ({failed} failed), "
                         f"{len(self.schedules.get(r, []))} collectives"
                         + (" (" + ", ".join(f"{s['count']} from " + (f"compile {s['compile_id']}" if s["compile_id"]
                                                                      else s["source"]) for s in segs) + ")"
                            if segs else ""))
        for d in self.divergences:
            lines.append(f"{'WARN' if d.harmless else 'DIVERGED'} ranks {d.ranks} vs {d.reference_ranks}: {d.message}"
                         + (f"\n    {d.harmless}" if d.harmless else ""))
            for side, ref in (("reference", d.reference_node), ("diverging", d.node)):
                if ref is not None:
                    lines.append(f"    {side}: {ref.name} = {ref.target} {ref.shape or ''} {ref.dtype or ''}"
                                 f" [{ref.module_path or '-'}] {ref.source or ''}".rstrip())
            if d.recompile_reason:
                lines.append(f"    recompile reason: {d.recompile_reason}")
        for m in self.collective_mismatches:
            lines.append(f"PREDICTED HANG at collective #{m.index}: {m.message}")
        for n in self.notes:
            lines.append(f"note: {n}")
        lines += self.flight.lines() if self.flight else []
        if self.predictions:
            lines.append("Predicted vs recorded, per process group:")
            lines += [f"  {p.line()}" for p in self.predictions]
        lines += [f"MISSING EVIDENCE: {x}" for x in self.missing_evidence]
        warned = sum(1 for d in self.divergences if d.harmless)
        lines.append({"OK": f"OK: the collective schedules agree ({warned} warning(s) above)" if warned
                      else "OK: all ranks agree", "FAIL": "FAIL: ranks diverge",
                      "INCOMPLETE": f"INCOMPLETE: {len(self.missing_evidence)} piece(s) of evidence missing"}[self.verdict])
        return "\n".join(lines)

    def to_junit(self) -> str:
        """JUnit XML: one test case per rank (its compile sequence and its collective schedule);
        shard-shape notes go to the compile-sequence cases' ``system-out`` (they pass)."""
        from junitparser import Failure, JUnitXml, TestCase, TestSuite

        suite = TestSuite(f"graphdeck check-ranks {self.run}")
        for r in self.ranks:
            for what in ("compile sequence", "collective schedule"):
                case = TestCase(f"rank {r} {what}", classname=f"graphdeck.ranks.{self.run}")
                problems = ([d.message for d in self.divergences if r in d.ranks and not d.harmless]
                            if what == "compile sequence"
                            else [m.message for m in self.collective_mismatches
                                  if any(r in v["ranks"] for v in m.variants[1:])])
                if problems:
                    case.result = [Failure("; ".join(problems))]
                elif what == "compile sequence" and self.shard_shapes:
                    case.system_out = "\n".join(x.message for x in self.shard_shapes)
                suite.add_testcase(case)
        if self.missing_evidence or (self.flight and self.flight.mismatches):
            case = TestCase("recorded evidence", classname=f"graphdeck.ranks.{self.run}")
            case.result = [Failure("; ".join(self.missing_evidence + [m.headline() for m in
                                                                       (self.flight.mismatches if self.flight else [])]))]
            suite.add_testcase(case)
        xml = JUnitXml()
        xml.add_testsuite(suite)
        return xml.tostring().decode() if isinstance(xml.tostring(), bytes) else xml.tostring()


def rank_report(session: Session, run: Run) -> RankReport:
    """Compare every rank of ``run``: compile sequences, first differing graph/node, collectives.

    Graphs that differ only by FSDP's uneven shard shapes (NOTE: [Rank-dependent shard shapes])
    are no divergence: they are listed in ``shard_shapes`` (and ``notes``) and the ranks group
    together. Raises nothing for odd data: a run with one rank is trivially consistent (noted);
    ranks with no graphs at all compare by their compile records.
    """
    ranks = sorted(set(session.scalars(select(Rank.rank).where(Rank.run_id == run.id)))
                   | set(session.scalars(select(Graph.rank).where(Graph.run_id == run.id).distinct()))
                   | set(session.scalars(select(CompileEvent.rank).where(CompileEvent.run_id == run.id).distinct())))
    bare = _bare_ranks(session, run.id, ranks)
    read = compile_sequences(session, run.id, [r for r in ranks if r not in bare])
    sequences = {r: read.get(r, []) for r in ranks}
    report = RankReport(run_id=run.id, run=run.name, ranks=ranks, groups=[], sequences=sequences,
                        divergences=[], schedules={}, collective_mismatches=[])
    if len(ranks) < 2:
        report.notes.append(f"run has {len(ranks)} rank(s): nothing to compare")

    _neutralise_device_indices(session, sequences)
    differ_in_structure: set[frozenset] = set()  # hash pairs already compared, so not compared twice
    from graphdeck.analysis import mesh_ranks  # peers per mesh dimension (it reads this module's helpers)
    from graphdeck.analysis.layout import load_layout
    from graphdeck.analysis.shard_shapes import absorb_shard_shapes  # it reads this module's helpers

    layout = load_layout(session, run.id)  # None: every rank must run the same program (as before)
    if layout is not None:
        mesh_ranks.compare_compiles(session, report, layout, differ_in_structure)
    else:
        report.shard_shapes = absorb_shard_shapes(session, run.id, ranks, sequences, differ_in_structure)
        report.notes.extend(x.message for x in report.shard_shapes)
        by_sig: dict[tuple, list[int]] = defaultdict(list)
        for r in ranks:
            by_sig[tuple(e.signature() for e in sequences[r])].append(r)
        report.groups = sorted(by_sig.values(), key=lambda g: g[0])
        if report.groups:
            ref = report.groups[0]
            for group in report.groups[1:]:
                d = _first_divergence(session, sequences[ref[0]], sequences[group[0]], ref, group, ranks,
                                      differ_in_structure)
                if d is not None:
                    report.divergences.append(d)
    mesh_ranks.explain_divergences(session, report)

    shared: dict = {}  # target ids and collective nodes per stored hash, read once for every rank
    report.schedules = {r: [] if r in bare else collective_schedule(session, run.id, r, sequences[r], shared)
                        for r in ranks}
    report.collective_mismatches, schedule_notes, schedule_gaps = mesh_ranks.compare_schedules(session, report, layout)
    report.notes += schedule_notes
    from graphdeck.analysis.hangs import hang_section  # Flight Recorder + missing evidence

    report.flight, report.missing_evidence = hang_section(session, report)
    report.missing_evidence += schedule_gaps + mesh_ranks.layout_gaps(layout, ranks)
    from graphdeck.analysis.predicted import prediction_checks

    report.predictions = prediction_checks(session, report)
    _timing_findings(session, report)
    return report


def _bare_ranks(session: Session, run_id: int, ranks: list[int]) -> set[int]:
    """Ranks with nothing :func:`compile_sequence` or :func:`collective_schedule` reads — no
    graph, no compile record with a compile id, no DDP bucket, no comm-groups record (a rank
    known only by its Flight Recorder dump): both are empty for them, found here with four
    queries instead of several per rank (1,024 FR-only ranks: 3.3 -> 0.4 s CPU, bench_flight)."""
    from graphdeck.analysis.comm_map import EVENT_NAME as COMM_GROUPS

    busy = set(session.scalars(select(Graph.rank).where(Graph.run_id == run_id).distinct()))
    busy |= set(session.scalars(select(Partition.rank).where(Partition.run_id == run_id).distinct()))
    busy |= set(session.scalars(select(CompileEvent.rank).where(
        CompileEvent.run_id == run_id,
        CompileEvent.compile_id.is_not(None) | (CompileEvent.name == COMM_GROUPS)).distinct()))
    return set(ranks) - busy


def _timing_findings(session: Session, report: RankReport) -> None:
    """Compile skew (NOTE: [Compile skew]) and the traced straggler (NOTE: [CPU-side
    collectives], kernels alike) added to ``report.notes`` with their numbers; they do not change
    the verdict. Structured forms: :func:`graphdeck.analysis.compile_skew.compile_skew`,
    :func:`graphdeck.analysis.cpu_collectives.rank_timing`."""
    from graphdeck.analysis.compile_skew import compile_skew
    from graphdeck.analysis.trace_collectives import align_and_match, run_traces

    skew = compile_skew(session, session.get(Run, report.run_id))
    traces = run_traces(session, report.run_id)
    timing = align_and_match(session, report.run_id, traces=traces)["timing"] if len(traces) > 1 else {}
    report.notes += [text for text in (skew.finding, timing.get("message")) if text]


# NOTE: [Rank-local device indices]
# On a multi-GPU job each rank computes on its own device: rank 1's graphs say
# ``device(type='cuda', index=1)`` where rank 0's say ``index=0`` (``torch.arange(...,
# device=...)``, factory kwargs, tensor metadata), so their structural hashes differ though the
# graphs are the same program. Graphs whose hash is not shared by every rank are re-hashed from
# their stored nodes with device indices removed; only those graphs are read again.
_DEVICE_INDEX = re.compile(r"\b(cuda|xpu|hpu|npu|mtia|privateuseone):\d+")
_DEVICE_REPR_INDEX = re.compile(r"(device\(type='\w+'), index=\d+\)")


def _device_neutral(text: str | None) -> str:
    """``"cuda:1"`` → ``"cuda"``, ``device(type='cuda', index=1)`` → ``device(type='cuda')``."""
    return _DEVICE_REPR_INDEX.sub(r"\1)", _DEVICE_INDEX.sub(r"\1", text or ""))


def _device_neutral_hash(session: Session, graph_id: int) -> str:
    import hashlib

    h = hashlib.sha256()
    rows = session.execute(select(Node.op, Node.target_id, Node.shape_json, Node.dtype, Node.stride_json,
                                  Node.args_json).where(Node.graph_id == graph_id).order_by(Node.idx))
    for op, target_id, shape, dtype, stride, args in rows:
        h.update(f"{op}|{target_id if op != 'placeholder' else ''}|{shape}|{dtype}|{stride}|"
                 f"{_device_neutral(args)};".encode())
    return "dn:" + h.hexdigest()[:32]


def _neutralise_device_indices(session: Session, sequences: dict[int, list[CompileEntry]]) -> None:
    """Re-hash, device indices removed, the graphs whose hash some rank lacks (NOTE: [Rank-local
    device indices]); a graph equal up to its device index then compares equal."""
    if len(sequences) < 2:
        return
    holders: dict[str | None, set[int]] = defaultdict(set)
    for r, seq in sequences.items():
        for e in seq:
            for _k, h, _gid in e.graphs:
                holders[h].add(r)
    cache: dict[str, str] = {}  # one structural hash: the same nodes, re-hashed once

    def neutral(h: str | None, gid: int) -> str:
        if h is None:
            return _device_neutral_hash(session, gid)
        if h not in cache:
            cache[h] = _device_neutral_hash(session, gid)
        return cache[h]

    for seq in sequences.values():
        for e in seq:
            if any(len(holders[h]) < len(sequences) for _k, h, _gid in e.graphs):
                e.graphs = [(k, neutral(h, gid) if len(holders[h]) < len(sequences) else h, gid)
                            for k, h, gid in e.graphs]


def compile_sequence(session: Session, run_id: int, rank: int) -> list[CompileEntry]:
    """Every compile id of ``rank`` in order of first appearance, with its graphs and outcome."""
    return compile_sequences(session, run_id, [rank])[rank]


def compile_sequences(session: Session, run_id: int, ranks: list[int]) -> dict[int, list[CompileEntry]]:
    """:func:`compile_sequence` of each of ``ranks``, read with two queries for all of them (a
    1,024-rank run is not 2,048 round trips). Only compile records with a compile id are read, and
    only the metadata and payload the sequence uses (``compilation_metrics``'s, ``recompile_reasons``')."""
    from sqlalchemy import case

    want = set(ranks)
    graphs: dict[int, list] = defaultdict(list)
    events: dict[int, list] = defaultdict(list)
    rank_filter = Graph.rank.in_(ranks) if len(want) <= 500 else Graph.rank.is_not(None)
    for g in session.execute(
            select(Graph.rank, Graph.id, Graph.ordinal, Graph.kind, Graph.compile_id, Graph.structural_hash,
                   Graph.frame_name).where(Graph.run_id == run_id, rank_filter).order_by(Graph.rank, Graph.ordinal)):
        if g.rank in want:
            graphs[g.rank].append(g)
    ev_filter = CompileEvent.rank.in_(ranks) if len(want) <= 500 else CompileEvent.rank.is_not(None)
    for ev in session.execute(
            select(CompileEvent.rank, CompileEvent.id, CompileEvent.name, CompileEvent.compile_id,
                   case((CompileEvent.name == "compilation_metrics", CompileEvent.metadata_json),
                        else_=None).label("metadata_json"),
                   case((CompileEvent.name == "recompile_reasons", CompileEvent.payload), else_=None).label("payload"))
            .where(CompileEvent.run_id == run_id, CompileEvent.compile_id.is_not(None), ev_filter)
            .order_by(CompileEvent.rank, CompileEvent.id)):
        if ev.rank in want:
            events[ev.rank].append(ev)
    return {r: _sequence_of(graphs.get(r, []), events.get(r, [])) for r in ranks}


def _sequence_of(graphs: list, events: list) -> list[CompileEntry]:
    """One rank's compile sequence from its graph rows (by ordinal) and compile records (by id)."""
    entries: dict[str, CompileEntry] = {}
    order: list[tuple[int, int, str]] = []  # (source order, tie, compile id) — graphs by ordinal

    def entry(cid: str, pos: tuple[int, int]) -> CompileEntry:
        if cid not in entries:
            entries[cid] = CompileEntry(compile_id=cid, graphs=[])
            order.append((*pos, cid))
        return entries[cid]

    # Compile ids in log order: compile records first appear before their graphs in both capture
    # and import, but a store may hold graphs only; order by the earliest mention of either kind.
    first_event: dict[str, int] = {}
    for ev in events:
        if ev.compile_id is not None:
            first_event.setdefault(ev.compile_id, ev.id)
    for g in graphs:
        cid = g.compile_id or f"graph{g.ordinal}"
        e = entry(cid, (0, g.ordinal))
        e.graphs.append((g.kind, g.structural_hash, g.id))
        e.frame = e.frame or g.frame_name
    for ev in events:
        if ev.compile_id is None:
            continue
        e = entry(ev.compile_id, (1, ev.id))
        meta = _json(ev.metadata_json)
        # Records keep torch's envelope: {"compilation_metrics": {...fields}}; accept bare fields too.
        meta = meta.get(ev.name) if isinstance(meta.get(ev.name), dict) else meta
        if ev.name == "compilation_metrics":
            if meta.get("fail_type"):
                e.failed = f"{meta.get('fail_type')}: {meta.get('fail_reason') or ''}".strip().rstrip(":")
            e.frame = e.frame or meta.get("co_name")
            reasons = meta.get("recompile_reason")
            if reasons and not e.recompile_reason:
                e.recompile_reason = str(reasons)
        elif ev.name == "recompile_reasons" and not e.recompile_reason:
            payload = _json(ev.payload) if ev.payload else None
            e.recompile_reason = "; ".join(map(str, payload)) if isinstance(payload, list) else (ev.payload or None)
    return [entries[cid] for cid in sorted(entries, key=lambda c: _compile_order(c, first_event, entries))]


def _compile_order(cid: str, first_event: dict[str, int], entries: dict[str, CompileEntry]) -> tuple:
    """Sort key: frame id, then compile number, then attempt (``"[!]f/c[_a]"``, compiled autograd
    prefix kept), so ranks that logged records in a different interleaving still line up."""
    nums = [int(x) for x in re.findall(r"\d+", cid)]
    return (0 if nums else 1, nums, first_event.get(cid, 0), cid)


def _first_divergence(session: Session, ref_seq: list[CompileEntry], seq: list[CompileEntry],
                      ref_ranks: list[int], ranks: list[int], world: list[int] | None = None,
                      differ_in_structure: set[frozenset] = frozenset()) -> Divergence | None:
    n = min(len(ref_seq), len(seq))
    for i in range(n + 1):
        a = ref_seq[i] if i < len(ref_seq) else None
        b = seq[i] if i < len(seq) else None
        if a is not None and b is not None and a.signature() == b.signature():
            continue
        if a is None and b is None:
            return None
        base = Divergence(ranks=ranks, reference_ranks=ref_ranks, position=i, what="", message="")
        if a is None:
            base.what, base.compile_id = "extra compile", b.compile_id
            base.recompile_reason = b.recompile_reason
            base.message = (f"ranks {ranks} compile {len(seq) - len(ref_seq)} more time(s) than ranks {ref_ranks};"
                            f" first extra compile {b.compile_id}" + _fail_text(b))
            return base
        if b is None:
            base.what, base.compile_id = "missing compile", a.compile_id
            base.message = (f"ranks {ranks} stop after {len(seq)} compile(s); ranks {ref_ranks} go on with"
                            f" compile {a.compile_id}" + _fail_text(a))
            return base
        base.compile_id = b.compile_id
        base.recompile_reason = b.recompile_reason or a.recompile_reason
        if a.compile_id != b.compile_id:
            base.what = "compile sequence differs"
            base.message = f"compile #{i}: ranks {ref_ranks} compile {a.compile_id}, ranks {ranks} compile {b.compile_id}"
            return base
        if (a.failed is None) != (b.failed is None):
            base.what = "compile failed"
            who, other, fail = (ranks, ref_ranks, b.failed) if b.failed else (ref_ranks, ranks, a.failed)
            base.message = f"compile {a.compile_id} failed on ranks {who} ({fail}) but not on ranks {other}"
            return base
        base.what = "graph differs"
        a_graphs, b_graphs = a.graphs, b.graphs
        for j in range(max(len(a_graphs), len(b_graphs))):
            ga = a_graphs[j] if j < len(a_graphs) else None
            gb = b_graphs[j] if j < len(b_graphs) else None
            if ga is not None and gb is not None and ga[:2] == gb[:2]:
                continue
            if ga is None or gb is None or ga[0] != gb[0]:
                base.message = (f"compile {a.compile_id}: ranks {ref_ranks} produced graphs "
                                f"{[g[0] for g in a_graphs]}, ranks {ranks} produced {[g[0] for g in b_graphs]}")
                return base
            base.kind, base.reference_graph_id, base.graph_id = ga[0], ga[2], gb[2]
            from graphdeck.analysis.shard_shapes import shape_only_divergence

            if shape_only_divergence(session, base, a.compile_id, ga, gb, world or [*ref_ranks, *ranks],
                                     differ_in_structure):
                return base
            ref_node, node, change = first_node_difference(session, ga[2], gb[2])
            base.reference_node, base.node = ref_node, node
            at = ""
            if change is not None:
                shown = node or ref_node
                where = {"added": f" only on ranks {ranks}", "removed": f" only on ranks {ref_ranks}",
                         "changed": ""}[change]
                at = (f"; first differing node{where}: {shown.name} ({shown.target}"
                      f"{' ' + shown.shape if shown.shape else ''})"
                      f"{' in ' + shown.module_path if shown.module_path else ''}"
                      f"{' at ' + shown.source if shown.source else ''}")
                if change == "changed" and ref_node.shape != node.shape:
                    at += f"; shape {ref_node.shape} on ranks {ref_ranks} vs {node.shape} on ranks {ranks}"
            base.message = f"compile {a.compile_id}: {ga[0]} graph differs{at}"
            return base
        base.message = f"compile {a.compile_id} differs"
        return base
    return None


def _fail_text(e: CompileEntry) -> str:
    out = f" (failed: {e.failed})" if e.failed else ""
    if e.recompile_reason:
        out += f" (recompile reason: {e.recompile_reason})"
    return out


def _node_rows(session: Session, graph_id: int) -> list:
    target = aliased(InternedString)
    module = aliased(InternedString)
    stack = aliased(InternedString)
    return session.execute(
        select(Node.idx, Node.name, Node.op, target.value, Node.shape_json, Node.dtype, Node.stride_json,
               module.value, stack.value, Node.args_json)
        .join(target, target.id == Node.target_id)
        .outerjoin(module, module.id == Node.module_path_id)
        .outerjoin(stack, stack.id == Node.stack_trace_id)
        .where(Node.graph_id == graph_id).order_by(Node.idx)).all()


def _node_key(row) -> tuple:
    # Placeholder targets are input names, not structure; everything else is compared as stored.
    return (row[2], "" if row[2] == "placeholder" else row[3], row[4], row[5], row[6])


def first_node_difference(session: Session, graph_a: int, graph_b: int
                          ) -> tuple[NodeRef | None, NodeRef | None, str | None]:
    """The first place (graph order) where two graphs' node lists differ, aligned as sequences of
    (op, target, shape, dtype, stride, arguments with node names replaced) with :mod:`difflib`, so
    one inserted node does not make every later node "differ". Returns ``(node of a, node of b,
    change)`` with change ``"added"`` (only in b; node of a is None), ``"removed"`` (only in a) or
    ``"changed"``; ``(None, None, None)`` when the lists agree."""
    rows_a, rows_b = _node_rows(session, graph_a), _node_rows(session, graph_b)
    keys_a = [(*_node_key(r), _args_shape(r)) for r in rows_a]
    keys_b = [(*_node_key(r), _args_shape(r)) for r in rows_b]
    # Equal prefix and suffix first (linear); align only the middle, whose size is what differs.
    # SequenceMatcher is quadratic on graphs of repeated layers, so a middle past
    # ALIGN_LIMIT nodes is reported as changed at its first node without alignment.
    lo = 0
    while lo < len(keys_a) and lo < len(keys_b) and keys_a[lo] == keys_b[lo]:
        lo += 1
    hi_a, hi_b = len(keys_a), len(keys_b)
    while hi_a > lo and hi_b > lo and keys_a[hi_a - 1] == keys_b[hi_b - 1]:
        hi_a, hi_b = hi_a - 1, hi_b - 1
    if lo == hi_a and lo == hi_b:
        return None, None, None
    if lo == hi_a:
        return None, _ref(graph_b, rows_b[lo]), "added"
    if lo == hi_b:
        return _ref(graph_a, rows_a[lo]), None, "removed"
    if max(hi_a, hi_b) - lo > ALIGN_LIMIT:
        return _ref(graph_a, rows_a[lo]), _ref(graph_b, rows_b[lo]), "changed"
    matcher = difflib.SequenceMatcher(None, keys_a[lo:hi_a], keys_b[lo:hi_b], autojunk=False)
    for tag, i1, _i2, j1, _j2 in matcher.get_opcodes():
        i1, j1 = i1 + lo, j1 + lo
        if tag == "equal":
            continue
        if tag == "insert":
            return None, _ref(graph_b, rows_b[j1]), "added"
        if tag == "delete":
            return _ref(graph_a, rows_a[i1]), None, "removed"
        return _ref(graph_a, rows_a[i1]), _ref(graph_b, rows_b[j1]), "changed"
    return None, None, None


def _args_shape(row, at: int = 9) -> str:
    """Arguments (``row[at]``) with node names replaced by their position, so renamed nodes
    compare equal."""
    return re.sub(r'\{"node": "[^"]*"\}', "N", row[at] or "")


def _ref(graph_id: int, row) -> NodeRef:
    shape = row[4]
    return NodeRef(graph_id=graph_id, idx=row[0], name=row[1], op=row[2], target=row[3],
                   shape=shape, dtype=row[5], module_path=row[7], source=source_line(row[8]))


def source_line(stack_trace: str | None) -> str | None:
    """``file:line in fn`` of the innermost frame of an FX ``stack_trace`` (user code), or None."""
    fr = frames(stack_trace)
    if not fr:
        return None
    path, line, fn = fr[-1]
    return f"{path}:{line} in {fn}" if fn else f"{path}:{line}"


def collective_kind(target: str) -> str | None:
    """``all_reduce`` for ``_c10d_functional.all_reduce.default`` and friends; None otherwise."""
    if not any(ns in target for ns in _COLLECTIVE_NAMESPACES):
        return None
    m = _COLLECTIVE_RE.search(target)
    return m.group(1) if m else None


@functools.lru_cache(maxsize=4096)
def group_of(args_json: str | None) -> str | None:
    """The process group of a collective call: its last string argument (``group_name``), or a
    ``ProcessGroup``/rank-list repr."""
    payload = _json(args_json)
    args = payload.get("args", []) if isinstance(payload, dict) else []
    kwargs = payload.get("kwargs", {}) if isinstance(payload, dict) else {}
    for key in ("group_name", "group", "tag"):
        if isinstance(kwargs.get(key), (str, int)):
            return str(kwargs[key])
    for a in reversed(args):
        if isinstance(a, str):
            return a
        if isinstance(a, dict) and "repr" in a and "ProcessGroup" in a["repr"]:
            return re.sub(r" at 0x[0-9a-f]+", "", a["repr"])
    return None


def collective_target_ids(session: Session) -> dict[int, str]:
    """Interned-string id → collective kind, for every stored op target that is a collective."""
    rows = session.execute(select(InternedString.id, InternedString.value).where(
        InternedString.value.like("%c10d%") | InternedString.value.like("%distributed%")
        | InternedString.value.like("%funcol%") | InternedString.value.like("%functional_collectives%")))
    out = {}
    for sid, value in rows:
        if len(value) < 200 and "\n" not in value:
            kind = collective_kind(value)
            if kind is not None:
                out[sid] = kind
    return out


def collective_schedule(session: Session, run_id: int, rank: int,
                        sequence: list[CompileEntry] | None = None, cache: dict | None = None) -> list[Collective]:
    """Collectives ``rank`` issues, in compile order then graph order (see :data:`EXECUTED_TIERS`),
    then Inductor's imported schedules for compiles without graphs, then the data-parallel
    collectives: DDP's reducer buckets and FSDP2's groups as the capture recorded them (else
    DDPOptimizer's graph buckets, for stores without that record). ``cache``: a dict shared by
    the calls of one report (the collective target ids; each stored structural hash's collective
    nodes, read once for all ranks)."""
    sequence = sequence if sequence is not None else compile_sequence(session, run_id, rank)
    out: list[Collective] = []
    stack = aliased(InternedString)
    # One query per rank: only nodes whose interned target names a collective (a few string ids),
    # so the cost does not grow with the number of ordinary nodes.
    cache = {} if cache is None else cache
    if "target_ids" not in cache:
        _fill_schedule_cache(session, run_id, cache)
    target_ids, stored_hash, cached_rows = cache["target_ids"], cache["stored_hash"], cache["rows"]
    inductor = cache["inductor"].get(rank, {})
    chosen: list[tuple[CompileEntry, list[int]]] = []
    # The stored hash (a report's sequences may hold neutralised ones: graphs equal up to a device
    # index or a process group name, whose collectives still differ in those).
    hash_of = {gid: stored_hash.get(gid) or h for entry in sequence for _k, h, gid in entry.graphs}
    from graphdeck.analysis.predicted import live_compiles  # NOTE: [Live compiles]

    for entry in live_compiles(session, run_id, rank, sequence, {cid for cid, p in inductor.items() if p})[0]:
        graph_ids: list[int] = []
        for tier in EXECUTED_TIERS:
            graph_ids = [gid for kind, _h, gid in entry.graphs if kind in tier]
            if graph_ids:
                break
        chosen.append((entry, graph_ids))
    by_graph: dict[int, list] = defaultdict(list)
    # Graphs with one structural hash issue the same collectives: read one representative each
    # (all ranks of a healthy run share hashes, so this reads each distinct graph once per rank).
    rep_of: dict[int, int] = {}
    first_with_hash: dict[str, int] = {}
    for _e, ids in chosen:
        for gid in ids:
            h = hash_of.get(gid)
            rep_of[gid] = first_with_hash.setdefault(h, gid) if h else gid
    for rep in set(rep_of.values()):
        if stored_hash.get(rep) in cached_rows:
            by_graph[rep] = cached_rows[stored_hash[rep]]
    reps = sorted(set(rep_of.values()) - set(by_graph))
    if target_ids and reps:
        for chunk_start in range(0, len(reps), 500):
            chunk = reps[chunk_start:chunk_start + 500]
            for row in session.execute(
                    select(Node.graph_id, Node.idx, Node.name, Node.target_id, Node.shape_json, Node.dtype,
                           Node.size_bytes, Node.args_json, stack.value)
                    .outerjoin(stack, stack.id == Node.stack_trace_id)
                    .where(Node.graph_id.in_(chunk), Node.op == "call_function",
                           Node.target_id.in_(list(target_ids)))):
                by_graph[row.graph_id].append(row)
        for rows in by_graph.values():
            rows.sort(key=lambda r: r.idx)
        for rep in reps:
            if stored_hash.get(rep):
                cached_rows[stored_hash[rep]] = by_graph.get(rep, [])
    for entry, graph_ids in chosen:
        from_graph = [
            Collective(index=0, kind=target_ids[row.target_id], group=group_of(row.args_json),
                       size_bytes=row.size_bytes, shape=row.shape_json, dtype=row.dtype, source="graph",
                       compile_id=entry.compile_id, graph_id=gid, node=row.name, line=source_line(row[8]))
            for gid in graph_ids for row in by_graph.get(rep_of.get(gid, gid), ())]
        ops = _json(inductor.get(entry.compile_id)) if inductor.get(entry.compile_id) else None
        if isinstance(ops, list) and ops:
            # Inductor's schedule is the order its generated code issues collectives (it may
            # reorder the graph's); each op takes size and group from the first unused graph node
            # of the same kind, when the graph was stored.
            pool = list(from_graph)
            for op in ops:
                kind = collective_kind(str(op))
                if kind is None:  # wait_tensor and other non-collectives
                    continue
                match = next((c for c in pool if c.kind == kind.rstrip("_")), None)
                if match is not None:
                    pool.remove(match)
                    match.source = "inductor_collective_schedule"
                    out.append(match)
                else:
                    out.append(Collective(index=0, kind=kind.rstrip("_"), group=None, size_bytes=None, shape=None,
                                          dtype=None, source="inductor_collective_schedule",
                                          compile_id=entry.compile_id))
        else:
            out.extend(from_graph)
    record = cache["records"].get(rank) or {}
    if record.get("ddp") or record.get("fsdp"):
        out += _recorded_collectives(record)
    else:  # no record of the reducer (an older capture): DDPOptimizer's graph buckets stand in
        replaced = {gid for e in sequence for _k, _h, gid in e.graphs} - {gid for e, _ids in chosen
                                                                           for _k, _h, gid in e.graphs}
        for p in cache["partitions"].get(rank, []):
            if p.parent_graph_id in replaced:  # a graph a recompile replaced: its buckets do not run
                continue
            out.append(Collective(index=len(out), kind="all_reduce", group="ddp", size_bytes=p.size_bytes,
                                  shape=None, dtype=None, source="ddp_bucket", graph_id=p.graph_id,
                                  node=f"DDPOptimizer split {p.index} ({len(_json(p.params_json) or [])} params; "
                                       "stands in for the reducer's bucket)"))
    for i, c in enumerate(out):
        c.index = i
    return out


def _fill_schedule_cache(session: Session, run_id: int, cache: dict) -> None:
    """What :func:`collective_schedule` reads per rank, read once for every rank of the run: the
    collective target ids, each graph's stored hash, Inductor's imported collective schedules,
    the newest readable ``graphdeck_comm_groups`` record of each rank (as
    :func:`graphdeck.analysis.comm_map.load_record` reads it) and DDPOptimizer's partitions."""
    from graphdeck.analysis.comm_map import EVENT_NAME as COMM_GROUPS

    cache["target_ids"] = collective_target_ids(session)
    cache["stored_hash"] = dict(session.execute(select(Graph.id, Graph.structural_hash)
                                                .where(Graph.run_id == run_id)).all())
    cache["rows"] = {}  # stored structural hash -> collective node rows (same hash: same nodes)
    cache["inductor"] = defaultdict(dict)
    cache["records"] = {}
    for rank, name, cid, payload in session.execute(
            select(CompileEvent.rank, CompileEvent.name, CompileEvent.compile_id, CompileEvent.payload)
            .where(CompileEvent.run_id == run_id,
                   CompileEvent.name.in_(["inductor_collective_schedule", COMM_GROUPS]))
            .order_by(CompileEvent.id)):
        if name == COMM_GROUPS:  # the newest row wins, readable or not (load_record's rule)
            data = _json(payload)
            cache["records"][rank] = data if isinstance(data, dict) and payload else None
        else:
            cache["inductor"][rank][cid] = payload
    cache["partitions"] = defaultdict(list)
    for p in session.scalars(select(Partition).where(Partition.run_id == run_id)
                             .order_by(Partition.rank, Partition.parent_graph_id, Partition.index)):
        cache["partitions"][p.rank].append(p)


def frame_of(compile_id: str | None) -> str | None:
    """The frame a compile id belongs to: ``"1"`` for ``"1/0"``, ``"1/2_1"``; ``"!0:1"`` for
    compiled autograd's ``"!0/1/0"``; None for a compile without an id."""
    if not compile_id or "/" not in compile_id:
        return None
    return compile_id.rsplit("/", 1)[0]


def steady_state(sequence: list[CompileEntry], scheduled: frozenset[str] | set[str] = frozenset()
                 ) -> list[CompileEntry]:
    """The compiles whose graphs run in steady state (NOTE: [Recompiles replace graphs]): per
    frame, its latest compile that did not fail and has graphs (or, in ``scheduled``, an imported
    Inductor collective schedule), at the place of the frame's first compile."""
    latest: dict[str, CompileEntry] = {}
    for e in sequence:
        f = frame_of(e.compile_id)
        if f is not None and e.failed is None and (e.graphs or e.compile_id in scheduled):
            latest[f] = e
    return at_first_compile(sequence, {f: [e] for f, e in latest.items()})


def at_first_compile(sequence: list, chosen: dict[str, list]) -> list:
    """``sequence`` with each frame's compiles replaced by ``chosen[frame]`` at the place of the
    frame's first compile (a frame not in ``chosen`` left out; entries without a frame id kept)."""
    out, seen = [], set()
    for e in sequence:
        f = frame_of(e.compile_id)
        if f is None:
            out.append(e)
        elif f not in seen and f in chosen:
            seen.add(f)
            out.extend(chosen[f])
    return out


# NOTE: [Recompiles replace graphs]
# (Which older compiles still run — replaced, live, or uncertain — is NOTE: [Live compiles] in
# analysis/predicted.py; the rule below is its default when a recompile supersedes a graph.)
# A frame compiled again on a rank (compile ids F/0, F/1, ...) runs the graph of its latest
# compile from then on; the earlier graph is not run again (a guard that fails once keeps failing
# for the inputs of the steady state), so it does not add collectives. The predicted schedule
# takes each frame's latest compile that produced graphs (a failed compile ran nothing), in the
# order of the frames' first compiles; each predicted collective names its compile id, so the
# report says which compile a segment comes from. A rank that recompiled into a graph with the
# same collectives agrees with the ranks that did not; one whose new graph lacks a collective is
# a predicted hang at that collective.


def schedule_segments(schedule: list[Collective]) -> list[dict]:
    """Consecutive runs of one source: ``{"compile_id", "source", "first", "count"}``."""
    out: list[dict] = []
    for c in schedule:
        key = (c.compile_id, c.source if c.compile_id is None else "graph")
        if out and (out[-1]["compile_id"], out[-1]["_key"]) == key:
            out[-1]["count"] += 1
            continue
        out.append({"compile_id": c.compile_id, "source": c.source, "_key": key[1], "first": c.index, "count": 1})
    for seg in out:
        seg.pop("_key")
    return out


def _recorded_collectives(record: dict) -> list[Collective]:
    """The data-parallel collectives of one training step from the capture's record of DDP's
    reducer buckets and FSDP2's groups (NOTE: [Communication groups]): each DDP bucket's
    all-reduce in bucket order; each FSDP2 group's all-gather in forward order, then its
    reduce-scatter in reverse (backward) order."""
    out: list[Collective] = []
    for ddp in record.get("ddp") or []:
        for b in ddp.get("buckets") or []:
            out.append(Collective(index=0, kind="all_reduce", group="ddp", size_bytes=b.get("size_bytes"), shape=None,
                                  dtype=None, source="ddp_bucket",
                                  node=f"DDP reducer bucket {b.get('index')} ({len(b.get('params') or [])} params)"))
    groups = record.get("fsdp") or []
    for kind, ordered in (("all_gather", groups), ("reduce_scatter", groups[::-1])):
        for g in ordered:
            out.append(Collective(index=0, kind=kind, group="fsdp", size_bytes=g.get("all_gather_bytes"), shape=None,
                                  dtype=None, source="fsdp_group",
                                  node=f"FSDP2 group {g.get('module') or '(root)'} ({len(g.get('params') or [])} params)"))
    return out


def _schedule_mismatch(schedules: dict[int, list[Collective]]) -> CollectiveMismatch | None:
    if len(schedules) < 2:
        return None
    longest = max(len(s) for s in schedules.values())
    for i in range(longest):
        variants: dict[tuple | None, list[int]] = defaultdict(list)
        for r, sch in schedules.items():
            variants[sch[i].signature() if i < len(sch) else None].append(r)
        if len(variants) == 1:
            continue
        ordered = sorted(variants.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        described = []
        for sig, rs in ordered:
            c = schedules[rs[0]][i] if sig is not None else None
            described.append({"ranks": sorted(rs), "collective": asdict(c) if c else None})
        text = "; ".join(
            f"ranks {d['ranks']}: " + (Collective(**d['collective']).describe() if d["collective"] else "no collective (schedule ended)")
            for d in described)
        return CollectiveMismatch(index=i, variants=described,
                                  message=f"collective #{i} differs by rank — {text}; the job would hang here")
    return None


def _json(text: str | None):
    if not text:
        return {}
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return {}
