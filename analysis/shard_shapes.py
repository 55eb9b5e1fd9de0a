"""Rank-dependent shapes in graphs that are otherwise the same program: FSDP's uneven shards.

Pure helpers for :mod:`graphdeck.analysis.ranks` (no store access): parse stored shapes, tell
whether the dim-0 sizes that ranks see are one tensor split the way FSDP splits it, and classify
a shape-only difference between ranks.

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
from dataclasses import dataclass

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
