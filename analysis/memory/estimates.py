"""What-if estimates over a training step's graph-derived memory (split from
:mod:`graphdeck.analysis.memory.core`, which re-exports them): activation checkpointing of a module
path, and activations kept in another dtype. Figures in bytes; same node order as
:func:`graphdeck.analysis.memory.core.step_memory`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from sqlalchemy.orm import Session

from graphdeck.analysis.memory.core import (
    _OP_CALL,
    _OP_OUTPUT,
    _OP_PLACEHOLDER,
    ITEMSIZE,
    MemoryCurve,
    Tensor,
    _finish,
    _graph,
    _liveness,
    _load,
    _module_ids,
    _saved_by_name,
    _saved_positions,
    _Storages,
    canonical_dtype,
    op_name,
    step_memory,
)
from graphdeck.errors import NotFoundError, UsageError  # noqa: F401


# ------------------------------------------------------------------------------------ what-if
@dataclass
class Estimate:
    what: str
    baseline_peak_bytes: int
    estimated_peak_bytes: int
    saved_bytes_removed: int = 0
    recompute_nodes: int = 0
    note: str = ""
    baseline_peak_node: str = ""
    estimated_peak_node: str = ""
    peak_phase: str = ""  # checkpoint: where the estimated peak is (forward / backward before or from the recompute)

    @property
    def saving_bytes(self) -> int:
        return self.baseline_peak_bytes - self.estimated_peak_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "saving_bytes": self.saving_bytes}


def checkpoint_estimate(session: Session, forward_id: int, backward_id: int, module_path: str) -> Estimate:
    """Activation checkpointing of ``module_path`` (a module path prefix, ``"transformer/h/0"``),
    as ``torch.utils.checkpoint`` under torch.compile does it: the partitioner recomputes every op
    of the checkpointed region inside the backward graph.

    The estimated step curve (same node order as :func:`step_memory`) differs from the baseline:

    * no saved activation produced inside the module is held between forward and backward; each
      lives until its last forward use;
    * each is born again just before its first backward use (the partitioner places every
      recomputed op next to its first use; for the module's output that is the *next* module's
      backward) and lives until its last backward use (kind ``recomputed``);
    * inputs of the module produced outside it are held until the first recompute (checkpoint
      keeps them to re-run the module).

    The recomputation's never-saved intermediates are not added (they die as it goes). The peak is searched
    over the whole step again — where it is (forward end, the loss's backward, the recompute)
    decides the saving, which can be much less than ``saved_bytes_removed``; ``peak_phase`` says
    where. Checked against measured CPU runs: bench/RESULTS.md "Memory view".

    Raises:
        UsageError: no saved activation belongs to that module.
    """
    fw_graph = _graph(session, forward_id)
    base = step_memory(session, forward_id, backward_id)
    fw, bw = _load(session, forward_id), _load(session, backward_id)
    mods_f = fw.module_paths(_module_ids(session, fw_graph, fw))
    in_f = np.array([_under(m, module_path) for m in mods_f], dtype=bool)
    calls_f = (fw.op != _OP_PLACEHOLDER) & (fw.op != _OP_OUTPUT)
    inside = int((in_f & calls_f).sum())
    candidates = {s["name"] for s in base.saved if _under(s["module_path"], module_path)}
    if not candidates:
        raise UsageError(f"no saved activation of the forward graph belongs to module {module_path!r}; "
                         f"modules with saved activations: {', '.join(list(base.saved_bytes_by_module)[:12])}")
    drop = candidates
    est = step_memory(session, forward_id, backward_id, drop_saved=drop)
    tensors = est.tensors
    recomputed = [t for t in tensors if t.kind == "recomputed"]
    at = min((t.birth_idx for t in recomputed), default=None)
    nf = fw.n
    if at is not None:
        live_f = _liveness(fw, mods_f, saved=_saved_positions(fw) or _saved_by_name(fw, bw))
        # Inputs of the module made outside it: held until the recompute.
        into = (fw.src >= 0) & in_f[fw.dst] & ~in_f[np.maximum(fw.src, 0)]
        feeding = set(live_f.storage_of[fw.src[into]].tolist()) - {-1}
        for k in feeding:
            t = tensors[k]
            if t.kind == "activation" and t.death_idx < at:
                t.death_idx, t.freed_by = at, f"b:{bw.names[at - nf]}"
    curve = _finish(est.graph_ids, est.nodes, est.modules, _Storages.from_tensors(tensors))
    removed = sum(s["size_bytes"] for s in base.saved if s["name"] in drop)
    return Estimate(what=f"checkpoint {module_path}", baseline_peak_bytes=base.peak_bytes,
                    estimated_peak_bytes=curve.peak_bytes, saved_bytes_removed=removed, recompute_nodes=inside,
                    note=f"{len(drop)} saved activations recomputed in backward",
                    baseline_peak_node=base.peak_node, estimated_peak_node=curve.peak_node,
                    peak_phase=_phase(curve, nf, at))


def _phase(curve: MemoryCurve, nf: int, recompute_at: int | None) -> str:
    """Where the peak is: ``forward``, ``backward before the recompute`` or ``backward from the recompute``
    (at or after the first recomputed tensor's birth)."""
    if curve.peak_index < nf:
        return "forward"
    if recompute_at is None or curve.peak_index < recompute_at:
        return "backward before the recompute"
    return "backward from the recompute"


def dtype_estimate(session: Session, forward_id: int, backward_id: int, dtype: str = "bfloat16") -> Estimate:
    """Activations (not parameters, not integer tensors) stored in ``dtype`` instead: new peak.
    ``dtype``: a torch dtype name or a common alias (``bf16``, ``fp16``, ``half``, ``fp32``,
    ``float``, ``fp8``/``e4m3``, ``e5m2``; :func:`canonical_dtype`).

    Raises:
        UsageError: unknown dtype.
    """
    dtype = canonical_dtype(dtype)
    new = ITEMSIZE[dtype]
    floats = {"float64", "float32", "float16", "bfloat16"}
    fw, bw = _load(session, forward_id), _load(session, backward_id)
    casts = (_float_casts(fw), _float_casts(bw))

    def rescale(t: Tensor) -> int:
        if t.kind == "parameter" or t.dtype not in floats:
            return t.size_bytes
        if t.name in casts[t.birth_idx >= fw.n]:
            return 0  # NOTE: [Casts in a dtype what-if]
        return t.size_bytes * new // ITEMSIZE[t.dtype]

    base = step_memory(session, forward_id, backward_id)
    est = step_memory(session, forward_id, backward_id, itemsize_of=rescale)
    return Estimate(what=f"activations in {dtype}", baseline_peak_bytes=base.peak_bytes,
                    estimated_peak_bytes=est.peak_bytes)


# NOTE: [Casts in a dtype what-if]
# Under autocast a graph holds cast copies — a bf16 copy of each fp32 weight before its matmul,
# fp32 copies of bf16 activations around a softmax or a loss — made by ``convert_element_type`` /
# ``_to_copy`` nodes. With every float in one dtype those casts change nothing and the job would
# not make the copies, so the what-if drops them (0 bytes) instead of rescaling them: rescaling
# them too over-counted the fp32 what-if of the H200 GPT-2 autocast run by +14.8% against the
# fp32 run's measured snapshot (bench/bench_gpu_whatif.py). The input a dropped cast stood in for
# is already counted where it lives.
_CAST_NAMES = frozenset({"convert_element_type", "_to_copy", "to"})


def _float_casts(c) -> set[str]:
    """Names of the nodes of graph columns ``c`` that cast one float tensor to another float dtype."""
    floats = {"float64", "float32", "float16", "bfloat16"}
    out = set()
    for i in np.flatnonzero((c.op == _OP_CALL) & (c.first_in >= 0)).tolist():
        name = op_name(c.text.get(int(c.target[i]), ""))
        if name in _CAST_NAMES and c.dtypes[i] in floats and c.dtypes[int(c.first_in[i])] in floats:
            out.add(c.names[i])
    return out


def _under(path: str | None, prefix: str) -> bool:
    if not path:
        return False
    p = prefix.strip("/").replace(".", "/")
    return path == p or path.startswith(p + "/")


