"""Synthetic inputs for a stored graph, made from the recorded tensor metadata.

Floating inputs are normal samples (parameters, i.e. placeholders bound to a parameter or
``get_attr`` tensors, scaled by 0.02 like GPT-2's initialisation; the store holds no values);
booleans are fair coin flips; integer inputs (token ids, labels, saved indices) are drawn in
``[0, bound)`` where ``bound`` comes from what the graph does with them (NOTE: [Integer bounds]).
Values are drawn on the CPU from one seeded ``torch.Generator`` in placeholder order and then
moved, so the same seed gives the same inputs on every device and every worker. Recorded strides
are kept (``torch.empty_strided`` + copy) unless they overlap (a zero stride), then contiguous.

# NOTE: [Integer bounds]
An integer placeholder is followed through shape-only ops (view, reshape, unsqueeze, clone,
slice, ...) to the ops that index with it; its bound is the smallest of:
``embedding(weight, idx)`` / ``F.embedding(idx, weight)`` → ``weight.shape[0]``;
``embedding_dense_backward(grad, idx, num_weights, ...)`` → ``num_weights``;
``nll_loss*(self, target)`` / ``cross_entropy(input, target)`` → the class dim of ``self``;
``index_select``/``gather(self, dim, idx)`` → ``self.shape[dim]``; ``index.Tensor(self, [idx])`` →
``self.shape[0]``. An integer input whose use is none of these is all zeros (valid for any index).
"""

from __future__ import annotations

from typing import Any

_SHAPE_ONLY = ("view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "clone", "slice", "expand", "contiguous",
               "flatten", "permute", "transpose", "select", "alias", "to", "t", "detach", "_to_copy", "lift_fresh_copy",
               "constant_pad_nd", "pad")


def _op(target: str) -> str:
    """``aten.view.default`` → ``view``; ``torch.nn.functional.embedding`` → ``embedding``."""
    parts = target.split(".")
    if parts[0] in ("aten", "prims") and len(parts) >= 2:
        return parts[1]
    return parts[-1]


def _shape(nodes: dict, ref: Any) -> list | None:
    if isinstance(ref, dict) and "node" in ref and ref["node"] in nodes:
        shape = nodes[ref["node"]].shape
        if isinstance(shape, list) and (not shape or not isinstance(shape[0], list)):
            return shape
    return None


def _bound_from_use(nodes: dict, user, pos_name: str) -> int | None:
    """The bound an indexing ``user`` puts on the value referenced as argument ``pos_name``."""
    op = _op(user.target)
    a = user.args

    def ref_at(i):
        return a[i] if len(a) > i else None

    def is_me(x):
        return isinstance(x, dict) and x.get("node") == pos_name

    def dim(shape, d):
        if shape and isinstance(d, int) and -len(shape) <= d < len(shape) and isinstance(shape[d], int):
            return shape[d]
        return None

    if op == "embedding":
        if user.target.startswith("aten") and is_me(ref_at(1)):
            return dim(_shape(nodes, ref_at(0)), 0)
        if not user.target.startswith("aten") and is_me(ref_at(0)):
            return dim(_shape(nodes, ref_at(1) or user.kwargs.get("weight")), 0)
    if op == "embedding_dense_backward" and is_me(ref_at(1)):
        n = ref_at(2)
        if isinstance(n, dict) and n.get("node") in nodes:  # a SymInt input holding num_weights
            n = nodes[n["node"]].value
        return int(n) if isinstance(n, (int, str)) and str(n).isdigit() else None
    if op.startswith("nll_loss") or op == "cross_entropy":
        if op.endswith("backward"):
            self_ref, target_ref = ref_at(1), ref_at(2)
        else:
            self_ref, target_ref = ref_at(0), ref_at(1) if ref_at(1) is not None else user.kwargs.get("target")
        if is_me(target_ref):
            shape = _shape(nodes, self_ref)
            return dim(shape, 1 if shape and len(shape) >= 2 else 0)
    if op in ("index_select", "gather") and is_me(ref_at(2)):
        return dim(_shape(nodes, ref_at(0)), ref_at(1))
    if op == "index" and isinstance(ref_at(1), list) and any(is_me(x) for x in ref_at(1)):
        i = next(i for i, x in enumerate(ref_at(1)) if is_me(x))
        return dim(_shape(nodes, ref_at(0)), i)
    return None


def integer_bound(stored, name: str) -> int | None:
    """The exclusive upper bound for integer node ``name`` (NOTE: [Integer bounds]); None when
    no indexing use is found."""
    nodes = stored.by_name()
    users: dict[str, list] = {}
    for n in stored.nodes:
        for ref in set(n.inputs()):
            users.setdefault(ref, []).append(n)
    bounds = []
    todo, seen = [name], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in users.get(cur, []):
            b = _bound_from_use(nodes, user, cur)
            if b is not None:
                bounds.append(b)
            elif _op(user.target) in _SHAPE_ONLY or user.target in ("_operator.getitem", "view", "reshape"):
                todo.append(user.name)
    return min(bounds) if bounds else None


def _dtype(name: str):
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(name)
    return value


def tensor_from_meta(node, gen, device, *, high: int | None = None, scale: float = 1.0):
    """One tensor with ``node``'s recorded shape, dtype and stride, drawn from ``gen`` on the CPU
    and moved to ``device``. Raises BadInputError for symbolic or missing metadata."""
    import torch

    from graphdeck.errors import BadInputError

    shape, stride = node.shape, node.stride
    if not isinstance(shape, list) or (shape and isinstance(shape[0], list)):
        raise BadInputError(f"node {node.name!r}: no single-tensor metadata to synthesise an input from")
    if not all(isinstance(d, int) for d in shape):
        raise BadInputError(f"node {node.name!r}: symbolic shape {shape} (bind the sizes to replay it)")
    try:
        dtype = _dtype(node.dtype or "")
    except ValueError as exc:
        raise BadInputError(f"node {node.name!r}: unknown dtype {node.dtype!r}") from exc
    if dtype.is_floating_point or dtype.is_complex:
        values = (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype)
    elif dtype == torch.bool:
        values = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        values = torch.randint(0, max(1, high or 1), shape, generator=gen).to(dtype)
    if (isinstance(stride, list) and len(stride) == len(shape) and all(isinstance(s, int) and s > 0 for s in stride)
            and values.numel() > 0):
        out = torch.empty_strided(shape, stride, dtype=dtype)
        out.copy_(values)
        values = out
    return values.to(device)


def synth_inputs(stored, *, device: str = "cpu", seed: int = 0) -> list:
    """One tensor per placeholder of ``stored`` (graph order): see the module docstring; a SymInt
    placeholder gets its recorded value.

    Returns a list of ``torch.Tensor`` (and ints). Raises BadInputError naming a placeholder whose metadata
    is missing or symbolic."""
    import torch

    from graphdeck.errors import BadInputError

    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    out = []
    for n in stored.nodes:
        if n.op != "placeholder":
            continue
        if n.shape is None and n.value is not None:  # a SymInt input: its recorded value
            try:
                out.append(int(n.value))
                continue
            except ValueError:
                raise BadInputError(f"node {n.name!r}: non-tensor input {n.value!r} is not an int") from None
        high = None
        if n.dtype and not n.dtype.startswith(("float", "bfloat", "complex", "bool")):
            high = integer_bound(stored, n.name)
        out.append(tensor_from_meta(n, gen, dev, high=high, scale=0.02 if n.param_fqn else 1.0))
    return out
