"""Rank-dependent shapes in graphs that are otherwise the same program: FSDP's uneven shards.

The shape side of :func:`graphdeck.analysis.ranks.core.rank_report`: compare rank graphs with shapes
removed (:func:`shape_only_difference`); tell whether the dim-0 sizes the ranks see are one
tensor split the way FSDP splits it (:func:`shard_split`, :func:`classify`, pure); absorb such
graphs into one group with a :class:`ShardShapes` note (:func:`absorb_shard_shapes`), and word
the divergence for any other shape-only difference (:func:`shape_only_divergence`).

# NOTE: [Rank-dependent shard shapes]
# FSDP2 (``fully_shard``) shards every parameter on dim 0 with ``torch.chunk`` semantics: with
# ``S`` shards of a tensor of ``N`` rows, shard ``i`` has ``min(c, max(0, N - i * c))`` rows,
# ``c = ceil(N / S)`` (every shard gets ``c`` rows but the last ones, which get the remainder,
# possibly 0: FSDP2 pads ``torch.chunk``'s missing chunks with empty ones). A graph that reads the
# local shards — a compiled optimizer step, a compiled gradient clip — is then the same program
# on every rank with different shapes: GPT-2's 50,257-row embedding over 2 ranks is 25,129 rows
# on rank 0 and 25,128 on rank 1. That is expected and is no divergence.
#
# The rule, for one graph whose ranks' node lists are equal with shapes removed (ops, targets,
# argument topology, dtypes, module paths): every tensor whose shape differs between ranks
# differs only in dim 0, and for one shard-group size ``S`` dividing the world size ``W``, rank
# ``r`` holds shard ``r mod S`` of ``N`` rows (``N`` the sum of ranks 0..S-1's sizes). ``S = W``
# is plain FSDP over all ranks; ``S < W`` is HSDP (a 2-D mesh replicate x shard, shard dim
# innermost, as ``init_device_mesh`` lays it out). ``W`` is the number of ranks the store holds,
# so a store with only some ranks of a job is not recognised. Shapes whose per-rank sizes do not
# fit, a difference outside dim 0, or equal shapes with different strides are "same program,
# different shapes": a divergence. And a shape-only difference that reaches a collective (its
# input or its output) stays a divergence whatever the sizes: a collective whose size differs
# by rank corrupts data or hangs. The rule cannot tell a parameter shard from any other
# ``torch.chunk``-shaped split (a batch of 9 rows over 2 ranks); both are one program on
# rank-local sizes with no collective of rank-dependent size, so both are fine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

# ranks/core.py imports this module inside its functions, so these names exist by then.
from graphdeck.analysis.ranks.core import (
    CompileEntry,
    Divergence,
    _args_shape,
    _device_neutral,
    _json,
    _node_rows,
    _ref,
    collective_kind,
)
from graphdeck.store.schema import Node, Param

Shape = tuple[int, ...]


def tensor_shapes(shape_json: str | None) -> list[Shape | None]:
    """The shapes of a node's output tensors, flattened: ``"[19, 16]"`` → ``[(19, 16)]``,
    ``"[[19, 16], [16]]"`` (a ``_foreach_*`` list) → ``[(19, 16), (16,)]``; a scalar ``"[]"`` →
    ``[()]``; ``None`` or unparsable text → ``[]``; a non-tensor entry (``null``) → ``None``."""
    if not shape_json:
        return []
    try:
        value = json.loads(shape_json)
    except (TypeError, ValueError):
        return []
    out: list[Shape | None] = []

    def walk(v) -> None:
        if isinstance(v, list) and all(isinstance(d, int) for d in v):
            out.append(tuple(v))
        elif isinstance(v, list):
            for item in v:
                walk(item)
        else:
            out.append(None)

    walk(value)
    return out


def chunk_sizes(rows: int, shards: int) -> list[int]:
    """Dim-0 sizes of the ``shards`` shards of a tensor of ``rows`` rows under ``torch.chunk``,
    padded with empty shards as FSDP2 does: ``chunk_sizes(50257, 2) == [25129, 25128]``,
    ``chunk_sizes(9, 4) == [3, 3, 3, 0]``."""
    c = -(-rows // shards)
    return [min(c, max(0, rows - i * c)) for i in range(shards)]


def shard_split(sizes: list[int]) -> tuple[int, int] | None:
    """``(N, S)`` when ``sizes[r]`` (rank ``r``'s dim-0 size, one entry per rank of the world) is
    shard ``r mod S`` of ``N`` rows split into ``S`` shards (NOTE: [Rank-dependent shard
    shapes]), the largest such ``S`` (``S >= 2``, dividing ``len(sizes)``); None otherwise.
    ``shard_split([25129, 25128]) == (50257, 2)``; ``shard_split([4, 5])`` is None (rank 0
    would hold the larger shard)."""
    world = len(sizes)
    for shards in range(world, 1, -1):
        if world % shards:
            continue
        rows = sum(sizes[:shards])
        expect = chunk_sizes(rows, shards)
        if all(sizes[r] == expect[r % shards] for r in range(world)):
            return rows, shards
    return None


@dataclass
class ShapeDiff:
    """One node whose output shapes differ by rank in graphs that are otherwise equal."""

    position: int  # index in the node list (the same on every rank)
    shapes: list[str | None]  # per rank (index = position in the ranks list), as stored
    strides: list[str | None]


@dataclass
class ShardVerdict:
    """How a shape-only difference between ranks reads (see :func:`classify`)."""

    shard: bool  # every differing shape is an uneven FSDP split (NOTE: [Rank-dependent shard shapes])
    reason: str  # why not, when not; "" when it is
    rows: int | None = None  # N of the first differing tensor
    shards: int | None = None  # S


def classify(diffs: list[ShapeDiff]) -> ShardVerdict:
    """Whether every differing tensor of ``diffs`` differs only in dim 0, in a split consistent
    with one shard-group size for the whole graph (NOTE: [Rank-dependent shard shapes])."""
    first: tuple[int, int] | None = None
    shards: int | None = None
    for d in diffs:
        per_rank = [tensor_shapes(s) for s in d.shapes]
        if len({len(p) for p in per_rank}) != 1:
            return ShardVerdict(False, "a node outputs a different number of tensors by rank")
        if len(set(d.shapes)) == 1:
            return ShardVerdict(False, "equal shapes with different strides (a layout difference)")
        for tensors in zip(*per_rank):
            if len(set(tensors)) == 1:
                continue
            if any(t is None or len(t) == 0 for t in tensors) or len({t[1:] for t in tensors}) != 1:
                return ShardVerdict(False, "a shape differs outside dim 0")
            split = shard_split([t[0] for t in tensors])
            if split is None:
                return ShardVerdict(False, "dim-0 sizes " + "/".join(str(t[0]) for t in tensors)
                                    + " are not an even-then-remainder split of one size")
            if shards is not None and split[1] != shards:
                return ShardVerdict(False, "tensors are split over different numbers of shards")
            shards = split[1]
            first = first or split
    if first is None:
        return ShardVerdict(False, "no shape differs")
    return ShardVerdict(True, "", rows=first[0], shards=first[1])


@dataclass
class ShardShapes:
    """A graph whose ranks differ only by FSDP's uneven shard shapes (NOTE: [Rank-dependent shard
    shapes]): informational, the ranks still agree. ``variants`` gives the example node's shape
    per group of ranks: ``[{"ranks": [0], "shape": "[25129, 768]", "graph_id": 18}, ...]``."""

    compile_id: str
    kind: str
    node: str  # the example: the first differing input (the shard itself), else the first node
    param: str | None  # the parameter it shards, when the store can name it
    rows: int  # N: dim 0 of the unsharded tensor (of the example)
    shards: int  # S: shards per shard group (the world size under plain FSDP)
    differing_nodes: int
    variants: list[dict]
    message: str


def shape_only_difference(session: Session, graph_ids: list[int]) -> tuple[list[list], list[ShapeDiff]] | None:
    """Compare graphs with shapes and strides removed (op, target, dtype, module path, arguments
    with node names by position and device indices removed). Returns ``(node rows per
    graph, differing nodes)`` when their node lists are equal without shapes — each
    :class:`ShapeDiff` lists the node's shape and stride per
    graph, in ``graph_ids`` order — and None when the graphs differ in structure."""
    # First without joins (interned ids compare as their strings do), so graphs that differ in
    # structure — the common case here — cost one light read each.
    light = [session.execute(select(Node.op, Node.target_id, Node.dtype, Node.module_path_id, Node.args_json,
                                    Node.shape_json, Node.stride_json)
                             .where(Node.graph_id == gid).order_by(Node.idx)).all() for gid in graph_ids]
    if len({len(r) for r in light}) != 1:
        return None
    diffs: list[ShapeDiff] = []
    for i, nodes in enumerate(zip(*light)):
        if len({n[:5] for n in nodes}) != 1 and len(  # equal as stored, or equal once normalised
                {(n[0], "" if n[0] == "placeholder" else n[1], n[2], n[3], _device_neutral(_args_shape(n, 4)))
                 for n in nodes}) != 1:
            return None
        if len({(n[5], n[6]) for n in nodes}) != 1:
            diffs.append(ShapeDiff(position=i, shapes=[n[5] for n in nodes], strides=[n[6] for n in nodes]))
    return [_node_rows(session, gid) for gid in graph_ids] if diffs else [], diffs


def _collective_touched(rows: list, diffs: list[ShapeDiff]) -> str | None:
    """The first collective of ``rows`` (one graph's nodes) whose output or an input has a
    rank-dependent shape: ``"all_reduce at all_reduce (its input mul)"``; None if none."""
    changed = {d.position for d in diffs}
    names = {rows[i][1]: i for i in changed}
    for i, row in enumerate(rows):
        kind = collective_kind(row[3] or "") if row[2] == "call_function" else None
        if kind is None:
            continue
        inputs = [n for n in re.findall(r'\{"node": "([^"]*)"\}', row[9] or "") if n in names]
        if inputs:
            return f"{kind} at {row[1]} (its input {inputs[0]})"
        if i in changed:
            return f"{kind} at {row[1]} (its output)"
    return None


def _example(diffs: list[ShapeDiff], rows: list) -> ShapeDiff:
    """The first differing input (a placeholder: the shard itself), else the first node."""
    return next((d for d in diffs if rows[d.position][2] == "placeholder"), diffs[0])


_OPT_PARAM = re.compile(r"param_groups_?(\d+)_+params_+(\d+)")


def _param_of(session: Session, run_id: int, rank: int, graph_id: int, row, full_shape: list[int]) -> str | None:
    """The parameter a sharded input holds: the node's bound ``param_fqn``; else the parameter of
    the unsharded shape ``full_shape`` — disambiguated, for a compiled optimizer's input, by its
    index in ``param_groups[0]`` (``...param_groups_0__params___3`` → the 4th parameter the
    agent recorded, the order of ``model.parameters()``); None when that does not name one."""
    fqn, desc = session.execute(select(Node.param_fqn, Node.desc)
                                .where(Node.graph_id == graph_id, Node.idx == row[0])).one()
    if fqn:
        return fqn
    params = session.execute(select(Param.fqn, Param.shape_json).where(Param.run_id == run_id, Param.rank == rank)
                             .order_by(Param.id)).all()
    fits = [i for i, (_f, shape) in enumerate(params) if _json(shape) == full_shape]
    m = _OPT_PARAM.search(f"{desc or ''} {row[1]} {row[3]}")
    if m and m.group(1) == "0" and int(m.group(2)) in fits:
        return params[int(m.group(2))][0]
    return params[fits[0]][0] if len(fits) == 1 else None


def absorb_shard_shapes(session: Session, run_id: int, ranks: list[int], sequences: dict[int, list[CompileEntry]],
                         differ_in_structure: set[frozenset]) -> list[ShardShapes]:
    """Find graphs that every rank compiled and that differ only by FSDP's uneven shard shapes
    (NOTE: [Rank-dependent shard shapes]); give their ranks one hash, so they group together, and
    return one :class:`ShardShapes` per such graph. Other shape-only differences are left for
    :func:`~graphdeck.analysis.ranks.core.rank_report` to report; pairs of hashes found to differ in structure are added
    to ``differ_in_structure``."""
    if len(ranks) < 2:
        return []
    by_cid = {r: {e.compile_id: e for e in sequences[r]} for r in ranks}
    found: list[ShardShapes] = []
    for first in sequences[ranks[0]]:
        entries = [by_cid[r].get(first.compile_id) for r in ranks]
        if any(e is None or e.failed for e in entries) or len({tuple(g[0] for g in e.graphs) for e in entries}) != 1:
            continue
        for j, (kind, _h, _g) in enumerate(first.graphs):
            hashes = [e.graphs[j][1] for e in entries]
            if len(set(hashes)) == 1:
                continue
            reps = list(dict.fromkeys(hashes))  # distinct hashes, in rank order
            rep_gid = {h: next(e.graphs[j][2] for e in entries if e.graphs[j][1] == h) for h in reps}
            got = shape_only_difference(session, [rep_gid[h] for h in reps])
            if got is None and len(reps) == 2:
                differ_in_structure.add(frozenset(reps))
            if got is None or not got[1]:
                continue
            rows, diffs = got
            per_rank = [ShapeDiff(d.position, [d.shapes[reps.index(h)] for h in hashes],
                                  [d.strides[reps.index(h)] for h in hashes]) for d in diffs]
            verdict = classify(per_rank)
            if not verdict.shard or any(_collective_touched(r, diffs) for r in rows):
                continue
            for e in entries:
                e.graphs[j] = (kind, f"shard:{hashes[0]}", e.graphs[j][2])
            found.append(_shard_note(session, run_id, ranks, first.compile_id, kind, hashes, reps, rep_gid,
                                     rows, diffs))
    return found


def _shard_note(session: Session, run_id: int, ranks: list[int], compile_id: str, kind: str, hashes: list,
                reps: list, rep_gid: dict, rows: list, diffs: list[ShapeDiff]) -> ShardShapes:
    ex = _example(diffs, rows[0])
    row = rows[0][ex.position]
    shapes = [tensor_shapes(ex.shapes[reps.index(h)]) for h in hashes]
    which = next(i for i in range(len(shapes[0])) if len({s[i] for s in shapes}) > 1)
    rows_n, shards = shard_split([s[which][0] for s in shapes])
    full = [rows_n, *shapes[0][which][1:]]
    param = _param_of(session, run_id, ranks[0], rep_gid[hashes[0]], row, full)
    variants = [{"ranks": [r for r, h2 in zip(ranks, hashes) if h2 == h], "shape": ex.shapes[i],
                 "graph_id": rep_gid[h]} for i, h in enumerate(reps)]
    named = f"{param} ({row[1]})" if param else row[1]
    per = ", ".join(f"{v['shape']} on rank{'s' if len(v['ranks']) > 1 else ''} "
                    f"{','.join(map(str, v['ranks']))}" for v in variants)
    message = (f"rank-dependent shard shapes (uneven FSDP split) in compile {compile_id} {kind}: {named} is {per}"
               f" ({rows_n} rows over {shards} shards); {len(diffs)} node(s) differ only in dim 0 and no"
               " collective reads them — the same program, not a divergence")
    return ShardShapes(compile_id=compile_id, kind=kind, node=row[1], param=param, rows=rows_n, shards=shards,
                       differing_nodes=len(diffs), variants=variants, message=message)


def shape_only_divergence(session: Session, base: Divergence, compile_id: str, ga: tuple, gb: tuple,
                           world: list[int], differ_in_structure: set[frozenset] = frozenset()) -> bool:
    """Fill ``base`` when graphs ``ga`` and ``gb`` (``(kind, hash, graph id)``, of the reference
    ranks and the diverging ranks) differ only in shapes: "collective shapes differ" when a
    differing shape reaches a collective, else "shapes differ" (same program, different shapes;
    with why it is no uneven FSDP split when the two groups are the whole ``world``). False when
    their structure differs (known when the hash pair is in ``differ_in_structure``)."""
    if frozenset((ga[1], gb[1])) in differ_in_structure:
        return False
    got = shape_only_difference(session, [ga[2], gb[2]])
    if got is None or not got[1]:
        return False
    rows, diffs = got
    first = diffs[0]
    base.reference_node, base.node = _ref(ga[2], rows[0][first.position]), _ref(gb[2], rows[1][first.position])
    shapes = (f"{base.node.name} ({base.node.target}): shape {first.shapes[0]} on ranks {base.reference_ranks}"
              f" vs {first.shapes[1]} on ranks {base.ranks}")
    if first.shapes[0] == first.shapes[1]:
        shapes += f" (stride {first.strides[0]} vs {first.strides[1]})"
    where = f" in {base.node.module_path}" if base.node.module_path else ""
    where += f" at {base.node.source}" if base.node.source else ""
    touched = next((t for t in (_collective_touched(r, diffs) for r in rows) if t), None)
    if touched:
        base.what = "collective shapes differ"
        base.message = (f"compile {compile_id}: {ga[0]} graph is the same program with rank-dependent shapes that"
                        f" reach a collective ({touched}): a collective whose size differs by rank corrupts data"
                        f" or hangs; first differing node {shapes}{where}")
    else:
        reason = ""
        if sorted([*base.reference_ranks, *base.ranks]) == sorted(world):
            side = [0 if r in base.reference_ranks else 1 for r in sorted(world)]
            reason = classify([ShapeDiff(d.position, [d.shapes[i] for i in side], [d.strides[i] for i in side])
                               for d in diffs]).reason
        base.what = "shapes differ"
        base.message = (f"compile {compile_id}: {ga[0]} graph is the same program, different shapes"
                        f" ({len(diffs)} node(s)); first differing node {shapes}{where}"
                        + (f"; not an uneven FSDP split: {reason}" if reason else ""))
    return True
