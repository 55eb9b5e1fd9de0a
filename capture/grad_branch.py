"""The loss code that skipped an output: the Python branch that decided a model output would not
reach the loss in this backward (NOTE: [The branch that skipped an output]).

# NOTE: [The branch that skipped an output]
When a backward leaves parameters with no gradient (eager) or an all-zero one (a compiled graph's
output the loss skipped), the evidence names ``backward()`` and the model call; the decision was
made in between, in the loss code (``if fg_mask.sum():``, ``if not mask.any(): continue``, in a
helper the loss calls). At the end of such a backward (rare; cached per code location) this
module finds it from the live Python frames:

1. *Which variable holds the skipped output.* The user frames from the ``backward()`` caller
   outwards are searched for a local (or one level into a tuple, list, dict or object attribute)
   holding it: for a compiled graph, the output tensor whose ``grad_fn``/``output_nr`` is the one
   whose gradient came back None (its identity was kept at the forward); for eager code, a tensor
   whose autograd graph reaches a parameter that got no gradient (bounded walk of
   ``next_functions`` to ``AccumulateGrad`` nodes; the graph not run by the backward is intact).
2. *Where it stopped being used.* From that frame's code up to its current line, and into the
   user functions called with it (resolved through the frame's locals and globals, then each
   function's globals; 4 levels), the variable and what is assigned from it are followed in
   source order. The first use that sits under a branch is the answer, the innermost: a branch arm
   that holds the use but not the frame's current line (``branch_in_source`` of the hang report,
   ``analysis/ranks/hangs.py``), or an earlier ``if …: continue/break/return/raise`` of the same
   block. Uses in ``print``/``log`` calls do not count.

The answer is ``"file:line in fn: `if …:`"`` (the hang report's form), or None when no frame holds
the output, the source is not readable, or no branch guards a use (then nothing is claimed).
"""

from __future__ import annotations

import ast
import builtins
import linecache
import os
import sys

import torch

_LIB = ("torch", "graphdeck")
_EXITS = (ast.Continue, ast.Break, ast.Return, ast.Raise)
_QUIET = ("print", "log", "info", "debug", "warn", "warning", "write", "add_scalar")
_MAX_DEPTH = 4
_WALK_LIMIT = 4000
_trees: dict[str, ast.AST | None] = {}


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_cache: dict[tuple, str | None] = {}


def _is_user(code) -> bool:
    f = code.co_filename
    return not f.startswith(("<", _TORCH_DIR)) and f.endswith(".py")


def _user_frame(frame) -> bool:
    mod = frame.f_globals.get("__name__") or ""
    return not (mod == "torch" or mod.startswith(("torch.", "graphdeck."))) and _is_user(frame.f_code)


def skip_branch(frame, dead: set[tuple[int, int]], bad_params: list, site: tuple = ()) -> str | None:
    """The branch that skipped an output (NOTE: [The branch that skipped an output]) from the
    frames at and above ``frame`` (the capture's own frame at the end of a backward).
    ``dead``: ``(id(grad_fn), output_nr)`` of compiled outputs whose gradient came back None;
    ``bad_params``: parameters that got no gradient; ``site``: ``((file, line, fn), …)`` of the
    compiled call that made the outputs, when known. Returns ``"file:line in fn: `text`"`` or
    None; never raises (the capture never breaks training: nothing is claimed then)."""
    touched: list = []
    try:
        return _skip_branch(frame, dead, {id(p) for p in bad_params if p is not None}, site, touched)
    except Exception:  # noqa: BLE001
        return None
    finally:
        _release(touched)


def _locals(f, touched: list) -> dict:
    """A copy of frame ``f``'s locals. Reading ``f_locals`` (Python < 3.13) leaves a snapshot
    dict on the frame that keeps every value alive until the frame ends, even after the function
    drops it (a replaced parameter, a deleted optimizer, the step's outputs): :func:`_release`
    empties it again."""
    touched.append(f)
    return dict(f.f_locals)


def _release(frames: list) -> None:
    """Empty the ``f_locals`` snapshots read by :func:`_locals`, on function frames only (a
    module's ``f_locals`` is its globals) and only while no Python trace function runs (a tracer
    writes the snapshot back into the frame's variables after each event)."""
    if sys.version_info >= (3, 13) or sys.gettrace() is not None:
        return
    for f in frames:
        if f.f_code.co_flags & 0x01 and f.f_trace is None:  # CO_OPTIMIZED: a function's frame
            d = f.f_locals
            if not any(v is d for v in d.values()):  # ``kw = locals()`` in the job: that dict is the job's
                d.clear()


def _skip_branch(frame, dead, bad: set[int], site: tuple, touched: list) -> str | None:
    f, n, first = frame, 0, None
    while f is not None and n < 8:
        if _user_frame(f):
            n += 1
            taint = _Taint()
            local = _locals(f, touched)
            for k, v in local.items():
                keys = _holds(v, dead, bad)
                if keys is True:
                    taint.whole.add(k)
                elif keys:
                    taint.keyed[k] = keys
            if taint:
                return _cached(f, local, taint)
            if first is None:
                first, first_locals = f, local
        f = f.f_back
    if first is None:
        return None
    # No frame keeps the output in a variable (``loss_fn(model(x), y)``): what the model call of
    # the backward() caller's code returns is followed instead (the compiled call's own line when
    # the capture saw it, else every module call before backward(); all outputs: less precise).
    scope = {**first.f_globals, **first_locals}
    node = _func_node(first.f_code)
    lines = {ln for file, ln, _fn in site if file == first.f_code.co_filename}
    calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and c.lineno <= first.f_lineno
             and (c.lineno in lines if lines else True) and _is_model(c.func, scope)] if node is not None else []
    found = {_cached(first, first_locals, _Taint(nodes={id(c)})) for c in calls}
    return found.pop() if len(found) == 1 else None  # several model calls that disagree: none is claimed


def _cached(f, local: dict, taint: "_Taint") -> str | None:
    """:func:`_find` from frame ``f``, once per code location, taint and the objects it may call."""
    objs = tuple(sorted((k, id(v)) for k, v in local.items()
                        if isinstance(v, torch.nn.Module) or (callable(v) and not isinstance(v, type)) or k == "self"))
    key = (id(f.f_code), f.f_lineno, frozenset(taint.whole), frozenset((k, frozenset(v)) for k, v in taint.keyed.items()),
           frozenset(taint.nodes), objs)
    if key not in _cache:
        if len(_cache) > 256:
            _cache.clear()
        _cache[key] = _find(f.f_code, f.f_lineno, taint, {**f.f_globals, **local}, 0)
    return _cache[key]


def _is_model(expr, scope: dict) -> bool:
    """Whether a call target names a module or a ``torch.compile``d callable."""
    obj = _lookup(expr, scope)
    return isinstance(obj, torch.nn.Module) or hasattr(obj, "_torchdynamo_orig_callable")


def _holds(v, dead, bad, nested: bool = True):
    """True when ``v`` is a tensor holding the skipped output; for a container, the keys of the
    items that do (``("i", index)``, ``("k", dict key)``, ``("a", attribute)``); else None."""
    if isinstance(v, torch.Tensor):
        fn = v.grad_fn
        if fn is None:
            return None
        if (id(fn), v.output_nr) in dead:
            return True
        return True if bad and not dead and _reaches(fn, bad, v.output_nr) else None
    if not nested:
        return None
    if isinstance(v, (tuple, list)):
        items = [(("i", i), x) for i, x in enumerate(v[:16])]
    elif isinstance(v, dict):
        items = [(("k", k), x) for k, x in list(v.items())[:32]]
    elif hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, type)) and not callable(v):
        items = [(("a", k), x) for k, x in list(vars(v).items())[:32]]
    else:
        return None
    return {key for key, x in items if _holds(x, dead, bad, False)} or None


class _Taint:
    """Names that hold the skipped output: ``whole`` (the name itself) and ``keyed`` (a container
    name -> the keys of its items that do, see :func:`_holds`)."""

    def __init__(self, whole=(), keyed=None, nodes=()):
        self.whole, self.keyed = set(whole), {k: set(v) for k, v in (keyed or {}).items()}
        self.nodes = set(nodes)  # ids of ast calls whose result is the output (the fallback)

    def __bool__(self) -> bool:
        return bool(self.whole or self.keyed or self.nodes)

    def update(self, names) -> None:
        self.whole.update(names)

    def uses(self, node) -> bool:
        if id(node) in self.nodes:
            return True
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.value, ast.Name) \
                and node.value.id in self.keyed:
            keys = self.keyed[node.value.id]
            if isinstance(node, ast.Attribute):
                return ("a", node.attr) in keys or not any(k[0] == "a" for k in keys)  # a method: the whole
            sl = node.slice
            hit = not isinstance(sl, ast.Constant) or ("i", sl.value) in keys or ("k", sl.value) in keys
            return hit or self.uses(sl)
        if isinstance(node, ast.Name):
            return isinstance(node.ctx, ast.Load) and (node.id in self.whole or node.id in self.keyed)
        return any(self.uses(c) for c in ast.iter_child_nodes(node))

    def unpack(self, stmt) -> bool:
        """``a, b = out`` with ``out`` keyed by position: taint the targets at those positions."""
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], (ast.Tuple, ast.List)) \
                and isinstance(stmt.value, ast.Name) and stmt.value.id in self.keyed:
            for i, elt in enumerate(stmt.targets[0].elts):
                if ("i", i) in self.keyed[stmt.value.id]:
                    self.whole.update(_targets(elt))
            return True
        return False


def _reaches(fn, bad: set[int], output_nr: int = 0) -> bool:
    """Whether the autograd graph of ``fn`` (a tensor's ``grad_fn``, its output ``output_nr``)
    reaches one of the parameters ``bad`` (ids). DDP's ``_DDPSinkBackward`` (eager DDP with
    ``find_unused_parameters``) joins all of the model's outputs into one node: through it, only
    the input of the output the edge uses is followed (output k ← input k), so the loss, which
    reads the class head's output, does not count as reaching the skipped box head's parameters."""
    seen, todo = set(), [(fn, output_nr)]
    while todo and len(seen) < _WALK_LIMIT:
        node, nr = todo.pop()
        if node is None:
            continue
        sink = node.name() == "_DDPSinkBackward"
        if (id(node), nr if sink else 0) in seen:
            continue
        seen.add((id(node), nr if sink else 0))
        var = getattr(node, "variable", None)
        if var is not None and id(var) in bad:
            return True
        nxt = node.next_functions
        if sink:
            nxt = nxt[nr:nr + 1]
        todo.extend((x[0], x[1]) for x in nxt)
    return False


def _tree(file: str):
    if file not in _trees:
        try:
            _trees[file] = ast.parse("".join(linecache.getlines(file)) or "\0")
        except (SyntaxError, ValueError):
            _trees[file] = None
    return _trees[file]


def _func_node(code):
    tree = _tree(code.co_filename)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            if first == code.co_firstlineno or node.lineno == code.co_firstlineno:
                return node
    return tree if code.co_name == "<module>" else None


def _targets(node) -> list[str]:
    return [x.id for x in ast.walk(node) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)]


def _quiet(stmt) -> bool:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        return name.lower() in _QUIET
    return False


def _lookup(expr, scope: dict):
    """The object a ``name.attr.attr`` expression names in ``scope``, or None."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    obj = scope.get(expr.id, getattr(builtins, expr.id, None))
    try:
        for p in reversed(parts):
            obj = getattr(obj, p)
    except Exception:  # noqa: BLE001 - a property that raises: not followed
        return None
    return obj


def _resolve(expr, scope: dict):
    """The user function an ``ast`` call target names, and how many leading parameters are bound
    (``self``), or None."""
    obj = _lookup(expr, scope)
    if obj is None:
        return None
    bound = 0
    if isinstance(obj, torch.nn.Module):
        obj, bound = type(obj).forward, 1
    elif hasattr(obj, "__func__"):
        obj, bound = obj.__func__, 1
    elif not hasattr(obj, "__code__") and callable(obj) and not isinstance(obj, type):
        obj, bound = getattr(type(obj), "__call__", None), 1
    code = getattr(obj, "__code__", None)
    if code is None or not _is_user(code) or (getattr(obj, "__module__", "") or "").startswith(("torch", "graphdeck")):
        return None
    return obj, bound


def _callee_taint(call: ast.Call, fn, bound: int, tainted: _Taint) -> _Taint:
    code = fn.__code__
    params = list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])[bound:]
    out = _Taint()

    def give(param: str, arg) -> None:
        if isinstance(arg, ast.Name) and arg.id in tainted.keyed:
            out.keyed[param] = set(tainted.keyed[arg.id])
        else:
            out.whole.add(param)

    for i, a in enumerate(call.args):
        if tainted.uses(a):
            if isinstance(a, ast.Starred) or i >= len(params):
                out.update(params)
                if code.co_flags & 0x04:
                    out.whole.add(code.co_varnames[code.co_argcount + code.co_kwonlyargcount])
            else:
                give(params[i], a)
    for k in call.keywords:
        if tainted.uses(k.value):
            if k.arg is None or k.arg not in params:
                out.update(params)
            else:
                give(k.arg, k.value)
    return out


def _find(code, upto: int | None, tainted: _Taint, scope: dict, depth: int) -> str | None:
    node = _func_node(code)
    if node is None:
        return None
    file, fn = code.co_filename, code.co_name
    outer = upto if upto is not None else node.lineno
    body = node.body
    return _block(body, file, fn, outer, upto, _Taint(tainted.whole, tainted.keyed, tainted.nodes), scope, depth)


def _block(stmts, file, fn, outer, upto, tainted, scope, depth) -> str | None:
    from graphdeck.analysis.ranks.hangs import branch_in_source

    guard = None
    for stmt in stmts:
        if upto is not None and stmt.lineno > upto:
            break
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        inner = (stmt.body + getattr(stmt, "orelse", []) + getattr(stmt, "finalbody", [])
                 + [s for h in getattr(stmt, "handlers", []) for s in h.body]) if hasattr(stmt, "body") else []
        head = [x for x in (getattr(stmt, "test", None), getattr(stmt, "iter", None)) if x is not None] + \
            [i.context_expr for i in getattr(stmt, "items", [])]
        if inner:
            if isinstance(stmt, (ast.For, ast.AsyncFor)) and tainted.uses(stmt.iter):
                tainted.update(_targets(stmt.target))
            for item in getattr(stmt, "items", []):
                if item.optional_vars is not None and tainted.uses(item.context_expr):
                    tainted.update(_targets(item.optional_vars))
            found = _block(inner, file, fn, outer, upto, tainted, scope, depth)
            if found:
                return found
            parts = head
        else:
            parts = [stmt]
        if not _quiet(stmt):
            for part in parts:
                for call in (x for x in ast.walk(part) if isinstance(x, ast.Call)):
                    if depth >= _MAX_DEPTH or not any(tainted.uses(a) for a in [*call.args, *call.keywords]):
                        continue
                    got = _resolve(call.func, scope)
                    if got is None:
                        continue
                    fn_obj, bound = got
                    sub = _callee_taint(call, fn_obj, bound, tainted)
                    if sub:
                        found = _find(fn_obj.__code__, None, sub, dict(fn_obj.__globals__), depth + 1)
                        if found:
                            return found
            if any(tainted.uses(p) for p in parts):
                hit = branch_in_source(file, stmt.lineno, outer)
                if hit and hit[1].split(" ", 1)[0].rstrip(":") in ("if", "elif", "while", "match", "case", "else"):
                    return f"{file}:{hit[0]} in {fn}: `{hit[1]}`"
                if guard is not None:
                    text = f"if {ast.unparse(guard.test)}: {ast.unparse(guard.body[-1])}"
                    return f"{file}:{guard.lineno} in {fn}: `{text}`"
        if tainted.unpack(stmt):
            pass
        elif isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and stmt.value is not None \
                and tainted.uses(stmt.value):
            for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
                tainted.update(_targets(t) or ([t.value.id] if isinstance(t, (ast.Subscript, ast.Attribute))
                                               and isinstance(t.value, ast.Name) else []))
        if isinstance(stmt, ast.If) and stmt.body and isinstance(stmt.body[-1], _EXITS) \
                and not (upto is not None and stmt.end_lineno < upto and _encloses_rest(stmts, stmt, upto)):
            guard = stmt
    return None


def _encloses_rest(stmts, guard, line: int) -> bool:
    """Whether ``line`` is in a statement of ``stmts`` after ``guard`` (the guard's exit skips
    it too: it does not separate a use from that line)."""
    after = False
    for s in stmts:
        if s is guard:
            after = True
        elif after and s.lineno <= line <= (s.end_lineno or s.lineno):
            return True
    return False
