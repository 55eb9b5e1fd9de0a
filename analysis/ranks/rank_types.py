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
        where = f" at {self.node} (graph {self.graph_id})" if self.node else ""
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
