"""Cross-rank checks per mesh dimension: which ranks must agree, and on what (issue 20, item 3).

The mesh side of :func:`graphdeck.analysis.ranks.core.rank_report`. Without a parallel layout record
(NOTE: [Parallel layout]) every rank must run the same program and ``rank_report`` compares all
of them with each other, as before. With one:

# NOTE: [Peers per mesh dimension]
# * Compile sequences are compared only among ``program_peers`` (ranks of the same pipeline
#   stage). Ranks of different stages run different programs by design: a difference between
#   them is never a divergence; the report says so in a note.
# * Within a stage, ranks at different coordinates of a sharding dimension (TP peers) hold
#   differently sharded tensors. A graph that is the same program with other shapes is a note
#   when the DTensor placements explain it: every differing input that is a parameter has the
#   local shapes its placements give each rank (``RunLayout.explains_shape``) and at least one
#   does; a shape that reaches a collective stays a divergence. Replica peers (same coordinate
#   on every sharding dimension) must agree exactly (up to FSDP's uneven last shard, NOTE:
#   [Rank-dependent shard shapes]). TP peers whose graphs differ only in scalar constants that
#   are offsets of their coordinate times a recorded shard size (a vocab-parallel loss's vocab
#   offset) are a note too (NOTE: [Per-rank constants] in ranks/constants.py).
# * Collective schedules are compared per process group, among the group's members only: a
#   group named in a layout record (a mesh dimension's group) by its recorded members; FSDP2's
#   recorded reduce-scatters/all-gathers over the FSDP2 groups' shard dimension; DDP buckets and
#   groups the layout does not name among program peers.
# * A rank without a layout record is an evidence gap (INCOMPLETE, never "agree"): its stage and
#   coordinates are read from the other ranks' meshes where they place it, else it is compared
#   with nobody.
#
# Independent of the layout: a rank that wrote no record of its DDP buckets / FSDP2 groups while
# others did (it died before the capture wrote it) has unknown data-parallel collectives, not
# none: those are left out of the comparison and named as missing evidence. And a divergence
# whose first differing node is a parameter read on one side only names the parameters and, for
# an FSDP2 group, the consequence (NOTE: [Wrapper words] in gradients/mesh.py).

Pure: reads the store, fills the report.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import (
    Collective,
    CollectiveMismatch,
    CompileEntry,
    RankReport,
    _first_divergence,
    _schedule_mismatch,
)
from graphdeck.analysis.ranks.records import _ranks_text, _sets_text  # noqa: F401 (importable from here as before)
from graphdeck.store.schema import Node

if TYPE_CHECKING:
    from graphdeck.analysis.parallel.layout import RunLayout

RECORDED_SOURCES = ("ddp_bucket", "fsdp_group")


# ---------------------------------------------------------------- compile sequences


def compare_compiles(session: Session, report: RankReport, layout: RunLayout,
                     differ_in_structure: set[frozenset], keys=None) -> None:
    """Group ranks by compile sequence and find divergences among program peers only (NOTE:
    [Peers per mesh dimension]); fills ``report.groups``, ``divergences``, ``shard_shapes`` and
    ``notes``. ``keys``: the report's node cache (:class:`~graphdeck.analysis.ranks.core.NodeKeys`)."""
    from graphdeck.analysis.ranks.shard_shapes import absorb_shard_shapes

    present = set(report.ranks)
    sets = [[r for r in peers if r in present] for peers in layout.program_peers()]
    placed = {r for s in sets for r in s}
    sets = [s for s in sets if s] + [[r] for r in report.ranks if r not in placed]
    sets.sort(key=lambda s: s[0])
    sequences = report.sequences
    _neutralise_group_names(session, sequences, layout, sets, keys)
    for peers in sets:
        if len(peers) > 1:
            found = absorb_shard_shapes(session, report.run_id, peers, sequences, differ_in_structure)
            report.shard_shapes += found
            report.notes += [x.message for x in found]
        by_sig: dict[tuple, list[int]] = defaultdict(list)
        for r in peers:
            by_sig[tuple(e.signature() for e in sequences[r])].append(r)
        groups = sorted(by_sig.values(), key=lambda g: g[0])
        ref = groups[0]
        merged = [list(ref)]
        for group in groups[1:]:
            if _compare_group(session, report, layout, ref, group, peers, differ_in_structure):
                merged[0] += group  # TP peers whose shapes the placements explain: one program
            else:
                merged.append(group)
        report.groups += [sorted(g) for g in merged]
    report.groups.sort(key=lambda g: g[0])
    report.notes += _peer_notes(report, layout, sets)


# NOTE: [Process group names in graphs]
# A functional collective names its process group in the graph (``all_reduce(x, "sum", "3")``).
# Ranks of different groups of one mesh dimension (tp group [0, 1] is "3", tp group [2, 3] is
# "4") run the same program with another name there, so their graphs' structural hashes
# differ. Among program peers, a graph whose hash some peer lacks is re-hashed from its nodes
# with each group name the layout records replaced by its mesh dimension (and device indices
# removed, NOTE: [Rank-local device indices]); graphs equal up to the group of a dimension then
# compare equal.
_JSON_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _neutralise_group_names(session: Session, sequences: dict[int, list[CompileEntry]], layout: RunLayout,
                            sets: list[list[int]], keys=None) -> None:
    """``keys``: the report's :class:`~graphdeck.analysis.ranks.core.NodeKeys` (one is made when None)."""
    from graphdeck.analysis.ranks.core import NodeKeys

    dims = _group_dims(layout)
    if not dims:
        return
    keys = keys or NodeKeys(session)
    # Graphs of one structural hash have the same nodes and arguments: re-hash one of each (the
    # result depends on the nodes only, so it is kept across peer sets).
    cache: dict[str, str] = {}
    for peers in sets:
        if len(peers) < 2:
            continue
        holders: dict[str | None, set[int]] = defaultdict(set)
        for r in peers:
            for e in sequences[r]:
                for _k, h, _gid in e.graphs:
                    holders[h].add(r)
        lacking = {h for h, rs in holders.items() if len(rs) < len(peers)}
        if not lacking:
            continue
        todo: dict = {}  # one graph per hash to re-hash (every graph without a hash)
        for r in peers:
            for e in sequences[r]:
                for _k, h, gid in e.graphs:
                    if h in lacking and (h is None or h not in cache):
                        todo.setdefault(h if h is not None else ("graph", gid), gid)
        keys.read(todo.values())

        def neutral(h: str | None, gid: int) -> str:
            if h is None:
                return _group_neutral_hash(session, gid, dims, keys)
            if h not in cache:
                cache[h] = _group_neutral_hash(session, gid, dims, keys)
            return cache[h]

        for r in peers:
            for e in sequences[r]:
                if any(h in lacking for _k, h, _gid in e.graphs):
                    e.graphs = [(k, neutral(h, gid) if h in lacking else h, gid) for k, h, gid in e.graphs]


def _group_dims(layout: RunLayout) -> dict[str, str]:
    """Process group name → ``"@<mesh dims>:<dim>"``, from every record's mesh dimension groups."""
    out: dict[str, str] = {}
    for rec in layout.records.values():
        for m in rec.get("meshes") or []:
            if not isinstance(m, dict):
                continue
            for g in m.get("dim_groups") or []:
                if isinstance(g, dict) and g.get("name") and g.get("dim"):
                    out.setdefault(str(g["name"]), f"@{','.join(map(str, m.get('dim_names') or []))}:{g['dim']}")
    return out


def _group_neutral_hash(session: Session, graph_id: int, dims: dict[str, str], keys=None) -> str:
    import hashlib

    from graphdeck.analysis.ranks.core import NodeKeys

    def sub(m: re.Match) -> str:
        return f'"{dims[m.group(1)]}"' if m.group(1) in dims else m.group(0)

    keys = keys or NodeKeys(session)
    # Arguments repeat across the graphs of a run (the same program in other groups): each
    # distinct one is substituted once per name table.
    memo = keys.memo.setdefault(("group names", id(dims)), {})
    h = hashlib.sha256()
    for op, target, shape, dtype, stride, args in keys[graph_id]:
        if args not in memo:
            memo[args] = _JSON_STRING.sub(sub, args)
        h.update(f"{op}|{target}|{shape}|{dtype}|{stride}|{memo[args]};".encode())
    return "mn:" + h.hexdigest()[:32]


def _compare_group(session: Session, report: RankReport, layout: RunLayout, ref: list[int], group: list[int],
                   peers: list[int], differ_in_structure: set[frozenset]) -> bool:
    """Compare ``group`` with the reference ``ref`` (both program peers). Appends a divergence,
    or a note for each compile whose shapes the placements explain. True when nothing but
    explained shapes differs."""
    seq_ref, seq = report.sequences[ref[0]], report.sequences[group[0]]
    tp = _sharding_coords(layout, ref[0]) != _sharding_coords(layout, group[0])
    offset = 0
    while True:
        d = _first_divergence(session, seq_ref[offset:], seq[offset:], ref, group, peers, differ_in_structure)
        if d is None:
            return True
        d.position += offset
        if tp and d.what == "shapes differ":
            why = _explained(session, layout, seq_ref[d.position], seq[d.position], ref[0], group[0])
            if why:
                report.notes.append(_tp_note(layout, d, group, ref, "holding differently sharded tensors; their "
                                             "graphs are the same program with local shapes the placements explain",
                                             why))
                offset = d.position + 1
                continue
        if tp and d.what == "graph differs":  # NOTE: [Per-rank constants]
            from graphdeck.analysis.ranks.constants import explain_constants

            why = explain_constants(session, layout, seq_ref[d.position], seq[d.position], ref[0], group[0])
            if why:
                report.notes.append(_tp_note(layout, d, group, ref, "whose graphs differ only in per-rank constants "
                                             "their mesh coordinate explains", why))
                offset = d.position + 1
                continue
        if not tp and d.what in ("shapes differ", "collective shapes differ"):
            d.message += ("; these ranks are replicas (the same coordinate on every sharding mesh dimension): they "
                          "must agree on shapes exactly")
        report.divergences.append(d)
        return False


def _tp_note(layout, d, group: list[int], ref: list[int], what: str, why: str) -> str:
    """The note for tensor-parallel peers whose graphs differ as ``what`` says, for reason ``why``."""
    dims = ", ".join(f"{k}={v}" for k, v in _sharding_coords(layout, group[0]).items())
    return (f"compile {d.compile_id}: ranks {_ranks_text(group)} ({dims}) and ranks {_ranks_text(ref)} are "
            f"tensor-parallel peers {what} ({why}) — a note, not a divergence")


def _sharding_coords(layout: RunLayout, rank: int) -> dict[str, int]:
    c = layout.coord(rank)
    return {d: c.get(d) for d in layout.sharding_dims()}


def _explained(session: Session, layout: RunLayout, a: CompileEntry, b: CompileEntry, rank_a: int,
               rank_b: int) -> str | None:
    """Why compile ``a`` (rank ``rank_a``'s) and ``b`` differ only as the placements imply —
    ``"w1.weight [16, 32] vs [15, 32]"`` — or None when they do not (NOTE: [Peers per mesh
    dimension])."""
    from graphdeck.analysis.ranks.shard_shapes import _collective_touched, shape_only_difference

    if [g[0] for g in a.graphs] != [g[0] for g in b.graphs]:
        return None
    explained: list[str] = []
    for ga, gb in zip(a.graphs, b.graphs):
        if ga[1] == gb[1]:
            continue
        got = shape_only_difference(session, [ga[2], gb[2]]) or _sizes_only_difference(session, ga[2], gb[2])
        if got is None:
            return None
        rows, diffs = got
        if any(_collective_touched(r, diffs) for r in rows):
            return None
        fqn_of = dict(session.execute(select(Node.idx, Node.param_fqn).where(
            Node.graph_id == ga[2], Node.op == "placeholder", Node.param_fqn.is_not(None))).all())
        for d in diffs:
            row = rows[0][d.position]
            fqn = fqn_of.get(row[0]) if row[2] == "placeholder" else None
            if fqn is None:
                continue  # an activation or saved tensor: follows from the sharded parameters
            if not layout.explains_shape(fqn, rank_a, rank_b) or not all(
                    _same_shape(shape, (layout.param(fqn, r) or {}).get("local_shape"))
                    for shape, r in ((d.shapes[0], rank_a), (d.shapes[1], rank_b))):
                return None  # the records do not explain it, or the graph holds another shape than recorded
            text = f"{fqn} {d.shapes[0]} vs {d.shapes[1]}"
            if text not in explained and len(explained) < 3:
                explained.append(text)
    return ", ".join(explained) or None


_INT_LIST = re.compile(r"\[(?:-?\d+(?:, )?)+\]")


def _sizes_only_difference(session: Session, graph_a: int, graph_b: int) -> tuple[list[list], list] | None:
    """Like :func:`~graphdeck.analysis.ranks.shard_shapes.shape_only_difference` for two graphs, but
    integer lists in the arguments (the sizes a backward's ``expand``/``view`` spells out) may
    differ too; None when the graphs differ otherwise."""
    from graphdeck.analysis.ranks.core import _args_shape, _device_neutral, _node_rows
    from graphdeck.analysis.ranks.shard_shapes import ShapeDiff

    rows_a, rows_b = _node_rows(session, graph_a), _node_rows(session, graph_b)
    if len(rows_a) != len(rows_b):
        return None
    diffs = []
    for i, (a, b) in enumerate(zip(rows_a, rows_b)):
        key = [(r[2], "" if r[2] == "placeholder" else r[3], r[5], r[7],
                _INT_LIST.sub("[S]", _device_neutral(_args_shape(r)))) for r in (a, b)]
        if key[0] != key[1]:
            return None
        if (a[4], a[6], a[9]) != (b[4], b[6], b[9]):
            diffs.append(ShapeDiff(position=i, shapes=[a[4], b[4]], strides=[a[6], b[6]]))
    return [rows_a, rows_b], diffs


def _same_shape(shape_json: str | None, recorded) -> bool:
    from graphdeck.analysis.ranks.shard_shapes import tensor_shapes

    got = tensor_shapes(shape_json)
    return isinstance(recorded, list) and len(got) == 1 and got[0] is not None and list(got[0]) == list(recorded)


def _peer_notes(report: RankReport, layout: RunLayout, sets: list[list[int]]) -> list[str]:
    """Which peer sets were compared; stages that differ by design."""
    notes = []
    if layout.has_pipeline():
        named = []
        for s in sets:
            stage = layout.stage_of(s[0])
            named.append(f"stage {stage}: {_ranks_text(s)}" if stage is not None
                         else f"rank {s[0]} (stage unknown): compared with nobody")
        notes.append("parallel layout: compile sequences compared among ranks that must run the same program — "
                     + "; ".join(named[:8]) + (f"; ... ({len(named)} sets)" if len(named) > 8 else ""))
        by_stage: dict[int, tuple] = {}
        for s in sets:
            stage = layout.stage_of(s[0])
            if stage is not None:
                by_stage[stage] = tuple(e.signature()[1:] for e in report.sequences[s[0]])
        if len(set(by_stage.values())) > 1:
            notes.append(f"stages run different programs by design: the {len(by_stage)} pipeline stages' compiled "
                         "graphs differ and are not compared with each other (no divergence)")
    else:
        notes.append(f"parallel layout: no pipeline stages, every rank must run the same program: "
                     f"{_sets_text(sets)}")
    dims = layout.sharding_dims()
    if dims:
        notes.append(f"replicas (same stage, same coordinate on {', '.join(dims)}) must agree exactly: "
                     f"{_sets_text(layout.replica_peers())}; tensor-parallel peers may differ by the shard shapes "
                     "their placements imply")
    return notes


def layout_gaps(layout: RunLayout | None, ranks: list[int]) -> list[str]:
    """Missing-evidence lines for ranks of the run without a parallel layout record."""
    if layout is None:
        return []
    present = set(ranks)
    missing = [r for r in layout.missing_ranks if r in present]
    absent = [r for r in layout.missing_ranks if r not in present]
    out = []
    if missing:
        out.append(f"rank(s) {_ranks_text(missing)}: no parallel layout record — their stage and mesh coordinates "
                   "are inferred from the other ranks' meshes where those place them, else they are compared with "
                   "nobody")
    if absent:
        out.append(f"rank(s) {_ranks_text(absent)}: nothing in the store (no layout record, no graphs)")
    return out


# ---------------------------------------------------------------- collective schedules


def comparable_schedules(session: Session, report: RankReport) -> tuple[dict[int, list[Collective]], list[str]]:
    """The schedules to compare: a rank without a record of its DDP buckets / FSDP2 groups while
    others have one has unknown data-parallel collectives, so the recorded ones are left out of
    every rank's schedule (with a missing-evidence line). Returns ``(schedules, gaps)``."""
    from graphdeck.analysis.traces.comm_map import load_record

    has = {r: any(c.source in RECORDED_SOURCES for c in sch) for r, sch in report.schedules.items()}
    if not any(has.values()) or all(has.values()):
        return report.schedules, []
    lacking = [r for r, h in has.items() if not h and not (load_record(session, report.run_id, r) or {})]
    if not lacking:
        return report.schedules, []
    out = {r: [c for c in sch if c.source not in RECORDED_SOURCES] for r, sch in report.schedules.items()}
    gap = (f"rank(s) {_ranks_text(sorted(lacking))}: no record of their DDP buckets / FSDP2 groups (the rank ended "
           "before the capture wrote it), so their data-parallel collectives are unknown and were not compared")
    return out, [gap]


def compare_schedules(session: Session, report: RankReport, layout: RunLayout | None
                      ) -> tuple[list[CollectiveMismatch], list[str], list[str]]:
    """Collective schedules compared per process group among its members (NOTE: [Peers per mesh
    dimension]); without a layout, all ranks' whole schedules, as before. ``report.schedules``
    loses the recorded data-parallel collectives when :func:`comparable_schedules` says so.
    Returns ``(mismatches, notes, gaps)``."""
    schedules, gaps = comparable_schedules(session, report)
    report.schedules = schedules  # what is shown is what was compared (and what predictions read)
    if layout is None:
        m = _schedule_mismatch(schedules)
        return ([m] if m else []), [], gaps
    members = _named_groups(layout)
    present = set(schedules)
    by_key: dict[str, dict[int, list[Collective]]] = defaultdict(lambda: defaultdict(list))
    for r, sch in schedules.items():
        for c in sch:
            by_key[_key(c)][r].append(c)
    out: list[CollectiveMismatch] = []
    compared: list[str] = []
    for key in sorted(by_key):
        sets = _member_sets(layout, key, members)
        n_sets = 0
        for ranks in sets:
            ranks = [r for r in ranks if r in present]
            if len(ranks) < 2:
                continue
            n_sets += 1
            sub = {r: by_key[key].get(r, []) for r in ranks}
            m = _schedule_mismatch(sub)
            if m is None:
                continue
            first = next((v for v in m.variants if v["collective"]), None)
            m.index = first["collective"]["index"] if first else m.index  # position in the rank's whole schedule
            m.message = f"process group {key} (ranks {_ranks_text(ranks)}): its " + m.message
            out.append(m)
        if n_sets:
            compared.append(f"{key} ({n_sets} group{'s' if n_sets > 1 else ''})")
    notes = ["collective schedules compared per process group, among its members only: " + ", ".join(compared)] \
        if compared else []
    return out, notes, gaps


def _key(c: Collective) -> str:
    if c.source == "fsdp_group":
        return "fsdp"
    if c.source == "ddp_bucket":
        return "ddp"
    return c.group or "(unnamed group)"


def _named_groups(layout: RunLayout) -> dict[str, list[int]]:
    """Process group name → its member ranks, from every record's mesh dimension groups."""
    out: dict[str, list[int]] = {}
    for rec in layout.records.values():
        for m in rec.get("meshes") or []:
            for g in (m.get("dim_groups") or []) if isinstance(m, dict) else []:
                if isinstance(g, dict) and g.get("name") and isinstance(g.get("ranks"), list):
                    out.setdefault(str(g["name"]), sorted(int(x) for x in g["ranks"]))
    return out


def _member_sets(layout: RunLayout, key: str, named: dict[str, list[int]]) -> list[list[int]]:
    if key in named:
        return [named[key]]
    if key == "fsdp":
        dims = [d for rec in layout.records.values() for g in rec.get("fsdp_groups") or []
                if isinstance(g, dict) for d in (g.get("mesh_dims") or [])[-1:]]
        if dims:
            return layout.dim_groups(str(dims[0]))
    return layout.program_peers()


# ---------------------------------------------------------------- divergences in words


def explain_divergences(session: Session, report: RankReport) -> None:
    """A divergence whose graphs read different parameters: name the parameters read on one side
    only, the branch that decides it, and (FSDP2) the consequence (NOTE: [Wrapper words])."""
    from graphdeck.analysis.gradients.cuts import enclosing_branch

    wrap = None
    for d in report.divergences:
        if d.reference_graph_id is None or d.graph_id is None:
            continue
        a, b = _params_read(session, d.reference_graph_id), _params_read(session, d.graph_id)
        for ranks, others, fqns, stacks in ((d.ranks, d.reference_ranks, sorted(set(b) - set(a)), b),
                                            (d.reference_ranks, d.ranks, sorted(set(a) - set(b)), a)):
            if not fqns:
                continue
            d.message += f"; only the graph of ranks {_ranks_text(ranks)} reads {', '.join(fqns)}"
            branch = next((x for x in (enclosing_branch(stacks[f]) for f in fqns if stacks[f]) if x), None)
            if branch:
                d.message += f" (the use depends on the branch at {branch})"
            if wrap is None:
                from graphdeck.analysis.gradients.mesh import wrapping

                wrap = wrapping(session, report.run_id)
            if wrap.fsdp2:
                from graphdeck.analysis.gradients.mesh import fsdp2_consequence

                d.message += "; " + fsdp2_consequence(", ".join(fqns), others, wrap.group_of(fqns[0]))


def _params_read(session: Session, graph_id: int) -> dict[str, str | None]:
    """Parameter fqn → the stack trace of the first node that reads it, in graph ``graph_id``."""
    from graphdeck.store.schema import InternedString

    rows = session.execute(select(Node.idx, Node.name, Node.param_fqn, Node.args_json, InternedString.value)
                           .outerjoin(InternedString, InternedString.id == Node.stack_trace_id)
                           .where(Node.graph_id == graph_id).order_by(Node.idx)).all()
    names = {r.name: r.param_fqn for r in rows if r.param_fqn}
    out: dict[str, str | None] = {f: None for f in names.values()}
    for r in rows:
        if not r.args_json:
            continue
        for name, fqn in names.items():
            if out[fqn] is None and f'"node": "{name}"' in r.args_json:
                out[fqn] = r.value
    return out
