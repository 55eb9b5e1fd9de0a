"""Where a gradient came from: the user's frames, checkpointed regions, compiled-autograd state,
and what a compiled graph's outputs reach — helpers of :mod:`graphdeck.capture.grad_evidence`
(see NOTE: [Gradient evidence] there, NOTE: [Steady mode] in grad_steady.py)."""

from __future__ import annotations

import os
import sys

import torch

_LIBRARY_MODULES = ("torch.", "graphdeck.")

def compiled_autograd_active() -> bool:
    """Whether the backward runs under compiled autograd now (its hooks are then traced into a
    graph or run where ``queue_callback`` is refused: the capture's hooks stand down)."""
    if torch.compiler.is_compiling():
        return True
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(ca is not None and (getattr(ca, "compiled_autograd_enabled", False)
                                    or getattr(ca, "in_compiled_autograd_region", False)))


_CA_CONFIG: list = []  # non-empty once a compile saw torch._dynamo.config.compiled_autograd on


def note_compiled_autograd_config() -> None:
    """At a compile (~1.5 µs: a config read): remember for good whether the job turned on
    ``torch._dynamo.config.compiled_autograd`` (NOTE: [Evidence under compiled autograd])."""
    try:
        if not _CA_CONFIG and torch._dynamo.config.compiled_autograd:
            _CA_CONFIG.append(True)
    except Exception:  # noqa: BLE001 - an unknown config layout: the other signals remain
        pass


def compiled_autograd_coming() -> bool:
    """Whether a backward may run under compiled autograd, as far as a forward can tell (~0.1 µs):
    the job turned ``torch._dynamo.config.compiled_autograd`` on (seen at a compile), the forward
    runs inside ``compiled_autograd._enable`` (torch's documented use: forward and backward under
    it), or compiled autograd already captured a backward (NOTE: [Evidence under compiled autograd])."""
    if _CA_CONFIG:
        return True
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(ca is not None and getattr(ca, "compiled_autograd_enabled", False)) or compiled_autograd_ran()


_CA_COUNTS: list = []  # Dynamo's counters["compiled_autograd"], looked up once


def compiled_autograd_ran() -> bool:
    """Whether compiled autograd captured a backward graph in this process."""
    try:
        if not _CA_COUNTS:
            from torch._dynamo.utils import counters

            _CA_COUNTS.append(counters["compiled_autograd"])
        return bool(_CA_COUNTS[0].get("captures"))
    except Exception:  # noqa: BLE001
        return False


def _task_id() -> int:
    try:
        return int(torch._C._current_graph_task_id())
    except Exception:  # noqa: BLE001 - older torch: one window per callback
        return -1


def _frame(n: int):
    """``sys._getframe(n)``, or None when the stack is shallower: a hook called by autograd's
    device thread (CUDA backward) has only a frame or two of Python above it."""
    try:
        return sys._getframe(n + 1)
    except ValueError:
        return None


_CURRENT_NODE = getattr(torch._C, "_current_autograd_node", None)


def _nested(limit: int = 400) -> bool:
    """Whether the caller runs inside an autograd Function's backward (a reentrant backward).
    The engine says first whether it is running a node on this thread at all (a callback of an
    outermost backward runs after its last node: none), without walking the stack."""
    if _CURRENT_NODE is not None:
        try:
            if _CURRENT_NODE() is None:
                return False
        except Exception:  # noqa: BLE001 - walk the stack instead
            pass
    f = _frame(2)
    apply = _APPLY
    while f is not None and limit:
        code = f.f_code
        hit = apply.get(id(code))
        if hit is None or hit[0] is not code:
            if len(apply) > _CODE_CACHE_MAX:
                apply.clear()
            hit = apply[id(code)] = (code, code.co_name == "apply" and code.co_filename.endswith(
                os.path.join("autograd", "function.py")))
        if hit[1]:
            return True
        f, limit = f.f_back, limit - 1
    return False


# Per code object, keyed by its id (hashing a code object hashes its bytecode and constants,
# ~1 µs; the entry keeps the code object, so an id is never reused while cached): (code, whether
# it is autograd.Function.apply (_nested) / library code (user_frames)). A frame walk then costs
# one int-keyed dict lookup per frame (NOTE: [Steady mode] in grad_steady.py).
_APPLY: dict = {}
_LIBRARY_CODE: dict = {}
_CODE_CACHE_MAX = 1 << 16  # entries; both caches are emptied when one grows past it


def user_frames(frame=None, limit: int = 60, depth: int = 1) -> tuple:
    """``((file, line, function), …)`` of the ``depth`` innermost frames outside torch and
    graphdeck (cheap: no source lines read; :func:`format_frames` makes the text)."""
    f = frame if frame is not None else sys._getframe(1)
    found: list[tuple] = []
    lib = _LIBRARY_CODE
    while f is not None and limit and len(found) < depth:
        code = f.f_code
        hit = lib.get(id(code))
        if hit is None or hit[0] is not code:
            if len(lib) > _CODE_CACHE_MAX:
                lib.clear()
            mod = f.f_globals.get("__name__") or ""
            hit = lib[id(code)] = (code, bool(mod.startswith(_LIBRARY_MODULES) or mod == "torch"
                                              or code.co_filename.startswith("<")))
        if not hit[1] and f.f_lineno != code.co_firstlineno:  # a compiled frame reports its `def` line
            found.append((code.co_filename, f.f_lineno, code.co_name))
        f, limit = f.f_back, limit - 1
    return tuple(found)


def format_frames(frames: tuple) -> str | None:
    """``"file.py:LINE in func: code ← caller.py:LINE in f: code"``."""
    import linecache

    out = []
    for fn, line, name in frames or ():
        code = linecache.getline(fn, line).strip()
        out.append(f"{fn}:{line} in {name}" + (f": {code}" if code else ""))
    return " ← ".join(out) or None


def user_site(frame=None, limit: int = 60, depth: int = 1) -> str | None:
    """``"file.py:LINE in func: code"`` of the innermost frame outside torch and graphdeck
    (``depth`` 2: that frame and its nearest user caller, joined by ``" ← "``)."""
    return format_frames(user_frames(frame if frame is not None else sys._getframe(1), limit, depth))


def _checkpoint_site(module_name=None, limit: int = 200) -> str | None:
    """The checkpointed function whose nested backward is running (reentrant checkpointing keeps
    it as ``ctx.run_function``), as ``"qualname (file.py:LINE)"``; a module as
    ``"name (Class.forward at file.py:LINE)"`` (``module_name(module) -> fqn | None``)."""
    f = _frame(2)
    while f is not None and limit:
        if f.f_code.co_name == "backward" and "checkpoint" in f.f_code.co_filename:
            fn = getattr(f.f_locals.get("ctx"), "run_function", None)
            if fn is None:
                return None
            if isinstance(fn, torch.nn.Module):
                code = getattr(type(fn).forward, "__code__", None)
                name = (module_name(fn) if module_name else None) or type(fn).__name__
                where = f" at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
                return f"{name} ({type(fn).__name__}.forward{where})"
            code = getattr(fn, "__code__", None)
            where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
            return f"{getattr(fn, '__qualname__', type(fn).__name__)}{where}"
        f, limit = f.f_back, limit - 1
    return None


class GraphInfo:
    """What the evidence needs of one compiled callable: ``key`` (its unsplit Dynamo graph),
    ``positions``/``names`` (argument positions and placeholder names of its parameter inputs),
    ``outputs`` (node name per output; ``None`` where the output is not one of the unsplit
    graph's) and ``reach`` (parameter placeholder name → names of the unsplit graph's outputs it
    reaches in the forward)."""

    __slots__ = ("key", "positions", "names", "outputs", "reach", "static_fqns", "single")

    def __init__(self, key: int, positions: list[int], names: list[str], outputs: list[str | None],
                 reach: dict[str, frozenset], static_fqns: tuple):
        self.key, self.positions, self.names, self.outputs, self.reach = key, positions, names, outputs, reach
        self.static_fqns = static_fqns
        #: One output of the unsplit graph: it cannot be skipped while another is used (the
        #: backward reaches it or not at all), so steady mode need not watch it (NOTE: [Steady mode]).
        self.single = sum(1 for n in outputs if n) == 1


def reach_of(gm: torch.fx.GraphModule) -> tuple[dict[str, frozenset], set[str]]:
    """(placeholder name → output node names it reaches, the set of output node names) of ``gm``:
    one reverse pass over the nodes with bitsets (``O(nodes + edges)`` big-int ORs)."""
    out_node = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    outs: list[str] = []
    if out_node is not None:
        for a in _flat(out_node.args):
            if isinstance(a, torch.fx.Node) and a.name not in outs:
                outs.append(a.name)
    bit = {name: 1 << i for i, name in enumerate(outs)}
    mask: dict[torch.fx.Node, int] = {}
    for n in reversed(gm.graph.nodes):
        m = bit.get(n.name, 0)
        for u in n.users:
            if u.op != "output":
                m |= mask.get(u, 0)
        mask[n] = m
    reach = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            m = mask.get(n, 0)
            reach[n.name] = frozenset(name for name, b in bit.items() if m & b)
    return reach, set(outs)


def _flat(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flat(e)]
    if isinstance(x, dict):
        return [y for e in x.values() for y in _flat(e)]
    return [x]


def _thread_site(thread: int | None) -> str | None:
    """The user frame the thread ``thread`` is in now (the one that called ``backward()`` while
    the engine's device threads run the hooks)."""
    if thread is None:
        return None
    frame = sys._current_frames().get(thread)
    return user_site(frame) if frame is not None else None


class Read(tuple):
    """``(GraphInfo, parameter names)`` a window read, one object per pair (interned by
    ``GradEvidence.observe_call``): sets of them hash and compare by identity, so a pre-hook adds
    one without hashing every name (on a launch-bound host each is a cache miss)."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other


def task_fills(task: int, cache: dict) -> bool:
    """Whether autograd task ``task`` accumulates into the parameter whose hook runs now (the
    engine will execute its ``AccumulateGrad`` node: ``backward()``; it raises for a leaf that
    ``torch.autograd.grad`` captures instead); ``cache``: task → answer, kept by the caller."""
    if task in cache:
        return cache[task]
    if len(cache) > 64:
        cache.clear()
    try:
        node = torch._C._current_autograd_node()
        result = node is None or bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # captured by autograd.grad: nothing accumulates in this task
        result = False
    except Exception:  # noqa: BLE001 - an engine that cannot tell: count the pass
        result = True
    cache[task] = result
    return result


def task_accumulates(task: int, leaves: tuple, cache: dict) -> bool:
    """Whether autograd task ``task`` (running now) accumulates into any of the parameters
    given as weak references (``leaves``: up to 4 trainable leaves of the call); ``cache``:
    task → answer, kept by the caller.

    # NOTE: [Backward passes that fill no .grad]
    # ``torch.autograd.grad`` (e.g. torch.distributed.pipelining's backward metadata inference
    # on its first step, gradient penalties) and ``backward(inputs=...)`` without the
    # parameters run a compiled graph's backward but accumulate into no parameter: counted,
    # such a pass would report every parameter as getting no gradient. The engine tells
    # whether a leaf's AccumulateGrad node runs in the current task
    # (``torch._C._will_engine_execute_node``; under autograd.grad it raises for a leaf it
    # captures instead: no accumulation either). Asked once per task in full mode; steady
    # mode (no per-parameter hooks) drops a window whose backward filled no watched ``.grad``
    # at all when it closes, which is what this answers for the passes that matter.
    """
    if task in cache:
        return cache[task]
    if len(cache) > 64:
        cache.clear()
    result = False
    from torch.autograd.graph import get_gradient_edge

    for ref in leaves:
        p = ref()
        if p is None:
            continue
        try:
            node = get_gradient_edge(p).node
        except Exception:  # noqa: BLE001 - an accumulator that cannot be had: count the pass
            result = True
            break
        try:
            if torch._C._will_engine_execute_node(node):
                result = True
                break
        except RuntimeError:  # autograd.grad capturing this leaf: nothing accumulates
            continue
        except Exception:  # noqa: BLE001 - an engine that cannot tell: count the pass, as before
            result = True
            break
    cache[task] = result
    return result
