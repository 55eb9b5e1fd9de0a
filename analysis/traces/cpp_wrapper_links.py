"""Kernel → post-grad node links of a C++ (CPU Inductor) output code, from the wrapper's dataflow.

# NOTE: [C++ kernels by wrapper dataflow]
A CPU Inductor wrapper's ``call()`` writes no source-node comment before a ``cpp_fused_*`` call,
and the comment before an extern call (``extern_kernels.mm``) lists the IR node's *origins*: the
matmul, the views feeding it, pointwise nodes inlined into its inputs (``le, where`` before the
``mm`` that reads ``where``'s buffer) and names of other graphs (``linear_2`` of the Dynamo graph,
``permute_6`` of the AOT graph). Reading those comments as the call's nodes linked a backward's
``cpp_fused_threshold_backward_*`` to GELU-backward nodes and ``aten::mm`` to nodes the graph lacks
(issue 40 item 3). What does name a call's nodes, in a plain TORCH_TRACE log too (no provenance
artifacts needed), is the wrapper's dataflow against the post-grad graph the code was made from:

* each wrapper buffer (``buf3``, a placeholder reused as ``buf10 = relu; del relu  # reuse``)
  holds a sequence of values, one per write (an extern call's ``out=``, a C++ kernel's non-const
  pointer argument, whose type the kernel's ``async_compile.cpp_pybinding([...])`` lists);
* an extern call computes one post-grad node of its op (``mm``): the one its comment names, else
  the one whose view-stripped arguments are the values the call reads, else the next one of its op
  and output shape in graph order; its arguments then name the values it reads (``mm(buf1, ...)``
  for ``mm(sub_2, permute_3)``: ``buf1`` holds ``sub_2``), and ``return (...)`` names the values
  of the graph's outputs by position;
* a C++ kernel computes the nodes between the values it writes and the values it reads: the
  backward closure of its known outputs in the graph, stopped at its inputs, placeholders,
  extern results and values other calls wrote. A kernel called twice (``cpp_fused_sum_2``) gets
  each call's own nodes.

Calls are keyed ``"<kernel>:<n>"``, ``n`` counting the wrapper's kernel calls from 1 (the numbering
of Inductor's debug handles), so two extern ``mm`` calls stay two call sites. Format source: the
wrapper code Inductor writes (``torch/_inductor/codegen/cpp_wrapper_cpu.py``/``wrapper.py``; read,
not copied); tested on torch 2.13 CPU logs.
"""

from __future__ import annotations

import ast
import re

_CPP_SIG = re.compile(r"^(\w+) = async_compile\.cpp(?:_pybinding)?\((\[[^\]]*\])", re.M)
_SOURCE = re.compile(r"^\s*# Topologically Sorted Source Nodes: \[(.*?)\]")
_ALLOC = re.compile(r"^\s*(\w+) = empty_strided_\w+\(\(([^)]*)\)")
_REUSE = re.compile(r"^\s*(\w+) = (\w+); del \2\b")
#: Ops that only re-view their first argument (the wrapper passes ``reinterpret_tensor(buf, ...)``).
VIEW_OPS = frozenset({"view", "reshape", "permute", "t", "transpose", "unsqueeze", "squeeze", "expand",
                      "_unsafe_view", "alias", "as_strided", "slice", "select", "_reshape_alias",
                      "view_as_real", "view_as_complex", "unfold", "diagonal", "squeeze_copy"})


def _op(target: str) -> str:
    """``aten.mm.default`` / ``torch.ops.aten.mm.default`` → ``mm``."""
    parts = str(target).removeprefix("torch.ops.").split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims") else parts[-1]


def _refs(arg) -> list[str]:
    """Node names referenced by a parsed FX argument (``{"node": name}``, nested lists/dicts)."""
    if isinstance(arg, dict):
        if "node" in arg and len(arg) == 1:
            return [arg["node"]]
        return [r for v in arg.values() for r in _refs(v)]
    if isinstance(arg, (list, tuple)):
        return [r for v in arg for r in _refs(v)]
    return []


class _Value:
    """One value a wrapper buffer holds between two writes: the post-grad node, once known."""
    __slots__ = ("node", "writer", "shape")

    def __init__(self, node: str | None = None, writer: int | None = None, shape: tuple | None = None):
        self.node, self.writer, self.shape = node, writer, shape


def cpp_wrapper_links(code: str, nodes: list, outputs: list[str | None]) -> list[tuple[str, list[str]]] | None:
    """``[("<kernel>:<call n>", [post-grad node names, graph order]), ...]`` for the kernel calls of
    one C++ wrapper's ``call()`` (``code``: an ``inductor_output_code`` payload) against the graph
    it was made from (``nodes``: its ``graphdeck.store.fx_text.TextNode`` list; ``outputs``: its
    output node names by position). Every name returned is a node of that graph. Calls whose
    nodes the dataflow does not name are left out. ``None`` when ``code`` is no C++ wrapper (no
    ``async_compile.cpp*`` kernel or no ``def call(``); never raises on odd text.
    NOTE: [C++ kernels by wrapper dataflow]."""
    start = code.find("def call(")
    sigs: dict[str, list[bool]] = {}
    for name, types in _CPP_SIG.findall(code, 0, max(start, 0)):
        try:
            sigs[name] = [str(t).startswith("const") for t in ast.literal_eval(types) if str(t).endswith("*")]
        except (ValueError, SyntaxError):
            continue
    if start < 0 or not sigs:
        return None
    by_name = {n.name: n for n in nodes}
    order = {n.name: i for i, n in enumerate(nodes)}

    def base(name: str | None) -> str | None:
        seen = 0
        while name in by_name and _op(by_name[name].target) in VIEW_OPS and seen < 100:
            refs = _refs(by_name[name].args[:1])
            if not refs:
                break
            name, seen = refs[0], seen + 1
        return name

    current: dict[str, _Value] = {}  # wrapper name → the value it holds now

    def read(name: str) -> _Value:
        if name not in current:
            current[name] = _Value(name if name in by_name else None)
        return current[name]

    calls: list[dict] = []
    comment: list[str] = []
    final: list | None = None
    for line in code[start:].splitlines()[1:]:
        if line.startswith(("def ", "class ", "runner", "call =")) or (line and not line[0].isspace()):
            break
        m = _SOURCE.match(line)
        if m:
            comment = [x.strip() for x in m.group(1).split(",") if x.strip()]
            continue
        m = _REUSE.match(line)
        if m:
            current[m.group(1)] = read(m.group(2))
            continue
        m = _ALLOC.match(line)
        if m:
            try:
                shape = tuple(int(x) for x in m.group(2).split(",") if x.strip())
            except ValueError:
                shape = None
            current[m.group(1)] = _Value(shape=shape)
            continue
        text = line.strip()
        if text.startswith("return "):
            try:
                tree = ast.parse(text[len("return "):], mode="eval").body
            except SyntaxError:
                continue
            final = list(tree.elts) if isinstance(tree, ast.Tuple) else [tree]
            break
        try:
            tree = ast.parse(text, mode="exec").body
        except SyntaxError:
            continue
        if len(tree) != 1:
            continue
        stmt = tree[0]
        lhs = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            lhs, call = stmt.targets[0].id, stmt.value
        elif isinstance(stmt, ast.Expr):
            call = stmt.value
        else:
            continue
        if not isinstance(call, ast.Call):
            continue
        fn = ast.unparse(call.func)
        if fn in sigs:
            args = [_tensor_name(a) for a in call.args]
            consts = sigs[fn]
            reads, writes = [], []
            ptr = [a for a in args]  # pointer args are in signature order; scalars carry no name
            for i, a in enumerate(ptr[:len(consts)]):
                if a is None:
                    continue
                v = read(a)
                reads.append(v)
                if not consts[i]:
                    w = _Value(writer=len(calls), shape=v.shape)
                    current[a] = w
                    writes.append(w)
            calls.append({"kind": "cpp", "name": fn, "reads": reads, "writes": writes})
        elif fn.startswith("extern_kernels.") or fn.startswith("torch.ops."):
            op = _op(fn.removeprefix("extern_kernels."))
            args = [_tensor_name(a) for a in call.args]
            reads = [read(a) if a else None for a in args]
            out = next((_tensor_name(k.value) for k in call.keywords if k.arg == "out"), None) or lhs
            w = None
            if out:
                prev = current.get(out)
                w = _Value(writer=len(calls), shape=prev.shape if prev else None)
                current[out] = w
            calls.append({"kind": "extern", "name": fn, "op": op, "reads": reads, "writes": [w] if w else [],
                          "comment": comment})
        else:
            continue
        comment = []

    # the graph's outputs name the values ``return (...)`` hands back, by position
    for pos, elt in enumerate(final or []):
        name = _tensor_name(elt)
        if name and pos < len(outputs) and outputs[pos] and name in current and current[name].node is None:
            current[name].node = base(outputs[pos])

    # extern calls: which node of their op each computes, and what their arguments hold
    taken: set[str] = set()
    for c in calls:
        if c["kind"] != "extern":
            continue
        cands = [n for n in nodes if n.op == "call_function" and _op(n.target) == c["op"] and n.name not in taken]
        if not cands:
            continue
        shape = c["writes"][0].shape if c["writes"] else None

        def score(n, c=c, shape=shape):
            args = [base((_refs(a)[:1] or [None])[0]) for a in n.args]
            hits = sum(1 for v, a in zip(c["reads"], args) if v is not None and v.node and v.node == a)
            return (4 * (n.name in c["comment"]) + 2 * hits + (shape is not None and tuple(n.shape or ()) == shape),
                    -order[n.name])
        best = max(cands, key=score)
        taken.add(best.name)
        c["node"] = best.name
        if c["writes"]:
            c["writes"][0].node = best.name
        node_args = [(_refs(a)[:1] or [None])[0] for a in best.args]
        for v, a in zip(c["reads"], node_args):
            if v is not None and v.node is None and a is not None:
                v.node = base(a)

    # C++ kernels: the closure between the values they write and those they read
    placeholders = {n.name for n in nodes if n.op != "call_function"}
    written = {v.node: i for i, c in enumerate(calls) for v in c["writes"] if v.node}
    out: list[tuple[str, list[str]]] = []
    for i, c in enumerate(calls):
        key = f"{c['name']}:{i + 1}"
        if c["kind"] == "extern":
            if c.get("node"):
                views = []
                for a in by_name[c["node"]].args:
                    for r in _refs(a)[:1]:
                        while r in by_name and _op(by_name[r].target) in VIEW_OPS:
                            views.append(r)
                            r = (_refs(by_name[r].args[:1]) or [None])[0]
                out.append((key, sorted({c["node"], *views}, key=order.get)))
            continue
        mine = {v.node for v in c["writes"] if v.node}
        stop = {v.node for v in c["reads"] if v.node} | placeholders | taken
        stop |= {n for n, j in written.items() if j != i}
        got: set[str] = set()
        todo = list(mine)
        while todo:
            n = todo.pop()
            if n in got or n not in by_name or (n in stop and n not in mine):
                continue
            if by_name[n].op != "call_function":
                continue
            got.add(n)
            todo.extend(r for a in by_name[n].args for r in _refs(a))
            todo.extend(r for a in (by_name[n].kwargs or {}).values() for r in _refs(a))
        if got:
            out.append((key, sorted(got, key=order.get)))
    return out


def _tensor_name(tree: ast.AST) -> str | None:
    """The wrapper name a call argument reads: ``buf1``, ``reinterpret_tensor(buf1, ...)`` → ``buf1``."""
    if isinstance(tree, ast.Name):
        return tree.id
    if isinstance(tree, ast.Call) and ast.unparse(tree.func) in ("reinterpret_tensor", "as_strided") and tree.args:
        return _tensor_name(tree.args[0])
    return None
