"""Cut-point search on a forward data-flow graph: where does gradient flow from a parameter stop?

Both modes build a :class:`FlowGraph` (graph mode from a stored Dynamo graph, eager mode from the
ops recorded while the module ran) and ask two questions:

* :func:`live_mask` — which nodes carry gradient to a live output (one reverse sweep over the
  nodes in topological order, O(nodes + edges)); a parameter's ``paths`` are its consumers that
  are live.
* :func:`first_cut` — for a parameter with no live consumer, the first op on its forward data
  path where flow stops (breadth-first in graph order; the cut with the smallest position wins),
  with the path to it.

# NOTE: [What cuts gradient flow]
# An op cuts the flow from its inputs when (1) it is ``detach``/``.data`` (Dynamo records
# ``.data`` as ``torch._C._autograd._get_data_attr``), (2) it runs with grad mode off (Dynamo
# brackets such regions with ``torch._C._set_grad_enabled(False)`` … ``(True)`` nodes, which
# carry no stack trace themselves), (3) its output is not floating point (``argmax``,
# comparisons, ``.long()``: integer tensors have no gradient), or (4) its output is not a tensor
# (``size()``). A path that survives all of these but ends in a graph output that got no
# gradient in the first backward (``dead``) or in an op nobody uses is a dead end.
"""

from __future__ import annotations

import heapq
import linecache
import re
from dataclasses import dataclass, field

DETACH_TARGETS = ("detach", "detach_", "aten.detach.default", "torch.Tensor.detach", "_get_data_attr",
                  "torch._C._autograd._get_data_attr", "Tensor.data.__get__", "data")
GRAD_MODE_TARGETS = ("torch._C._set_grad_enabled", "_set_grad_enabled", "torch.autograd.grad_mode._set_grad_enabled")
DIFFERENTIABLE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128",
                                   "float8_e4m3fn", "float8_e5m2", "half", "float", "double"})

#: cut kinds, strongest explanation first (when a parameter hits several, the earliest of the
#: strongest kind is reported).
CUT_ORDER = ("detach", "no_grad", "integer_output", "non_differentiable", "dead_output", "unused_result")


@dataclass
class FlowGraph:
    """Parallel lists, one entry per node in topological order. ``tensor[i]``: the output is a
    tensor (``None``: unknown, treated as a tensor); ``dtype`` as torch prints it without
    ``torch.``; ``grad_off[i]``: the op ran with grad mode off; ``source[i]``: the user frame
    (``'File "x.py", line N, in f'``); ``dead``: nodes whose value is a graph output that got no
    gradient; ``cut_override``: eager mode's own verdict per node (``None``: use the rules)."""

    names: list[str]
    ops: list[str]
    targets: list[str]
    dtypes: list[str | None]
    tensor: list[bool | None]
    users: list[list[int]]
    grad_off: list[bool]
    source: list[str | None]
    modules: list[str | None]
    dead: set[int] = field(default_factory=set)
    cut_override: dict[int, str | None] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.names)


def grad_off_mask(ops: list[str], targets: list[str], grad_args: dict[int, bool | None]) -> list[bool]:
    """Grad mode per node from Dynamo's ``_set_grad_enabled(flag)`` nodes (``grad_args[i]`` is the
    flag of such a node ``i``), starting enabled (a training step)."""
    enabled = True
    out = []
    for i, t in enumerate(targets):
        if i in grad_args:
            flag = grad_args[i]
            enabled = True if flag is None else bool(flag)
            out.append(False)
            continue
        out.append(not enabled and ops[i] not in ("placeholder", "output", "get_attr"))
    return out


def cut_kind(g: FlowGraph, i: int) -> str | None:
    """Why node ``i`` stops gradient flow from its inputs, or ``None`` when it lets it through."""
    if i in g.cut_override:
        return g.cut_override[i]
    op = g.ops[i]
    if op in ("placeholder", "output", "get_attr"):
        return None
    if g.targets[i] in GRAD_MODE_TARGETS:
        return "non_differentiable"
    if g.targets[i] in DETACH_TARGETS:
        return "detach"
    if g.grad_off[i]:
        return "no_grad"
    if g.tensor[i] is False:
        return "non_differentiable"
    dtype = g.dtypes[i]
    if dtype is not None and dtype not in DIFFERENTIABLE_DTYPES:
        return "integer_output"
    return None


def live_mask(g: FlowGraph) -> list[bool]:
    """``live[i]``: gradient from a live output reaches node ``i``'s inputs through ``i``."""
    n = len(g)
    live = [False] * n
    ops, users, dead = g.ops, g.users, g.dead
    for i in range(n - 1, -1, -1):
        if ops[i] == "output" or cut_kind(g, i) is not None:
            continue
        for u in users[i]:
            if ops[u] == "output":
                if i not in dead:
                    live[i] = True
                    break
            elif live[u]:
                live[i] = True
                break
    return live


@dataclass
class CutResult:
    kind: str
    node: int  # index of the cut node (for dead_output: the node feeding the dead output)
    path: list[int]
    outputs_reached: list[int] = field(default_factory=list)


def first_cut(g: FlowGraph, start: int, live: list[bool] | None = None) -> CutResult | None:
    """From node ``start`` (a parameter's placeholder), the first op where gradient flow stops.

    Breadth-first in graph order over non-cut nodes; returns ``None`` when a live node is reached
    (the parameter has a gradient path) or nothing at all consumes ``start``.
    """
    parent: dict[int, int] = {}
    seen = {start}
    heap = [start]
    found: dict[str, int] = {}
    dead_reached: list[int] = []
    while heap:
        i = heapq.heappop(heap)
        if i != start:
            if live is not None and live[i]:
                return None
            kind = cut_kind(g, i)
            if kind is not None:
                found.setdefault(kind, i)
                continue
            if not g.users[i]:
                found.setdefault("unused_result", i)
        for u in g.users[i]:
            if g.ops[u] == "output":
                if i in g.dead:
                    dead_reached.append(i)
                    found.setdefault("dead_output", i)
                else:
                    return None  # a live output: no cut
                continue
            if u not in seen:
                seen.add(u)
                parent[u] = i
                heapq.heappush(heap, u)
    for kind in CUT_ORDER:
        if kind in found:
            node = found[kind]
            path = [node]
            while path[-1] in parent:
                path.append(parent[path[-1]])
            return CutResult(kind=kind, node=node, path=path[::-1], outputs_reached=dead_reached)
    return None


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)(?:, in (\S+))?')
_NO_GRAD_RE = re.compile(r"^\s*(with|@)\s*.*\b(no_grad|inference_mode|set_grad_enabled\s*\(\s*False)")


def frames(stack_trace: str | None) -> list[tuple[str, int, str | None]]:
    """``(file, line, function)`` of each ``File "...", line N, in f`` line, outermost first."""
    if not stack_trace:
        return []
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in _FRAME_RE.finditer(stack_trace)]


def short_source(file: str, line: int) -> str:
    return f"{file.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line}"


def source_line(file: str, line: int) -> str | None:
    text = linecache.getline(file, line).strip()
    return text or None


def _enclosing(file: str, line: int, search_lines: int):
    """``(line number, text)`` of each line opening a block that encloses ``file:line`` (less
    indented, read with ``linecache``), innermost first, up to and including the enclosing
    ``def``/``class`` line, looking at most ``search_lines`` lines up."""
    here = linecache.getline(file, line)
    if not here:
        return
    indent = len(here) - len(here.lstrip())
    for k in range(line - 1, max(0, line - search_lines), -1):
        text = linecache.getline(file, k)
        if not text.strip():
            continue
        ind = len(text) - len(text.lstrip())
        if ind < indent:
            yield k, text
            if text.lstrip().startswith(("def ", "async def ", "class ")):
                return
            indent = ind


def no_grad_region(stack_trace: str | None, search_lines: int = 40) -> str | None:
    """The ``with torch.no_grad():`` (or ``inference_mode``, ``set_grad_enabled(False)``,
    ``@torch.no_grad()``) line enclosing a frame of ``stack_trace``, innermost frame first, as
    ``"file.py:LINE"``. Read from the source file (``linecache``); ``None`` when it is not found
    within ``search_lines`` lines above the frame's line in the same function."""
    for file, line, _fn in reversed(frames(stack_trace)):
        for k, text in _enclosing(file, line, search_lines):
            if _NO_GRAD_RE.match(text):
                return short_source(file, k)
            if text.lstrip().startswith(("def ", "async def ", "class ")):
                # a decorator directly above the def
                if _NO_GRAD_RE.match(linecache.getline(file, k - 1) or ""):
                    return short_source(file, k - 1)
    return None


_BRANCH_RE = re.compile(r"^\s*(if|elif|while|for)\b")


def enclosing_branch(frame_text: str | None, search_lines: int = 40) -> str | None:
    """``"file.py:LINE: if …:"`` of the ``if``/``elif``/``while``/``for`` statement that encloses
    the last frame of ``frame_text`` (read with ``linecache``), or ``None``."""
    fr = frames(frame_text)
    if not fr:
        return None
    file, line, _fn = fr[-1]
    for k, text in _enclosing(file, line, search_lines):
        if _BRANCH_RE.match(text):
            return f"{short_source(file, k)}: {text.strip()}"
    return None
