"""The records :mod:`graphdeck.analysis.ranks.core` compares and reports: a rank's compiles
(:class:`CompileEntry`), the nodes it names (:class:`NodeRef`), where ranks differ
(:class:`Divergence`), the collectives a rank issues (:class:`Collective`) and the first
position where their schedules disagree (:class:`CollectiveMismatch`).

Plain data, no store access; importable from :mod:`graphdeck.analysis.ranks.core` as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


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
    args: str | None = None  # its arguments as a call reads them: ``where, 1024`` (constants shown)


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
    # analysis.ranks.hangs; such a divergence is a warning, not a failure
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
        where = (f" at {self.node}" + (f" (graph {self.graph_id})" if self.graph_id is not None else "")
                 if self.node else "")
        return ", ".join(parts) + where


@dataclass
class CollectiveMismatch:
    """First position where the ranks' collective schedules disagree: a predicted hang."""

    index: int
    variants: list[dict]  # [{"ranks": [...], "collective": Collective | None}]
    message: str


def _json(text: str | None):
    if not text:
        return {}
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return {}


def _ranks_text(ranks, limit: int = 8, brackets: bool = True) -> str:
    """Rank numbers, sorted: up to 8 spelled out (``[0, 1, 2, 3]``), more as range text, runs of
    three or more as ``a-b``: ``[0-24, 26, 28-63]``. More than ``limit`` pieces are shortened:
    ``[0, 2, 4, 6, ... 1022] (512 ranks)``. ``brackets=False`` leaves the brackets off (``0-24, 26-63``)."""
    rs = sorted(set(ranks))
    i = len(rs) if len(rs) <= 8 else 0
    pieces = [str(r) for r in rs] if len(rs) <= 8 else []
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        pieces += [f"{rs[i]}-{rs[j]}"] if j - i >= 2 else [str(x) for x in rs[i:j + 1]]
        i = j + 1
    body, tail = ", ".join(pieces), ""
    if len(pieces) > limit:
        body, tail = f"{', '.join(pieces[:limit // 2])}, ... {pieces[-1]}", f" ({len(rs)} ranks)"
    return (f"[{body}]" if brackets else body) + tail


def _ranks_phrase(ranks, world=None) -> str:
    """``rank 3``, ``ranks [0-24, 26-63]``, or — given ``world`` (every rank of the run) —
    ``all 64 ranks`` / ``all ranks but 25`` when that is shorter."""
    rs = sorted(set(ranks))
    if world is not None:
        every = sorted(set(world))
        rest = [r for r in every if r not in set(rs)]
        if not rest and len(rs) > 1:
            return f"all {len(rs)} ranks"
        if rest and set(rs) <= set(every) and len(rest) < len(rs) and len(rest) <= 8:
            return f"all ranks but {_ranks_text(rest, brackets=False)}"
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {_ranks_text(rs)}"


def _sets_text(sets: list[list[int]], limit: int = 8) -> str:
    """Rank sets as range text, ``" | "``-separated; more than ``limit`` sets shortened."""
    shown = " | ".join(_ranks_text(s) for s in sets[:limit])
    return shown + (f" | ... ({len(sets)} sets)" if len(sets) > limit else "")
