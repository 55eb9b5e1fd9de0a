"""Graphs of two ranks that differ only in scalar constants, and the mesh coordinate that explains them.

# NOTE: [Per-rank constants]
# A program sharded over a mesh dimension often bakes its rank's place into the graph as a plain
# number: a vocab-parallel loss compares labels with its vocab offset (``labels < 1024`` on tensor
# rank 1, ``labels < 0`` on rank 0: torchtitan's ``_LossParallelCrossEntropy``), an expert-parallel
# layer indexes its expert slice, a sequence-parallel block its positions. Dynamo specialises such
# Python ints, so the ranks' graphs differ — by design. Two graphs are *constant-only different*
# when every node agrees (op, target, shape, dtype, stride, and arguments wired to the same nodes)
# except scalar numbers in the arguments. Such a pair is explained when every differing constant
# is an offset along a sharding dimension the two ranks sit at different coordinates of: for a
# tensor recorded as ``Shard(k)`` on that dimension (a DTensor parameter of the layout record, or
# its FSDP2-sharded form), with ``L = ceil(global_shape[k] / dim size)`` (the shard size torch's
# chunking gives), ``value_b - value_a == (coord_b - coord_a) * L`` — the constant is
# ``coord * L + c`` with the same ``c`` on both ranks (``vocab_start`` and ``vocab_start + L``
# alike) — or the constants are the two ranks' coordinates themselves (a ``tp_rank`` baked in).
# Each differing constant must be explained, each by its own dimension and shard. An explained pair is a note naming the placement and the coordinates; a pair that is
# not explained stays a divergence, and its message shows both values.

Pure: reads nodes from the store.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from graphdeck.analysis.parallel.layout import RunLayout
    from graphdeck.analysis.ranks.records import CompileEntry

_SHARD = re.compile(r"^(?:Shard|S)\(\s*(?:dim=)?(-?\d+)")


@dataclass
class ConstantDiff:
    """One scalar argument that differs: node ``name`` (``target``) at ``source``, argument
    ``path`` (e.g. ``"args[1]"``), ``a`` on the first graph's rank, ``b`` on the second's."""

    name: str
    target: str
    source: str | None
    path: str
    a: float | int
    b: float | int

    def text(self) -> str:
        return f"{self.name} ({self.target}) {self.path}: {_num(self.a)} vs {_num(self.b)}"


def _num(v) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _scalar(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_SLICE = re.compile(r"slice\((-?\d+|None), (-?\d+|None), (-?\d+|None)\)")


def _slice(v: dict) -> tuple | None:
    """``(start, stop, step)`` of a slice as the graph records store it (``{"repr": "slice(0, 2, None)"}``)."""
    m = _SLICE.fullmatch(v.get("repr") or "") if set(v) == {"repr"} and isinstance(v.get("repr"), str) else None
    return tuple(None if x == "None" else int(x) for x in m.groups()) if m else None


def _walk(a, b, index_a: dict, index_b: dict, path: str, out: list) -> bool:
    """Compare two argument trees; scalar leaves that differ go to ``out`` as ``(path, a, b)``.
    False when they differ otherwise (another node, another structure, another non-number)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return False
        sa, sb = _slice(a), _slice(b)
        if sa is not None and sb is not None:  # a slice's bounds are scalar constants (``x[lo:lo + 2]``)
            return all(_walk(x, y, index_a, index_b, f"{path}.{k}", out)
                       for k, x, y in zip(("start", "stop", "step"), sa, sb))
        if set(a) == {"node"}:
            return index_a.get(a["node"], a["node"]) == index_b.get(b["node"], b["node"])
        return all(_walk(a[k], b[k], index_a, index_b, f"{path}.{k}" if path else k, out) for k in sorted(a))
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return False
        return all(_walk(x, y, index_a, index_b, f"{path}[{i}]", out) for i, (x, y) in enumerate(zip(a, b)))
    if _scalar(a) and _scalar(b):
        if a != b:
            out.append((path, a, b))
        return True
    return a == b


def constant_only_difference(session: Session, graph_a: int, graph_b: int) -> list[ConstantDiff] | None:
    """The scalar constants in which graph ``graph_b`` differs from ``graph_a`` (NOTE: [Per-rank
    constants]); ``[]`` for equal graphs, None when they differ in anything else."""
    from graphdeck.analysis.ranks.core import _node_rows, source_line

    rows_a, rows_b = _node_rows(session, graph_a), _node_rows(session, graph_b)
    if len(rows_a) != len(rows_b):
        return None
    index_a = {r[1]: r[0] for r in rows_a}
    index_b = {r[1]: r[0] for r in rows_b}
    out: list[ConstantDiff] = []
    for ra, rb in zip(rows_a, rows_b):
        # idx, name, op, target, shape, dtype, stride, module, stack, args
        if ra[2] != rb[2] or (ra[2] != "placeholder" and ra[3] != rb[3]) or ra[4:7] != rb[4:7]:
            return None
        if ra[9] == rb[9]:
            continue
        try:
            args_a, args_b = json.loads(ra[9] or "null"), json.loads(rb[9] or "null")
        except ValueError:
            return None
        found: list = []
        if not _walk(args_a, args_b, index_a, index_b, "", found):
            return None
        out += [ConstantDiff(name=rb[1], target=rb[3], source=source_line(rb[8]), path=_path_text(p), a=x, b=y)
                for p, x, y in found]
    return out


def _path_text(path: str) -> str:
    """``args[1]`` → ``argument 1``; ``kwargs.alpha`` → ``alpha=``."""
    m = re.fullmatch(r"args\[(\d+)\]", path)
    if m:
        return f"argument {m.group(1)}"
    m = re.fullmatch(r"kwargs\.(\w+)", path)
    return f"{m.group(1)}=" if m else path


def shard_steps(layout: RunLayout, rank_a: int, rank_b: int) -> list[tuple[str, int, str]]:
    """``(dim, step, why)`` per sharding dimension on which the two ranks' coordinates differ and
    per shard size a recorded tensor has along it: ``step = (coord_b - coord_a) * L`` (NOTE:
    [Per-rank constants]); ``why`` names the tensor and its placement. Distinct steps only, in
    the order of the records."""
    ca, cb = layout.coord(rank_a), layout.coord(rank_b)
    dims = [d for d in layout.sharding_dims() if d in ca and d in cb and ca[d] != cb[d]]
    if not dims:
        return []
    sizes = layout._dim_sizes()
    found: dict[tuple[str, int], dict[str, list[str]]] = {}  # (dim, step) -> placement text -> tensors
    for p in (layout.records.get(rank_a) or {}).get("params") or []:
        if not isinstance(p, dict):
            continue
        try:
            mesh_dims = layout.mesh_dims_of(rank_a, p)
            shape = [int(s) for s in p["global_shape"]]
            for dim, pl in zip(mesh_dims, p["placements"]):
                m = _SHARD.match(str(pl))
                if dim not in dims or not m or not sizes.get(dim):
                    continue
                k = int(m.group(1)) % len(shape)
                size = math.ceil(shape[k] / sizes[dim])
                step = (cb[dim] - ca[dim]) * size
                if step:
                    how = f"{pl} of {shape} over {dim} (size {sizes[dim]}): {size} a rank along dim {k}"
                    found.setdefault((dim, step), {}).setdefault(how, []).append(str(p["fqn"]))
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
            continue
    out = []
    for (dim, step), hows in found.items():
        how, fqns = next(iter(hows.items()))
        names = ", ".join(fqns[:3]) + (f" (+{len(fqns) - 3} more)" if len(fqns) > 3 else "")
        out.append((dim, step, f"{names} {'is' if len(fqns) == 1 else 'are'} {how}"))
    return out


def explain_constants(session: Session, layout: RunLayout, a: CompileEntry, b: CompileEntry, rank_a: int,
                      rank_b: int) -> str | None:
    """Why compile ``a`` (of ``rank_a``) and ``b`` (of ``rank_b``) differ only in constants their
    coordinates explain — text naming the constants and the placement — or None (NOTE:
    [Per-rank constants])."""
    if [g[0] for g in a.graphs] != [g[0] for g in b.graphs]:
        return None
    diffs: list[ConstantDiff] = []
    for ga, gb in zip(a.graphs, b.graphs):
        if ga[1] == gb[1] and ga[1] is not None:
            continue
        got = constant_only_difference(session, ga[2], gb[2])
        if got is None:
            return None
        diffs += got
    if not diffs:
        return None
    steps = shard_steps(layout, rank_a, rank_b)
    ca, cb = layout.coord(rank_a), layout.coord(rank_b)
    coords = [d for d in layout.sharding_dims() if d in ca and d in cb and ca[d] != cb[d]]
    reasons: dict[str, None] = {}
    for d in diffs:
        step = next(((dim, st, why) for dim, st, why in steps if d.b - d.a == st), None)
        if step is not None:
            dim, st, why = step
            reasons[f"offset by {st} = ({dim} {cb[dim]} - {dim} {ca[dim]}) × {st // (cb[dim] - ca[dim])}: {why}"] = None
            continue
        dim = next((x for x in coords if (d.a, d.b) == (ca[x], cb[x])), None)
        if dim is None:
            return None  # a constant no coordinate explains
        reasons[f"the {dim} coordinate itself ({ca[dim]} vs {cb[dim]})"] = None
    shown = "; ".join(x.text() for x in _distinct(diffs)[:4])
    more = f" (+{len(_distinct(diffs)) - 4} more)" if len(_distinct(diffs)) > 4 else ""
    at = next((d.source for d in diffs if d.source), None)
    return f"constants {shown}{more}{' at ' + at if at else ''} — " + "; ".join(reasons)


def _distinct(diffs: list[ConstantDiff]) -> list[ConstantDiff]:
    """One per (node name, argument, values): the forward and Dynamo graphs repeat a constant."""
    seen: set = set()
    out = []
    for d in diffs:
        key = (d.target, d.path, d.a, d.b)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def node_constants(row_a, row_b) -> str | None:
    """For two node rows (:func:`~graphdeck.analysis.ranks.core._node_rows`) of one op that differ
    only in scalar arguments: ``"argument 1: 0 vs 1024"``; else None."""
    if row_a is None or row_b is None or row_a[2:7] != row_b[2:7]:
        return None
    try:
        args_a, args_b = json.loads(row_a[9] or "null"), json.loads(row_b[9] or "null")
    except ValueError:
        return None
    found: list = []
    if not _walk(args_a, args_b, {}, {}, "", found) or not found:
        return None
    return "; ".join(f"{_path_text(p)}: {_num(x)} vs {_num(y)}" for p, x, y in found)
