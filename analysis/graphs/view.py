"""The graph view model: what the SVG renderer and the dashboard draw, as a documented wire model.

One stored FX graph becomes one :class:`GraphView` through :func:`graph_view`. The view holds
only what drawing needs: nodes with an id (the FX node name), a short label, the op category
(which picks the colour), a namespace ``"a/b/c"`` (the module path, which becomes nested
collapsible clusters) and the output tensor's shape and dtype; edges join node ids and carry the
input position at the consumer (the port) and the bytes that flow. Per-node overlays (time,
memory, rank) are a separate model keyed by the same node id.

Example (a 3-node graph)::

    >>> view = GraphView(graph_id=1, name="g", kind="dynamo", nodes=[
    ...     ViewNode(id="x", idx=0, label="x", op="placeholder", target="x", category="placeholder"),
    ...     ViewNode(id="relu", idx=1, label="relu", op="call_function", target="aten.relu.default",
    ...              category="elementwise", namespace="block", shape=[8, 64], dtype="torch.float32"),
    ...     ViewNode(id="output", idx=2, label="output", op="output", target="output", category="output"),
    ... ], edges=[ViewEdge(src="x", dst="relu"), ViewEdge(src="relu", dst="output")])
    >>> [n.id for n in view.nodes], len(view.edges)
    (['x', 'relu', 'output'], 2)
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from graphdeck.errors import NotFoundError
from graphdeck.store.schema import Edge, Graph, InternedString, Node

#: Every value :attr:`ViewNode.category` takes. The first three follow the FX op; the rest
#: classify ``call_function`` / ``call_method`` targets by their short name.
CATEGORIES = (
    "placeholder",
    "get_attr",
    "output",
    "matmul",  # matmul / conv / attention
    "elementwise",
    "reduction",  # reductions and normalisations
    "view",  # view / reshape / layout and data movement (cat, clone)
    "cast",  # dtype conversion (_to_copy with a dtype, convert_element_type, .float())
    "collective",  # collectives and their waits
    "random",  # random number generation (dropout's bernoulli, rand*)
    "other",
)


class ViewNode(BaseModel):
    """One FX node as drawn."""

    id: str = Field(description="FX node name, unique in the graph; the key for overlays")
    idx: int = Field(description="position in graph order; the SVG's <g id='node-<idx>'>")
    label: str = Field(description="short op name: 'mm' for aten.mm.default, placeholder's name")
    op: str = Field(description="FX op: placeholder, call_function, call_method, call_module, get_attr, output")
    target: str = Field(description="the full target as stored, e.g. 'aten.mm.default'")
    category: str = Field(description="one of " + ", ".join(CATEGORIES))
    namespace: str | None = Field(default=None, description="module path 'a/b/c'; None at top level")
    shape: list[Any] | None = Field(default=None, description="output shape (ints or symbols); list of shapes for tuples")
    dtype: str | None = Field(default=None, description="output dtype as stored, e.g. 'torch.float32'")
    param_fqn: str | None = Field(default=None, description="parameter a placeholder is bound to")
    size_bytes: int | None = Field(default=None, description="output bytes (numel × element size)")
    seq_nr: int | None = Field(default=None, description="autograd sequence number; forward and backward nodes of one op share it")
    recomputed: bool = Field(default=False, description="a forward op the partitioner moved into this backward graph")
    dtype_change: str | None = Field(default=None, description="'float32→bfloat16' when a floating input's dtype differs from the output's")
    namespace_from: str | None = Field(default=None, description="'seq_nr' / 'consumer' / 'producer' when the namespace was inferred (NOTE: [Nodes without a module])")


class ViewEdge(BaseModel):
    """A data edge ``src`` → ``dst``; ``arg_pos`` is the input port at ``dst``."""

    src: str
    dst: str
    arg_pos: int = 0
    size_bytes: int | None = None


class GraphView(BaseModel):
    """A drawable graph: nodes in graph order, edges sorted by (src idx, dst idx, arg_pos)."""

    graph_id: int
    name: str
    kind: str
    nodes: list[ViewNode]
    edges: list[ViewEdge]


def graph_view(session: Session, graph_id: int) -> GraphView:
    """Build the view of stored graph ``graph_id`` (rows are trusted: no pydantic validation).

    Raises:
        NotFoundError: no graph has that id.
    """
    graph = session.get(Graph, graph_id)
    if graph is None:
        raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
    target = aliased(InternedString)
    module = aliased(InternedString)
    conn = session.connection()  # Core rows: the ORM's per-row processing doubles the load time
    rows = conn.execute(
        select(
            Node.idx, Node.name, Node.op, target.value, module.value,
            Node.shape_json, Node.dtype, Node.param_fqn, Node.size_bytes, Node.seq_nr, Node.partitioner_tag,
        )
        .join(target, Node.target_id == target.id)
        .outerjoin(module, Node.module_path_id == module.id)
        .where(Node.graph_id == graph_id)
        .order_by(Node.idx)
    ).all()
    backward = graph.kind == "aot_backward"
    nodes = [
        _trusted(ViewNode, {
            "id": name, "idx": idx, "label": _label(op, tgt), "op": op, "target": tgt, "category": _category(op, tgt),
            "namespace": (module_path or "").strip("/") or None, "shape": _shape(shape_json), "dtype": dtype,
            "param_fqn": param_fqn, "size_bytes": size, "seq_nr": seq_nr,
            "recomputed": backward and tag == "is_forward" and op not in ("placeholder", "output"),
            "dtype_change": None, "namespace_from": None,
        })
        for idx, name, op, tgt, module_path, shape_json, dtype, param_fqn, size, seq_nr, tag in rows
    ]
    names = {n.idx: n.id for n in nodes}
    pos = {n.idx: i for i, n in enumerate(nodes)}
    edge_rows = conn.execute(
        select(Edge.src_idx, Edge.dst_idx, Edge.arg_pos, Edge.size_bytes)
        .where(Edge.graph_id == graph_id)
        .order_by(Edge.src_idx, Edge.dst_idx, Edge.arg_pos)
    ).all()
    edges = [
        _trusted(ViewEdge, {"src": names[src], "dst": names[dst], "arg_pos": pos, "size_bytes": size})
        for src, dst, pos, size in edge_rows
        if src in names and dst in names
    ]
    if backward:
        _from_forward_seq_nr(conn, graph, nodes)
    _infer(nodes, [(pos[src], pos[dst]) for src, dst, _pos, _size in edge_rows if src in pos and dst in pos])
    return GraphView.model_construct(graph_id=graph.id, name=graph.name, kind=graph.kind, nodes=nodes, edges=edges)


def _from_forward_seq_nr(conn, graph: Graph, nodes: list[ViewNode]) -> None:
    """A backward node with no module but a ``seq_nr`` takes the module of the forward node with
    that ``seq_nr`` in its AOT forward sibling (the op it is the gradient of)."""
    missing = [n for n in nodes if not n.namespace and n.seq_nr is not None and n.op != "output"]
    if not missing or graph.parent_id is None:
        return
    module = aliased(InternedString)
    fwd = (select(Graph.id).where(Graph.parent_id == graph.parent_id, Graph.kind == "aot_forward")
           .order_by(Graph.id).limit(1).scalar_subquery())
    rows = conn.execute(select(Node.seq_nr, module.value).join(module, Node.module_path_id == module.id)
                        .where(Node.graph_id == fwd, Node.seq_nr.is_not(None)).order_by(Node.idx)).all()
    by_seq: dict[int, str] = {}
    for seq, path in rows:
        by_seq.setdefault(seq, path.strip("/"))
    for n in missing:
        path = by_seq.get(n.seq_nr)
        if path:
            n.namespace, n.namespace_from = path, "seq_nr"


def _trusted(cls: type[BaseModel], values: dict) -> Any:
    """``cls`` holding ``values`` (every field given) without validation: what pydantic's
    ``model_construct`` ends with, minus its per-field default handling (30 µs a node on a
    20,000-node graph). Only for rows the store already typed."""
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", _ALL_FIELDS[cls])  # every field set: one shared set
    object.__setattr__(obj, "__pydantic_extra__", None)
    object.__setattr__(obj, "__pydantic_private__", None)
    return obj


_ALL_FIELDS = {ViewNode: set(ViewNode.model_fields), ViewEdge: set(ViewEdge.model_fields)}


@functools.lru_cache(maxsize=65536)
def _shape(text: str | None) -> Any:
    """A stored shape, parsed once per distinct text (shapes repeat; treat the result as read-only)."""
    return loads_json(text)


@functools.lru_cache(maxsize=65536)
def _label(op: str, target: str) -> str:
    return node_label(op, target)


@functools.lru_cache(maxsize=65536)
def _category(op: str, target: str) -> str:
    return op_category(op, target)


# NOTE: [Nodes without a module]
# AOT backward graphs have nodes with no (fwd_)nn_module_stack: gradient-accumulation adds,
# tangents and saved-activation placeholders, nodes whose fwd_nn_module_stack is None while
# fwd_source_fn_stack is set. Rule: first, a backward node with a seq_nr takes the module of the
# forward node with that seq_nr (stored graphs; ``namespace_from="seq_nr"``); then a placeholder
# (or get_attr) joins the module of its first
# consumer that has one; any other node joins its first producer's module, else its first
# consumer's. Repeated until nothing changes, so chains of such nodes follow their neighbours.
# The output node stays at the top. Inferred namespaces are marked (``namespace_from``) and
# count in the cluster they join.
_FLOAT = {"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "float", "half", "double"}


def finish_view(nodes: list[ViewNode], edges: list[ViewEdge]) -> None:
    """Fill in what needs the edges: inferred namespaces (NOTE: [Nodes without a module]) and
    ``dtype_change`` (a floating input of another floating dtype). Edits ``nodes`` in place."""
    pos = {n.id: i for i, n in enumerate(nodes)}
    _infer(nodes, [(pos[e.src], pos[e.dst]) for e in edges if e.src in pos and e.dst in pos])


def _infer(nodes: list[ViewNode], pairs: list[tuple[int, int]]) -> None:
    """:func:`finish_view` on list positions (plain lists: 20,000-node graphs load in the request)."""
    n = len(nodes)
    ins: list[list[int]] = [[] for _ in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    for src, dst in pairs:
        ins[dst].append(src)
        outs[src].append(dst)
    ops = [x.op for x in nodes]
    dts = [_dtype_name(x.dtype) for x in nodes]
    for d in range(n):
        out = dts[d]
        if out in _FLOAT and ins[d] and ops[d] not in ("output", "placeholder"):
            other = {dts[s] for s in ins[d]} & _FLOAT
            other.discard(out)
            if other:
                nodes[d].dtype_change = f"{min(other)}\u2192{out}"
    for adj in outs:
        adj.sort()
    ns = [x.namespace for x in nodes]
    how_of: dict[int, str] = {}
    pending = [i for i in range(n) if not ns[i] and ops[i] != "output"]
    while pending:
        left = []
        for i in pending:
            rules = (("consumer", outs),) if ops[i] in ("placeholder", "get_attr") else (("producer", ins), ("consumer", outs))
            for how, adj in rules:
                hit = next((ns[m] for m in adj[i] if ns[m]), None)
                if hit:
                    ns[i], how_of[i] = hit, how
                    break
            else:
                left.append(i)
        if len(left) == len(pending):
            break
        pending = left
    for i, how in how_of.items():
        nodes[i].namespace, nodes[i].namespace_from = ns[i], how


def _dtype_name(dtype: str | None) -> str | None:
    return dtype[len("torch."):] if dtype and dtype.startswith("torch.") else dtype


def loads_json(text: str | None, default: Any = None) -> Any:
    """A stored JSON column, or ``default`` when it is NULL or not valid JSON."""
    if text is None:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default


# NOTE: [Short target names]
# Capture stores targets as printed: OpOverloads as "aten.mm.default" (namespace.op.overload,
# sometimes prefixed "torch.ops."), Python callables by qualified name ("torch._C._nn.linear",
# "operator.getitem") or repr ("<built-in function getitem>"), methods by bare name ("view").
# The short name is the op for overloads and the last dotted part otherwise.
_OP_NAMESPACES = frozenset(
    {"aten", "prims", "_c10d_functional", "c10d_functional", "c10d", "_dtensor", "quantized",
     "_quantized", "inductor", "higher_order", "_higher_order_ops", "fsdp", "_inductor_test"}
)
_REPR_NAME = re.compile(r"<(?:built-in )?(?:function|method|class) '?([\w.]+)")


def short_target(target: str) -> str:
    """``'aten.mm.default'`` → ``'mm'``; ``'torch._C._nn.linear'`` → ``'linear'``;
    ``'<built-in function getitem>'`` → ``'getitem'``."""
    text = target.strip()
    if text.startswith("<"):
        match = _REPR_NAME.match(text)
        return match.group(1).rsplit(".", 1)[-1] if match else text
    if text.startswith("torch.ops."):
        text = text[len("torch.ops."):]
        parts = text.split(".")
        return parts[1] if len(parts) > 1 else parts[0]
    parts = text.split(".")
    if parts[0] in _OP_NAMESPACES and len(parts) > 1:
        return parts[1]
    return parts[-1]


def node_label(op: str, target: str) -> str:
    """The name drawn on a node: the target's short name; ``output`` for the output node."""
    if op == "output":
        return "output"
    if op in ("placeholder", "get_attr", "call_module"):
        return target
    return short_target(target)


_MATMUL = frozenset(
    {"mm", "bmm", "addmm", "matmul", "linear", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
     "einsum", "tensordot", "outer", "bilinear", "flex_attention", "scaled_mm"}
)
_MATMUL_PREFIXES = ("conv", "scaled_dot_product", "cudnn_convolution", "mkldnn_convolution", "flash_attention", "efficient_attention")
_REDUCTION = frozenset(
    {"sum", "nansum", "mean", "nanmean", "max", "min", "amax", "amin", "aminmax", "argmax", "argmin",
     "prod", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm", "softmax",
     "log_softmax", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
     "batch_norm", "native_batch_norm", "rms_norm", "fused_rms_norm", "logsumexp", "cumsum",
     "cumprod", "all", "any", "topk", "sort", "cross_entropy", "mse_loss", "count_nonzero",
     "median", "mode", "logcumsumexp"}
)
_REDUCTION_PREFIXES = ("nll_loss", "native_batch_norm", "native_batch_norm_legit", "batch_norm")
_VIEW = frozenset(
    {"view", "reshape", "unsafe_view", "reshape_alias", "permute", "transpose", "t", "expand",
     "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "contiguous", "slice", "select",
     "split", "split_with_sizes", "chunk", "unbind", "narrow", "as_strided", "alias", "detach",
     "getitem", "clone", "cat", "stack", "view_as", "movedim", "diagonal", "unfold", "index",
     "index_select", "size", "sym_size", "dim", "lift_fresh_copy", "view_as_real",
     "view_as_complex", "repeat", "tile", "roll", "flip", "pad", "constant_pad_nd", "squeeze_copy",
     "unsqueeze_copy", "view_copy", "permute_copy", "t_copy", "transpose_copy", "expand_copy",
     "slice_scatter", "select_scatter", "as_strided_scatter", "new_empty", "new_zeros"}
)
_COLLECTIVE_PREFIXES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
                        "wait_tensor", "send", "recv", "isend", "irecv", "barrier", "reduce_scatter_tensor")
_ELEMENTWISE = frozenset(
    {"add", "sub", "rsub", "mul", "div", "truediv", "floordiv", "neg", "pos", "abs", "exp", "exp2",
     "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "pow", "square", "relu", "relu6",
     "gelu", "silu", "sigmoid", "tanh", "sin", "cos", "tan", "erf", "erfinv", "where", "clamp",
     "clamp_min", "clamp_max", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
     "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
     "bitwise_not", "bitwise_xor", "and", "or", "xor", "invert", "reciprocal", "sign", "sgn",
     "floor", "ceil", "round", "trunc", "fmod", "remainder", "mod", "dropout", "native_dropout",
     "threshold", "hardtanh", "leaky_relu", "elu", "softplus", "mish", "hardswish", "hardsigmoid",
     "copy", "fill", "masked_fill", "zeros_like", "ones_like", "full_like",
     "empty_like", "lerp",
     "addcmul", "addcdiv", "iadd", "isub", "imul", "itruediv", "isnan", "isinf", "isfinite",
     "nan_to_num", "sigmoid_backward", "tanh_backward", "gelu_backward", "silu_backward",
     "threshold_backward", "native_dropout_backward", "scalar_tensor"}
)
_CAST = frozenset(
    {"to_copy", "to", "convert_element_type", "float", "half", "bfloat16", "double", "type_as", "type",
     "autocast_to_reduced_precision", "autocast_to_full_precision", "npu_dtype_cast"}
)
_RANDOM = frozenset(
    {"bernoulli", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
     "normal", "uniform", "dropout", "native_dropout", "fused_dropout", "multinomial", "philox_rand",
     "exponential", "geometric", "cauchy", "log_normal", "poisson", "seed", "inductor_random",
     "inductor_seeds", "inductor_lookup_seed", "run_and_save_rng_state", "run_with_rng_state"}
)


def op_category(op: str, target: str) -> str:
    """Classify a node for colouring; see :data:`CATEGORIES`.

    ``'aten.addmm.default'`` → ``'matmul'``, ``'aten.relu.default'`` → ``'elementwise'``,
    ``'aten.sum.dim_IntList'`` → ``'reduction'``, ``'aten.view.default'`` → ``'view'``,
    ``'_c10d_functional.all_reduce.default'`` → ``'collective'``, ``'prims.convert_element_type.default'``
    → ``'cast'``, ``'aten.bernoulli.p'`` → ``'random'``; unknown names → ``'other'``.
    """
    if op in ("placeholder", "get_attr", "output"):
        return op
    if op not in ("call_function", "call_method"):
        return "other"
    if "c10d" in target:
        return "collective"
    name = short_target(target).lower().strip("_")
    if name in _CAST:
        return "cast"
    if name in _RANDOM:
        return "random"
    if name in _ELEMENTWISE:  # before suffix stripping: 'threshold_backward' is elementwise
        return "elementwise"
    for suffix in ("_backward_data", "_backward_input", "_backward"):
        if name.endswith(suffix):
            name = name[: -len(suffix)].strip("_")
            break
    if name in _MATMUL or name.startswith(_MATMUL_PREFIXES):
        return "matmul"
    if name.startswith(_COLLECTIVE_PREFIXES):
        return "collective"
    if name in _REDUCTION or name.startswith(_REDUCTION_PREFIXES):
        return "reduction"
    if name in _VIEW:
        return "view"
    if name in _ELEMENTWISE or name.rstrip("_") in _ELEMENTWISE:  # in-place 'add_'
        return "elementwise"
    return "other"
