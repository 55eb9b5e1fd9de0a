"""A stored graph at another batch size (``--microbatch-size`` / ``pipeline_microbatch_size``).

# NOTE: [Rebatching a static graph]
A captured graph's shapes are those of the captured batch. The *captured batch size* ``B`` is
dim 0 of the graph's first data input (a tensor placeholder not bound to a parameter) whose dim 0
is above 1; the *batch inputs* are the data inputs whose dim 0 is ``B`` (a backward graph's saved
activations and tangents included). An input saved with the batch flattened into dim 0
(``[B*S, H]``) is not resized (a multiple of ``B`` may as well be a feature size); a node that
then fails names it. To run the graph on microbatches of ``b`` rows, the batch inputs get dim 0 =
``b`` (same dim order as recorded, i.e. the recorded stride order), SymInt inputs whose recorded
value is ``B`` (a dynamic batch size) get ``b``, everything else keeps its recorded shape, and the
rebuilt graph is re-run on ``meta`` tensors (no data, no kernels: shape propagation through the
real ops' meta functions); every node's shape, stride and bytes are then the propagated ones.

The graph cannot take ``b`` when a node fixes the batch size: a literal ``B`` in its arguments
(Dynamo and AOTAutograd bake static sizes in: ``view(x, [6, -1])``, ``expand(g, [6, 5])``,
``full([6, 4], ...)``). That shows either as a failing node (the node that fails, or the nearest
ancestor with a literal ``B``, is named) or as a node recorded with ``B`` rows that still makes
``B`` rows from a literal ``B`` at batch ``b`` (named). Literals are never rewritten: a literal
equal to ``B`` may be a feature size, and guessing would replay another program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from graphdeck.errors import UsageError


def _flat_shape(shape) -> bool:
    return isinstance(shape, list) and bool(shape) and all(isinstance(d, int) for d in shape)


def data_inputs(stored) -> list:
    """The tensor placeholders of ``stored`` not bound to a parameter, graph order."""
    return [n for n in stored.nodes if n.op == "placeholder" and not n.param_fqn and _flat_shape(n.shape)]


def captured_batch(stored) -> int | None:
    """The captured batch size (NOTE: [Rebatching a static graph]): dim 0 of the first data input
    whose dim 0 is above 1 (a ``[1, S]`` position-ids buffer is not the batch); 1 when every data
    input has dim 0 of 1; None when there is no data input."""
    dims = [n.shape[0] for n in data_inputs(stored)]
    if not dims:
        return None
    return next((d for d in dims if d > 1), 1)


def _literals(value: Any, out: list) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        out.append(value)
    elif isinstance(value, dict):
        if set(value) in ({"node"}, {"repr"}):
            return
        for v in value.values():
            _literals(v, out)
    elif isinstance(value, list):
        for v in value:
            _literals(v, out)


def _has_literal(node, batch: int) -> bool:
    found: list[int] = []
    _literals([node.args, node.kwargs], found)
    return batch in found


def _empty_like_recorded(shape, stride, dtype, device):
    """An uninitialised tensor of ``shape`` whose dims are laid out in the recorded stride order."""
    import torch

    if isinstance(stride, list) and len(stride) == len(shape):
        order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
        base = torch.empty([shape[d] for d in order], dtype=dtype, device=device)
        return base.permute([order.index(d) for d in range(len(shape))])
    return torch.empty(shape, dtype=dtype, device=device)


def _meta_of(value) -> tuple[Any, Any, int | None, str | None]:
    """(shape, stride, bytes, value) of a propagated output, in the store's conventions."""
    import torch

    if isinstance(value, torch.Tensor):
        return list(value.shape), list(value.stride()), value.numel() * value.element_size(), None
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) or v is None for v in value):
        metas = [_meta_of(v) if v is not None else (None, None, 0, None) for v in value]
        return [m[0] for m in metas], [m[1] for m in metas], sum(m[2] or 0 for m in metas), None
    if isinstance(value, int) and not isinstance(value, bool):
        return None, None, None, str(value)
    return None, None, None, None


def rebatch(stored, batch: int):
    """``stored`` (:class:`graphdeck.replay.executor.StoredGraph`) with its batch inputs at
    ``batch`` rows and every node's shape/stride/size_bytes propagated (NOTE: [Rebatching a static
    graph]); ``stored`` itself when ``batch`` is the captured batch size.

    Raises UsageError: no data input to take the batch from, or the node that fixes the batch
    size (with the error the propagation met, if any)."""
    import torch
    import torch.fx

    from graphdeck.replay.executor import rebuild
    from graphdeck.replay.synth import _dtype

    if batch < 1:
        raise UsageError(f"microbatch size {batch}: must be at least 1")
    captured = captured_batch(stored)
    if captured is None:
        raise UsageError(f"microbatch size {batch}: graph {stored.id} has no data input (every tensor input is a "
                         "parameter), so it has no batch dimension to change")
    if batch == captured:
        return stored
    batch_inputs = {n.name for n in data_inputs(stored) if n.shape[0] == captured}
    rebuilt = rebuild(stored, device="meta", ports=False)
    inputs = []
    for p in rebuilt.placeholders:
        if p.shape is None and p.value is not None:
            inputs.append(batch if p.value == str(captured) else int(p.value))
            continue
        if not _flat_shape(p.shape) and p.shape != []:
            raise UsageError(f"node {p.name!r}: input has no single-tensor shape {p.shape!r} to rebatch")
        shape = ([batch] + p.shape[1:]) if p.name in batch_inputs else p.shape
        inputs.append(_empty_like_recorded(shape, p.stride, _dtype(p.dtype or "float32"), "meta"))
    by_name = stored.by_name()
    seen: dict[str, Any] = {}

    class Propagate(torch.fx.Interpreter):
        def run_node(self, n):
            try:
                out = super().run_node(n)
            except Exception as exc:  # any op error at the new batch size: name the node that fixes it
                raise UsageError(_fixing_message(stored, by_name, n.name, captured, batch, exc)) from None
            seen[n.name] = out
            return out

    interp = Propagate(rebuilt.gm)
    interp.extra_traceback = False  # our message names the node; no FX node dump appended to it
    with torch.no_grad():
        interp.run(*inputs)
    nodes = []
    for n in stored.nodes:
        if n.name not in seen or n.op == "output":
            nodes.append(n)
            continue
        shape, stride, size, value = _meta_of(seen[n.name])
        if (_flat_shape(n.shape) and n.shape[0] == captured and _flat_shape(shape) and shape[0] == captured
                and n.op != "placeholder" and _has_literal(n, captured)):
            raise UsageError(f"microbatch size {batch}: node {n.name!r} ({n.target}) fixes the batch size of graph "
                             f"{stored.id}: its arguments hold the captured batch size {captured} as a literal (a "
                             f"static shape), so it still makes {captured} rows at batch {batch}")
        if shape is None and value is None:
            nodes.append(n)
            continue
        nodes.append(dataclasses.replace(n, shape=shape, stride=stride, size_bytes=size,
                                         value=value if value is not None else n.value))
    return dataclasses.replace(stored, nodes=nodes)


def _ancestors(by_name: dict, start: str) -> list[str]:
    """``start`` then its ancestors, nearest first (breadth first over argument references)."""
    order, todo, seen = [], [start], {start}
    while todo:
        name = todo.pop(0)
        order.append(name)
        node = by_name.get(name)
        for ref in node.inputs() if node is not None else ():
            if ref not in seen:
                seen.add(ref)
                todo.append(ref)
    return order


def _fixing_message(stored, by_name: dict, failed: str, captured: int, batch: int, exc: Exception) -> str:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    culprit = next((a for a in _ancestors(by_name, failed)
                    if by_name.get(a) is not None and by_name[a].op.startswith("call_")
                    and _has_literal(by_name[a], captured)), None)
    if culprit is None:
        kept = [f"{a} {by_name[a].shape}" for a in _ancestors(by_name, failed)
                if by_name.get(a) is not None and by_name[a].op == "placeholder" and not by_name[a].param_fqn
                and _flat_shape(by_name[a].shape) and by_name[a].shape[0] != captured
                and by_name[a].shape[0] % captured == 0]
        hint = (f"; inputs it reads that kept their recorded shape and may hold the batch flattened into dim 0: "
                f"{', '.join(kept[:4])}" if kept else "")
        return (f"microbatch size {batch}: graph {stored.id} cannot run at batch {batch}: node {failed!r} fails "
                f"({reason}); no node before it holds the captured batch size {captured} as a literal, so the "
                f"failing node's own static shapes fix the batch size{hint}")
    c = by_name[culprit]
    where = "" if culprit == failed else f"; node {failed!r} then fails: {reason}"
    return (f"microbatch size {batch}: node {culprit!r} ({c.target}) fixes the batch size of graph {stored.id}: "
            f"its arguments hold the captured batch size {captured} as a literal (a static shape)"
            + (where or f" and it fails at batch {batch}: {reason}"))
