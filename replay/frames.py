"""Replay frames: the kernels of one step in time order, each with the graph node it computes.

A replay plays a step back at ``step_interval_ms`` per frame: frame ``i`` is the i-th GPU kernel
of the step by start time; the cursor sits at its start and the graph view lights up its node
(``<g id="node-<idx>">`` in the graph SVG). ``highlight_ops`` (names or regular expressions)
marks the frames whose kernel name, launching operator or node name matches, so a replay can
stop on them or draw them out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.trace_analysis import TraceData
from graphdeck.errors import UsageError
from graphdeck.store.schema import Node

#: A replay never has more frames than this (the first kernels of the step are kept).
MAX_FRAMES = 20_000


def compile_patterns(highlight_ops) -> list[re.Pattern]:
    """``["mm", "attn.*"]`` → compiled patterns (``re.search``); a plain name matches as a
    substring too. Raises UsageError for an invalid expression."""
    out = []
    for text in highlight_ops or ():
        try:
            out.append(re.compile(str(text)))
        except re.error as exc:
            raise UsageError(f"highlight pattern {text!r} is not a regular expression: {exc}") from exc
    return out


@dataclass
class ReplayFrames:
    """``frames``: dicts with ``t_ms`` (start, ms since ``origin_ns``), ``dur_ms``, ``kernel``,
    ``op`` (launching operator), ``stream`` (``pid/tid``), ``graph_id``, ``node``, ``node_idx``
    (its position in the graph: the SVG id is ``node-<idx>``), ``highlight``. ``steps``: the
    step numbers in the trace; ``step``: the one replayed (None: the whole trace)."""

    trace_id: int
    step: int | None
    steps: list[int]
    origin_ns: int
    end_ms: float
    frames: list[dict] = field(default_factory=list)
    truncated: bool = False

    def as_dict(self) -> dict:
        return {"trace_id": self.trace_id, "step": self.step, "steps": self.steps, "origin_ns": str(self.origin_ns),
                "end_ms": self.end_ms, "frames": self.frames, "truncated": self.truncated,
                "graphs": sorted({f["graph_id"] for f in self.frames if f["graph_id"] is not None})}


def replay_frames(session: Session, trace_id: int, *, step: int | None = None,
                  highlight_ops=None, data: TraceData | None = None) -> ReplayFrames:
    """The frames of step ``step`` (``ProfilerStep#<step>``; default the first step, or the whole
    trace when it has no step ranges). Raises UsageError for a step the trace does not have."""
    patterns = compile_patterns(highlight_ops)
    data = data or TraceData(session, trace_id)
    steps = data.steps()
    numbers = [int(s.name.split("#", 1)[1]) for s in steps]
    chosen = None
    if steps:
        if step is None:
            chosen = steps[0]
        elif step in numbers:
            chosen = steps[numbers.index(step)]
        else:
            raise UsageError(f"trace {trace_id} has no step {step}; it has {numbers}")
    kernels = sorted(data.kernels_of_step(chosen), key=lambda k: (k.ts, k.id))
    truncated = len(kernels) > MAX_FRAMES
    kernels = kernels[:MAX_FRAMES]
    origin = chosen.ts if chosen is not None else min((k.ts for k in kernels), default=0)
    if kernels:
        origin = min(origin, kernels[0].ts)
    mapping = data.mapping
    idx_of: dict[tuple[int, str], int] = {}
    graph_ids = {g for g, _ in mapping.by_kernel.values()}
    if graph_ids:
        for gid, name, idx in session.execute(select(Node.graph_id, Node.name, Node.idx).where(Node.graph_id.in_(graph_ids))):
            idx_of[(gid, name)] = idx
    frames = []
    for k in kernels:
        link = data.links.get(k.id)
        op = link.op.name if link is not None and link.op is not None else None
        got = mapping.by_kernel.get(k.id)
        gid, node = (got[0], got[1][0]) if got else (None, None)
        texts = [k.name, op or "", node or ""]
        frames.append({
            "t_ms": round((k.ts - origin) / 1e6, 6), "dur_ms": round(k.dur / 1e6, 6), "kernel": k.name, "op": op,
            "stream": f"{k.pid}/{k.tid}", "graph_id": gid, "node": node,
            "node_idx": idx_of.get((gid, node)) if gid is not None else None,
            "highlight": any(p.search(t) for p in patterns for t in texts),
        })
    end_ms = max((f["t_ms"] + f["dur_ms"] for f in frames), default=0.0)
    return ReplayFrames(trace_id, int(chosen.name.split("#", 1)[1]) if chosen is not None else None, numbers,
                        origin, round(end_ms, 6), frames, truncated)
