"""Replay frames: the kernels of one step in time order, each with the graph node it computes.

A replay plays a step back at ``step_interval_ms`` per frame: frame ``i`` is the i-th GPU kernel
of the step by start time — or, in a trace without GPU kernels, the i-th ATen op / C++ kernel
run inside a compiled region (NOTE: [CPU trace mapping] in ``analysis/traces/cpu_mapping.py``;
``source`` says which); the cursor sits at its start and the graph view lights up its node
(``<g id="node-<idx>">`` in the graph SVG). ``highlight_ops`` marks the frames whose kernel
name, launching operator, node name or node op matches, so a replay can stop on them or draw
them out. A highlight is matched, first that applies (``highlights[i]["how"]`` says which):
an op family a user types (``matmul``/``MatMul`` → ``mm``, ``addmm``, ``bmm``... see
:data:`OP_FAMILIES`, case-insensitive), an ATen op name (``Addmm`` = ``aten::addmm``,
case-insensitive), else a regular expression (``re.search``, case-sensitive, then
case-insensitive). A highlight no frame matches is a warning (``warnings``), never silence.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import TraceData
from graphdeck.errors import UsageError
from graphdeck.store.schema import InternedString, Node

#: A replay never has more frames than this (the first kernels of the step are kept).
MAX_FRAMES = 20_000


#: Op families people type → the ATen op names (``aten::<name>``) they stand for.
OP_FAMILIES: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "addbmm"),
    "linear": ("addmm", "mm", "linear", "_addmm_activation"),
    "gemm": ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation"),
    "attention": ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "scaled_dot_product_attention", "_flash_attention_forward", "_efficient_attention_forward"),
    "softmax": ("_softmax", "softmax", "_log_softmax", "log_softmax", "_softmax_backward_data",
                "_log_softmax_backward_data"),
    "layernorm": ("native_layer_norm", "layer_norm", "native_layer_norm_backward"),
    "conv": ("convolution", "_convolution", "conv2d", "conv1d", "mkldnn_convolution", "convolution_backward"),
    "embedding": ("embedding", "embedding_dense_backward"),
    "gelu": ("gelu", "gelu_backward"),
}
OP_FAMILIES["sdpa"] = OP_FAMILIES["attention"]
OP_FAMILIES["layer_norm"] = OP_FAMILIES["layernorm"]
OP_FAMILIES["convolution"] = OP_FAMILIES["conv"]


def _op_of(text: str) -> str:
    """``aten::addmm`` / ``aten.addmm.default`` → ``addmm``; other names unchanged (lower case)."""
    t = text.lower()
    if t.startswith("aten::"):
        return t[6:]
    if t.startswith("aten."):
        return t.split(".")[1]
    return t


class Highlight:
    """One ``highlight_ops`` entry: ``matches(texts, ops)`` → bool; ``how`` says how it matched."""

    def __init__(self, text: str):
        self.text = text
        key = re.sub(r"[^a-z0-9_]", "", text.lower())
        self.family = OP_FAMILIES.get(key) or OP_FAMILIES.get(key.replace("_", ""))
        self.op = _op_of(text)
        try:
            self.regex = re.compile(text)
            self.iregex = re.compile(text, re.IGNORECASE)
        except re.error as exc:
            raise UsageError(f"highlight pattern {text!r} is not a regular expression: {exc}") from exc
        self.hits: dict[str, Counter] = {}

    def matches(self, texts: list[str], ops: set[str]) -> bool:
        """``texts``: kernel / op / node names of a frame; ``ops``: its ATen op names (lower case,
        no namespace; a fused C++ kernel's name parts count too)."""
        if self.family and ops & set(self.family):
            return self._hit(f"op family {self.text!r} (aten::{', '.join(self.family[:3])}...)",
                             ", ".join(sorted(ops & set(self.family))))
        if self.op in ops:
            return self._hit("op name", self.op)
        for how, rx in (("regular expression", self.regex), ("regular expression, ignoring case", self.iregex)):
            for t in texts:
                if t and rx.search(t):
                    return self._hit(how, t)
        return False

    def _hit(self, how: str, what: str) -> bool:
        self.hits.setdefault(how, Counter())[what] += 1
        return True

    def report(self) -> dict:
        frames = sum(sum(c.values()) for c in self.hits.values())
        hows = sorted(self.hits, key=lambda h: -sum(self.hits[h].values()))
        how = "; ".join(f"{h}: {', '.join(n for n, _ in self.hits[h].most_common(6))}" for h in hows)
        if self.family and not frames:
            how = f"op family {', '.join(self.family)}"
        return {"pattern": self.text, "frames": frames, "how": how or None,
                "family": list(self.family) if self.family else None}


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
    ``op`` (launching operator; for a CPU frame the compiled range it ran in), ``stream``
    (``pid/tid``), ``graph_id``, ``node``, ``node_idx`` (its position in the graph: the SVG id is
    ``node-<idx>``), ``how`` (how a CPU frame was matched to its node), ``highlight``.
    ``steps``: the step numbers in the trace; ``step``: the one replayed (None: the whole
    trace). ``source``: ``"gpu"`` (GPU kernels) or ``"cpu"`` (ops and C++ kernels of compiled
    regions, in a trace without GPU kernels). ``highlights``: per highlight pattern
    ``{pattern, frames, how, family}``; ``warnings``: sentences for patterns no frame matched."""

    trace_id: int
    step: int | None
    steps: list[int]
    origin_ns: int
    end_ms: float
    frames: list[dict] = field(default_factory=list)
    truncated: bool = False
    source: str = "gpu"
    highlights: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"trace_id": self.trace_id, "step": self.step, "steps": self.steps, "origin_ns": str(self.origin_ns),
                "end_ms": self.end_ms, "frames": self.frames, "truncated": self.truncated, "source": self.source,
                "highlights": self.highlights, "warnings": self.warnings,
                "graphs": sorted({f["graph_id"] for f in self.frames if f["graph_id"] is not None})}


def replay_frames(session: Session, trace_id: int, *, step: int | None = None,
                  highlight_ops=None, data: TraceData | None = None) -> ReplayFrames:
    """The frames of step ``step`` (``ProfilerStep#<step>``; default the first step, or the whole
    trace when it has no step ranges). Raises UsageError for a step the trace does not have or
    an invalid highlight expression."""
    highlights = [Highlight(str(t)) for t in highlight_ops or ()]
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
    mapping = data.mapping
    source = "gpu"
    if data.kernels or mapping.device != "cpu":
        kernels = data.kernels_of_step(chosen)
        roots: dict[int, str] = {}
        names: dict[int, str] = {}
    else:  # NOTE: [CPU trace mapping]: ops and C++ kernels of compiled regions
        source = "cpu"
        units = [u for u in mapping.cpu_units if chosen is None or chosen.ts <= u.ev.ts < chosen.end]
        kernels = [u.ev for u in units]
        roots = {u.ev.id: u.root.name for u in units}
        names = {u.ev.id: u.name for u in units}
    kernels = sorted(kernels, key=lambda k: (k.ts, k.id))
    truncated = len(kernels) > MAX_FRAMES
    kernels = kernels[:MAX_FRAMES]
    origin = chosen.ts if chosen is not None else min((k.ts for k in kernels), default=0)
    if kernels:
        origin = min(origin, kernels[0].ts)
    idx_of: dict[tuple[int, str], str] = {}
    graph_ids = {g for g, _ in mapping.by_kernel.values()}
    if graph_ids:
        for gid, name, idx, target in session.execute(
                select(Node.graph_id, Node.name, Node.idx, InternedString.value)
                .join(InternedString, InternedString.id == Node.target_id).where(Node.graph_id.in_(graph_ids))):
            idx_of[(gid, name)] = (idx, target)
    frames = []
    for k in kernels:
        if source == "cpu":
            op = roots.get(k.id)
        else:
            link = data.links.get(k.id)
            op = link.op.name if link is not None and link.op is not None else None
        got = mapping.by_kernel.get(k.id)
        gid, node = (got[0], got[1][0]) if got else (None, None)
        idx, target = idx_of.get((gid, node), (None, None)) if gid is not None else (None, None)
        name = names.get(k.id, k.name) if source == "cpu" else k.name
        ops = {_op_of(x) for x in (k.name, name, op or "", target or "") if x}
        ops |= set(name.lower().split("_")) if not name.startswith("aten::") else set()
        texts = [k.name, op or "", node or "", target or ""]
        hit = False
        for hl in highlights:  # every pattern is tried, so each counts its frames
            hit = hl.matches(texts, ops) or hit
        frames.append({
            "t_ms": round((k.ts - origin) / 1e6, 6), "dur_ms": round(k.dur / 1e6, 6), "kernel": k.name, "op": op,
            "stream": f"{k.pid}/{k.tid}", "graph_id": gid, "node": node, "node_idx": idx,
            "how": mapping.how.get(k.id), "highlight": hit,
        })
    end_ms = max((f["t_ms"] + f["dur_ms"] for f in frames), default=0.0)
    reports = [hl.report() for hl in highlights]
    where = f"step {chosen.name.split('#', 1)[1]}" if chosen is not None else "the trace"
    what = "GPU kernel, launching op or node" if source == "gpu" else "op, C++ kernel or node of a compiled region"
    warnings = [f"highlight {r['pattern']!r} matches no {what} in {where}"
                + (f" (looked for {r['how']})" if r["how"] else "") for r in reports if not r["frames"]]
    return ReplayFrames(trace_id, int(chosen.name.split("#", 1)[1]) if chosen is not None else None, numbers,
                        origin, round(end_ms, 6), frames, truncated, source, reports, warnings)
