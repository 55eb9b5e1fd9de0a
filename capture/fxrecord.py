"""Turning an ``torch.fx.GraphModule`` into store rows.

Pure functions of the graph: no store access here, so the same code serves capture, replay and
tests. Each node becomes a :class:`NodeRecord` with its output tensor metadata (from
``meta["val"]`` as AOTAutograd sets it, or ``meta["example_value"]`` as Dynamo sets it), its
module path from ``nn_module_stack`` (backward nodes: ``fwd_nn_module_stack``), ``stack_trace``,
``seq_nr``, ``partitioner_tag`` and AOT descriptor (``meta["desc"]``).

Example::

    >>> rec = record_graph(torch.fx.symbolic_trace(torch.nn.Linear(4, 2)))
    >>> [(n.name, n.op, n.target) for n in rec.nodes]
    [('input', 'placeholder', 'input'), ('weight', 'get_attr', 'weight'), ('bias', 'get_attr', 'bias'),
     ('linear', 'call_function', 'torch._C._nn.linear'), ('output', 'output', 'output')]
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from graphdeck.capture.guards import dim_value

ARG_REPR_LIMIT = 200

# NOTE: [Module paths]
# Dynamo writes nn_module_stack values as (path, class) with paths such as
# "L['self'].transformer.h[0].attn" or "L['self']._modules['transformer']._modules['h']['0']".
# We normalise both to "transformer/h/0/attn": the namespace the graph view clusters on.
_ROOT_RE = re.compile(r"^(?:L|G)\[['\"][^'\"]+['\"]\]")
_KEY_RE = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


_GETATTR_RE = re.compile(r"^getattr\((.*), (['\"])(.*?)\2\)(.*)$")


def _unwrap_getattr(text: str) -> str:
    """``"getattr(L['self'], 'a b')"`` (Dynamo's source of a module whose name is no identifier)
    → ``"L['self']['a b']"``; nested getattr calls too."""
    m = _GETATTR_RE.match(text)
    return f"{_unwrap_getattr(m.group(1))}[{m.group(2)}{m.group(3)}{m.group(2)}]{m.group(4)}" if m else text


@functools.lru_cache(maxsize=16384)
def module_path_from_fqn(path: str) -> str:
    """``"L['self']._modules['h']['0'].attn"`` → ``"h/0/attn"``, ``"L['self'].__dict__['_modules']['m']"``
    → ``"m"``; DDP's ``module.`` root kept."""
    text = _ROOT_RE.sub("", _unwrap_getattr(path))
    text = text.replace("._modules", "").replace("._parameters", "").replace("._buffers", "")
    text = _KEY_RE.sub(lambda m: "." + m.group(1), text)
    # "__dict__['_modules']" (Dynamo's spelling inside checkpoint_wrapper): attribute names no
    # submodule can have (nn.Module.add_module refuses existing attributes)
    parts = [p for p in text.split(".") if p and p not in ("self", "__dict__", "_modules")]
    return "/".join(parts)


def _stack_of(node: torch.fx.Node) -> list[tuple[str, str]]:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out = []
    for value in stack.values():
        try:
            path, cls = value
        except (TypeError, ValueError):
            continue
        cls_name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        out.append((module_path_from_fqn(str(path)), cls_name))
    return out


def target_name(node: torch.fx.Node) -> str:
    """Readable target: ``aten.mm.default``, ``torch._C._nn.linear``, ``operator.getitem``, a method name."""
    t = node.target
    if node.op == "call_function":
        if isinstance(t, torch._ops.OpOverload) or isinstance(t, torch._ops.OpOverloadPacket):
            return str(t)
        try:
            return torch.fx.node._get_qualified_name(t)
        except Exception:
            return getattr(t, "__name__", str(t))
    return str(t)


def _short(value: Any) -> Any:
    """JSON-able, bounded representation of an FX argument."""
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple)):
        return [_short(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _short(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, str) and len(value) > ARG_REPR_LIMIT:
            return value[:ARG_REPR_LIMIT] + f"…[total_len={len(value)}]"
        return value
    text = str(value)
    if len(text) > ARG_REPR_LIMIT:
        text = text[:ARG_REPR_LIMIT] + f"…[total_len={len(text)}]"
    return {"repr": text}


def _dim(d: Any) -> int | str:
    return dim_value(d)  # never int(SymInt): that guards (NOTE: [The capture adds no guard])


@dataclass
class TensorMeta:
    shape: list[int | str]
    dtype: str
    stride: list[int | str] | None
    device: str
    size_bytes: int | None


def tensor_meta(value: Any) -> TensorMeta | None:
    """Shape, dtype, stride, device and bytes (numel × element size; ``None`` when symbolic)."""
    if not isinstance(value, torch.Tensor):
        return None
    shape = [_dim(d) for d in value.shape]
    try:
        stride = [_dim(s) for s in value.stride()]
    except Exception:  # sparse, nested
        stride = None
    size_bytes = None
    if all(isinstance(d, int) for d in shape):
        numel = 1
        for d in shape:
            numel *= d
        size_bytes = numel * value.element_size()
    dtype = str(value.dtype).removeprefix("torch.")
    return TensorMeta(shape, dtype, stride, str(value.device), size_bytes)


def _node_value(node: torch.fx.Node) -> Any:
    for key in ("val", "example_value"):
        if key in node.meta:
            return node.meta[key]
    return None


@dataclass
class NodeRecord:
    idx: int
    name: str
    op: str
    target: str
    args: list
    kwargs: dict
    shape: Any = None  # list, or list of lists for tuple outputs
    dtype: str | None = None
    stride: Any = None
    device: str | None = None
    size_bytes: int | None = None
    module_path: str | None = None
    module_stack: list[tuple[str, str]] = field(default_factory=list)
    stack_trace: str | None = None
    seq_nr: int | None = None
    partitioner_tag: str | None = None
    desc: str | None = None
    meta: dict = field(default_factory=dict)


@dataclass
class EdgeRecord:
    src_idx: int
    dst_idx: int
    arg_pos: int
    size_bytes: int | None


@dataclass
class GraphRecord:
    nodes: list[NodeRecord]
    edges: list[EdgeRecord]
    code: str
    structural_hash: str

    def node(self, name: str) -> NodeRecord:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_NODE_REF = re.compile(r'\{"node": "[^"]*"\}')


def record_graph(gm: torch.fx.GraphModule) -> GraphRecord:
    """Read every node and data edge of ``gm`` into records (graph order; ``idx`` from 0).

    The structural hash covers op, target (not a placeholder's, which is only its name), output
    shape/dtype/stride, constant arguments (a collective's process group, a ``dim``, a scalar;
    object addresses removed) and input positions, not node names, so two ranks that compiled the
    same graph get the same hash and any difference that changes what runs changes it.
    """
    nodes: list[NodeRecord] = []
    index: dict[torch.fx.Node, int] = {}
    hasher = hashlib.sha256()
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        value = _node_value(node)
        rec = NodeRecord(
            idx=i,
            name=node.name,
            op=node.op,
            target=target_name(node),
            args=_short(list(node.args)),
            kwargs=_short(dict(node.kwargs)),
        )
        if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
            metas = [tensor_meta(v) for v in value]
            rec.shape = [m.shape if m else None for m in metas]
            first = next(m for m in metas if m)
            rec.dtype, rec.device = first.dtype, first.device
            rec.stride = [m.stride if m else None for m in metas]
            sizes = [m.size_bytes for m in metas if m]
            rec.size_bytes = sum(sizes) if all(s is not None for s in sizes) else None
        else:
            m = tensor_meta(value)
            if m is not None:
                rec.shape, rec.dtype, rec.stride, rec.device, rec.size_bytes = (
                    m.shape, m.dtype, m.stride, m.device, m.size_bytes)
            elif isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
                rec.meta["value"] = str(value)
        rec.module_stack = _stack_of(node)
        if rec.module_stack:
            rec.module_path = rec.module_stack[-1][0] or None
        rec.stack_trace = node.meta.get("stack_trace")
        seq = node.meta.get("seq_nr")
        rec.seq_nr = int(seq) if isinstance(seq, int) else None
        rec.partitioner_tag = node.meta.get("partitioner_tag")
        if "desc" in node.meta:
            rec.desc = _short(node.meta["desc"]) if node.op == "output" else str(node.meta["desc"])
            if not isinstance(rec.desc, str):
                rec.desc = json.dumps(rec.desc)
        if node.meta.get("recompute") is not None:
            rec.meta["recompute"] = str(node.meta["recompute"])
        if node.meta.get("original_aten") is not None:
            rec.meta["original_aten"] = str(node.meta["original_aten"])
        if node.meta.get("ac_graph_id") is not None:  # which checkpointed region (NOTE: [Graph regions])
            rec.meta["ac_graph_id"] = str(node.meta["ac_graph_id"])
        body = _hop_body(gm, node)
        if body is not None:
            rec.meta["body"] = body
        nodes.append(rec)
        target = "" if node.op == "placeholder" else rec.target
        consts = _ADDRESS.sub("", json.dumps([rec.args, rec.kwargs], default=str, sort_keys=True))
        consts = _NODE_REF.sub("N", consts)
        hasher.update(f"{node.op}|{target}|{rec.shape}|{rec.dtype}|{rec.stride}|{consts};".encode())

    edges: list[EdgeRecord] = []
    for node in gm.graph.nodes:
        flat = []
        torch.fx.node.map_arg((node.args, node.kwargs), lambda a: flat.append(a))
        for pos, src in enumerate(flat):
            edges.append(EdgeRecord(index[src], index[node], pos, nodes[index[src]].size_bytes))
            hasher.update(f"{index[src]}>{index[node]}:{pos};".encode())
    try:
        code = gm.code
    except Exception:
        code = str(gm.graph)
    return GraphRecord(nodes=nodes, edges=edges, code=code, structural_hash=hasher.hexdigest()[:32])


#: How many body op names a higher-order node's ``meta["body"]`` keeps.
BODY_OPS_KEPT = 12


def _hop_body(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict | None:
    """For a higher-order op whose first argument is a ``get_attr`` of a subgraph (Dynamo's
    ``tag_activation_checkpoint(wrap_body_0, ...)``, ``wrap_with_autocast(..., wrap_body_0, ...)``):
    ``{"name": attr, "module": the body nodes' common module path ("layers/1"), "nodes": call
    count, "ops": first short targets}``, else None. The body itself is not stored as nodes."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    attr = next((a.target for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"), None)
    try:
        sub = getattr(gm, attr) if isinstance(attr, str) else None
    except AttributeError:
        sub = None
    if not isinstance(sub, torch.fx.GraphModule):
        return None
    calls = [n for n in sub.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    paths = [s[-1][0] for s in (_stack_of(n) for n in calls) if s]
    common = paths[0].split("/") if paths else []
    for p in paths[1:]:
        parts = p.split("/")
        k = 0
        while k < min(len(common), len(parts)) and common[k] == parts[k]:
            k += 1
        common = common[:k]
    ops = [str(getattr(n.target, "__name__", n.target)).removesuffix(".default") for n in calls]
    return {"name": attr, "module": "/".join(p for p in common if p), "nodes": len(calls),
            "ops": [o[:ARG_REPR_LIMIT] for o in ops[:BODY_OPS_KEPT]]}


def output_args(gm: torch.fx.GraphModule) -> list[Any]:
    """The flat list of the output node's values (``Node`` or ``None``)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    vals = out.args[0]
    return list(vals) if isinstance(vals, (list, tuple)) else [vals]


def output_descs(gm: torch.fx.GraphModule) -> list[Any]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    desc = out.meta.get("desc")
    return list(desc) if isinstance(desc, (list, tuple)) else []
