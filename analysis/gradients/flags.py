"""Graph-only flags: patterns in a captured Dynamo graph that silently change gradients, seen from
the graph alone (no run-time facts needed).

* ``INPLACE_ON_DETACHED_ALIAS`` (warning): in a training forward (a graph with an AOT backward),
  an in-place op run with grad enabled writes into a graph input that requires grad (a parameter,
  or an input its AOT backward has a gradient slot for) through a ``.detach()``/``.data`` alias
  of it (``p.data.mul_(0.5)``: autograd does not record the write), or writes into the input
  itself after a detached alias was taken and the alias is read after the write
  (``y = x.detach(); x.add_(1)``: ``detach()`` shares storage, so ``y`` reads the new value).
  Optimizer steps and evaluations (no backward, or compiled with grad off) are not checked.
* ``GRAD_ENABLED_IN_INFERENCE_GRAPH`` (error): a ``_set_grad_enabled(True)`` region inside a Dynamo
  graph whose caller had grad mode off (the capture's ``meta_json["grad_enabled"]``; else Dynamo's
  first grad-mode node turning grad on, since Dynamo emits one only on a change), where a value
  computed in the region from an input that requires grad is written in place into a graph input
  (eagerly autograd records the write and the input gets a ``grad_fn``; compiled, AOTAutograd
  applies the write without recording it and the input gets none: checked on torch 2.13), or,
  when AOTAutograd compiled the graph as an inference graph (``aot_inference``, no backward),
  reaches a graph output (which then has no backward). A region whose values are returned
  normally is not flagged: AOTAutograd builds a training graph for it (torch 2.13).

Node positions, not names, identify placeholders: the ``k``-th placeholder of a Dynamo graph is
AOTAutograd's ``PlainAOTInput(idx=k)``. Cost: ``O(nodes + edges)`` per graph holding both kinds of
nodes a flag needs, found with one query on the interned op names.
"""

from __future__ import annotations

import linecache
import re
from typing import Callable

from graphdeck.analysis.gradients.cuts import DETACH_TARGETS, GRAD_MODE_TARGETS, _enclosing, frames, short_source
from graphdeck.analysis.gradients.nodes import (
    RunGraphs,
    differentiable,
    fetch,
    grad_sources,
    graphs_with,
    node_args,
    op_base,
    where,
)
from graphdeck.analysis.gradients.report import Finding

_INPLACE_RE = re.compile(r"^_?[a-z][a-z0-9_]*[a-z0-9]_$")
NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_", "record_stream_", "pin_memory_"})
AUGMENTED = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "ipow", "imod", "iand", "ior", "ixor",
                       "setitem", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__setitem__"})
#: Ops whose result shares storage with their first argument.
VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "alias", "expand", "t", "transpose", "permute", "squeeze",
                      "unsqueeze", "view_as", "flatten", "unflatten", "narrow", "select", "slice", "getitem",
                      "as_strided", "diagonal", "unfold", "movedim", "swapaxes", "split", "chunk", "unbind", "T",
                      "mT", "real", "imag", "view_as_real", "view_as_complex"})
DETACH_BASES = frozenset({"detach", "_get_data_attr", "data"})
_ENABLE_RE = re.compile(r"^\s*(with|@)\s*.*\b(enable_grad|set_grad_enabled\s*\(\s*True)")
LIMIT_PER_GRAPH = 8


def is_inplace(target: str | None) -> bool:
    """An op that writes into its first argument: ``add_``, ``torch.Tensor.copy_``,
    ``aten.mul_.Tensor``, ``operator.iadd``, ``setitem`` (not ``requires_grad_``)."""
    b = op_base(target)
    return b in AUGMENTED or (bool(_INPLACE_RE.match(b)) and b not in NOT_WRITES)


def is_detach(target: str | None) -> bool:
    return (target or "") in DETACH_TARGETS or op_base(target) in DETACH_BASES


def _first_args(graphs: RunGraphs, gid: int) -> dict[int, int]:
    """Node → the node that is its first argument (``edges.arg_pos`` 0)."""
    return {dst: src for dst, src in fetch(graphs.session, "SELECT dst_idx, src_idx FROM edges WHERE graph_id = ? "
                                                           "AND arg_pos = 0", (gid,))}


def _aliases(flow, start: int, first: dict[int, int]) -> dict[int, int | None]:
    """Nodes sharing storage with node ``start`` → the detach/``.data`` node on the way (``None``
    when reached through views and in-place results only)."""
    out: dict[int, int | None] = {start: None}
    stack = [start]
    while stack:
        j = stack.pop()
        for u in flow.users[j]:
            if u in out or flow.ops[u] == "output" or first.get(u) != j:
                continue
            t = flow.targets[u]
            if is_detach(t):
                out[u] = u
            elif op_base(t) in VIEW_OPS or is_inplace(t):
                out[u] = out[j]
            else:
                continue
            stack.append(u)
    return out


def flag_findings(graphs: RunGraphs, flow_of: Callable, strings, row_of) -> list[Finding]:
    """Both flags over every Dynamo graph of the run (see the module docstring)."""
    out = []
    writes = graphs_with(graphs, is_inplace, ("%\\_", "%iadd%", "%isub%", "%imul%", "%idiv%", "%setitem%"))
    detached = graphs_with(graphs, is_detach, ("%detach%", "%data%"))
    modes = graphs_with(graphs, lambda v: v in GRAD_MODE_TARGETS, ("%set_grad_enabled%",))
    for g in graphs.of_kind("dynamo"):
        if g.id in writes and g.id in detached and _trains(graphs, g):
            out += _inplace_on_detached(graphs, flow_of(g.id), strings, row_of)
        if g.id in writes and g.id in modes or g.id in modes and graphs.child(g.id, "aot_inference"):
            out += _grad_enabled_regions(graphs, flow_of(g.id), strings, row_of)
    return out


def _trains(graphs: RunGraphs, g) -> bool:
    """Whether ``g`` is a training forward: it has an AOT backward, or (no AOT graph recorded) it
    was not compiled with grad mode off. An optimizer step or an evaluation is not."""
    if graphs.child(g.id, "aot_backward"):
        return True
    return not graphs.child(g.id, "aot_inference") and g.meta.get("grad_enabled") is not False


def _who(graphs: RunGraphs, lg, i: int) -> str:
    fqn = graphs.param_in.get(lg.graph_id, {}).get(lg.flow.names[i])
    return f"parameter {fqn}" if fqn else f"input {lg.flow.names[i]}"


def _inplace_on_detached(graphs: RunGraphs, lg, strings, row_of) -> list[Finding]:
    flow = lg.flow
    first = _first_args(graphs, lg.graph_id)
    rank = graphs.by_id[lg.graph_id].rank
    out: list[Finding] = []
    for r in sorted(grad_sources(graphs, lg, row_of)):
        alias = _aliases(flow, r, first)
        detaches = sorted({d for d in alias.values() if d is not None})
        if not detaches:
            continue
        for a, via in sorted(alias.items()):
            for u in flow.users[a]:
                if first.get(u) != a or not is_inplace(flow.targets[u]) or flow.grad_off[u]:
                    continue  # a write under no_grad inside the graph is an update, not a forward's
                op = flow.targets[u]
                src, code = where(lg, strings, u)
                at = f" at {src}" + (f" ({code})" if code else "") if src else ""
                if via is not None:
                    d_src, _ = where(lg, strings, via)
                    message = (f"{op} (node {flow.names[u]}){at} writes in place into {_who(graphs, lg, r)}, which "
                               f"requires grad, through its detached alias {flow.names[via]} ({flow.targets[via]}"
                               f"{' at ' + d_src if d_src else ''}): autograd does not record a write made through "
                               "the alias, so no gradient flows through it, and backward uses whatever the "
                               "tensor holds when it runs")
                else:
                    # A detached alias taken before the write and read after it sees the new value.
                    late = [d for d in detaches if d < u and any(
                        v > u for x, dv in alias.items() if dv == d for v in flow.users[x])]
                    if not late:
                        continue
                    d = late[0]
                    d_src, _ = where(lg, strings, d)
                    message = (f"{op} (node {flow.names[u]}){at} writes in place into {_who(graphs, lg, r)}, which "
                               f"requires grad, after {flow.names[d]} took a detached alias of it"
                               f"{' at ' + d_src if d_src else ''} that is read after the write: detach() shares "
                               "storage, so the alias reads the new value, not a snapshot")
                out.append(Finding(kind="INPLACE_ON_DETACHED_ALIAS", severity="warning", graph_id=lg.graph_id,
                                   node=flow.names[u], source=src, ranks=[rank],
                                   params=[p] if (p := graphs.param_in.get(lg.graph_id, {}).get(flow.names[r])) else [],
                                   message=message,
                                   fix="take a snapshot with .detach().clone(); change parameters outside the "
                                       "forward under torch.no_grad() (as an optimizer step does), not through "
                                       ".data or a detached alias"))
    return out[:LIMIT_PER_GRAPH]


def _grad_enabled_regions(graphs: RunGraphs, lg, strings, row_of) -> list[Finding]:
    flow = lg.flow
    g = graphs.by_id[lg.graph_id]
    mode_nodes = [i for i, t in enumerate(flow.targets) if t in GRAD_MODE_TARGETS]
    if not mode_nodes:
        return []
    args = node_args(graphs.session, g.id, mode_nodes)
    flags = {i: (bool(a[0]) if a and isinstance(a[0], (bool, int)) else None) for i, a in args.items()}
    entry = g.meta.get("grad_enabled")
    if entry is None:  # Dynamo emits a grad-mode node only on a change
        first_flag = flags.get(mode_nodes[0])
        entry = None if first_flag is None else not first_flag
    if entry is not False:
        return []
    inference = bool(graphs.child(g.id, "aot_inference")) and not graphs.child(g.id, "aot_backward")
    # Grad mode at each node, and the _set_grad_enabled(True) node that opened it.
    opened: list[int | None] = [None] * len(flow)
    mode, opener = False, None
    for i in range(len(flow)):
        if i in flags:
            if flags[i] and not mode:
                opener = i
            mode = bool(flags[i]) if flags[i] is not None else mode
            if not mode:
                opener = None
            continue
        opened[i] = opener if mode else None
    sources = grad_sources(graphs, lg, row_of)
    carries = [False] * len(flow)
    origin: list[set] = [set() for _ in flow.names]
    params = graphs.param_in.get(g.id, {})
    for i in sources:
        carries[i] = True
        origin[i].add(params.get(flow.names[i], f"input {flow.names[i]}"))
    first = _first_args(graphs, g.id)
    for i in range(len(flow)):
        if not carries[i] or flow.ops[i] == "output":
            continue
        for u in flow.users[i]:
            if opened[u] is None or is_detach(flow.targets[u]) or not differentiable(flow, u):
                continue
            if is_inplace(flow.targets[u]) and first.get(u) == i:
                continue  # the written tensor does not make the written value carry
            carries[u] = True
            origin[u] |= origin[i]
    input_alias: dict[int, int] = {}
    for p in (i for i, op in enumerate(flow.ops) if op == "placeholder"):
        for a in _aliases(flow, p, first):
            input_alias.setdefault(a, p)
    rank = g.rank
    out: list[Finding] = []
    for u in range(len(flow)):
        if opened[u] is None:
            continue
        target = first.get(u)
        if is_inplace(flow.targets[u]) and target in input_alias and carries[u]:
            what = (f"writes a value computed with grad enabled from {', '.join(sorted(origin[u]))} into "
                    f"{_who(graphs, lg, input_alias[target])} (a graph input)")
            effect = ("eagerly autograd records the write and the input gets a grad_fn; compiled, AOTAutograd "
                      "applies the write without recording it and the input gets none, so no gradient reaches "
                      f"{', '.join(sorted(origin[u]))} through it")
        elif inference and carries[u] and any(flow.ops[v] == "output" for v in flow.users[u]):
            what = f"computes output {flow.names[u]} with grad enabled from {', '.join(sorted(origin[u]))}"
            effect = ("the graph was compiled as an inference graph (no backward): the output has no grad_fn, "
                      f"so no gradient reaches {', '.join(sorted(origin[u]))} through it")
        else:
            continue
        op = flow.targets[u]
        src, code = where(lg, strings, u)
        region = _enable_line(strings.get(lg.stack_ids[u]))
        out.append(Finding(
            kind="GRAD_ENABLED_IN_INFERENCE_GRAPH", severity="error", graph_id=g.id, node=flow.names[u], source=src,
            ranks=[rank], params=sorted(o for o in origin[u] if not o.startswith("input ")),
            message=(f"{op} (node {flow.names[u]}){' at ' + src if src else ''}{f' ({code})' if code else ''}, inside "
                     f"the grad-enabled region opened by node {flow.names[opened[u]]} (_set_grad_enabled(True)"
                     f"{', the enable_grad at ' + region if region else ''}) of graph {g.id}, {what}; the graph was "
                     f"compiled with grad mode off (the caller's no_grad): {effect}"),
            fix="call the compiled function with grad enabled, or do the write outside it (return the value and "
                "copy it in the caller under enable_grad)"))
    return out[:LIMIT_PER_GRAPH]


def _enable_line(stack: str | None, search_lines: int = 40) -> str | None:
    """``"file.py:LINE"`` of the ``with torch.enable_grad():`` (or ``set_grad_enabled(True)``,
    ``@torch.enable_grad()``) enclosing the innermost frame of ``stack`` (read with linecache)."""
    for file, line, _fn in reversed(frames(stack)):
        for k, text in _enclosing(file, line, search_lines):
            if _ENABLE_RE.match(text):
                return short_source(file, k)
            if text.lstrip().startswith(("def ", "async def ")) and _ENABLE_RE.match(linecache.getline(file, k - 1)):
                return short_source(file, k - 1)
    return None

