"""Wrappers around a compiled graph's callable: what the capture learns when the graph runs.

* :func:`watch_output_grads` (:class:`OutputGradNote`): which outputs of the first grad-enabled
  call get a gradient.
* :func:`bind_at_run_time`: which parameters a graph's inputs are on each call with new tensors.
* :func:`observe_calls`: per-call output observation for the gradient evidence
  (NOTE: [Gradient evidence] in ``grad_evidence.py``).

Every wrapper passes arguments and results through unchanged (boxed or not) and never raises
into the job.
"""

from __future__ import annotations

import warnings
from array import array
from operator import itemgetter
from typing import TYPE_CHECKING

import torch
import torch.fx

from graphdeck.capture.fxrecord import output_args
from graphdeck.capture.writer import IOBinding

if TYPE_CHECKING:
    from graphdeck.capture.agent import Agent
    from graphdeck.capture.grad_evidence import GradEvidence, GraphInfo


class OutputGradNote:
    """``note(out)`` after a compiled graph's calls, until ``done``: on its first grad-enabled
    call, notes which outputs get a gradient in the backward that follows
    (``meta_json["outputs_without_grad"]``: node names of outputs the loss does not use; the
    gradient check calls their parameters DEAD_END). Never raises into the job.

    # NOTE: [Outputs without gradient]
    # A compiled region gives every output a gradient slot; an output the loss never uses gets
    # zeros there, so its parameters silently receive zero gradients instead of none. On the
    # first call, a pre-hook on each output's autograd node sees the incoming gradients, with
    # ``None`` where the loss does not reach (``register_multi_grad_hook`` never fires when an
    # output gets no gradient and its node still runs, as with GPT-2's KV-cache outputs).
    # Later calls cost one flag check, made by the one wrapper of the call
    # (:func:`watch_output_grads`, or :func:`observe_calls` when the evidence is on).
    """

    __slots__ = ("names", "graph_id", "agent", "done")

    def __init__(self, gm: torch.fx.GraphModule, graph_id: int, agent: "Agent"):
        self.names = [v.name if isinstance(v, torch.fx.Node) else None for v in output_args(gm)]
        self.graph_id, self.agent, self.done = graph_id, agent, False

    def __call__(self, out) -> None:
        if self.done or not torch.is_grad_enabled():
            return
        from graphdeck.capture.grad_sites import compiled_autograd_coming

        if compiled_autograd_coming():  # no hook in compiled autograd's graph (NOTE: [Evidence under compiled autograd])
            self.done = True
            return
        names, agent, graph_id = self.names, self.agent, self.graph_id
        outs = out if isinstance(out, (list, tuple)) else [out]
        groups: dict = {}
        for i, t in enumerate(outs):
            if i < len(names) and names[i] and isinstance(t, torch.Tensor) and t.grad_fn is not None:
                groups.setdefault(t.grad_fn, []).append((names[i], t.output_nr))
        if not groups:
            return
        self.done = True
        pending, result = set(groups), {}

        def make_hook(fn):
            def pre_hook(grads):
                from graphdeck.capture.grad_evidence import compiled_autograd_active

                if compiled_autograd_active():  # traced by compiled autograd, or queue_callback refused
                    return None
                agent._observe_grads_after_backward()
                for name, nr in groups[fn]:
                    result[name] = nr < len(grads) and grads[nr] is not None
                pending.discard(fn)
                for other in list(pending):
                    try:
                        runs = torch._C._will_engine_execute_node(other)
                    except Exception:
                        runs = True
                    if not runs:
                        result.update((name, False) for name, _ in groups[other])
                        pending.discard(other)
                if pending:
                    return None
                try:
                    agent.writer.update_graph_meta(graph_id, {
                        "outputs_without_grad": [n for n, ok in result.items() if not ok],
                        "outputs_with_grad": [n for n, ok in result.items() if ok]})
                except Exception as exc:  # capture never breaks training
                    warnings.warn(f"graphdeck: could not record output gradients: {type(exc).__name__}: {exc}")
                return None

            return pre_hook

        for fn in groups:
            fn.register_prehook(make_hook(fn))


def watch_output_grads(compiled, gm: torch.fx.GraphModule, graph_id: int, agent: "Agent"):
    """Wrap a compiled graph so that its first grad-enabled call notes which outputs get a
    gradient in the backward that follows (:class:`OutputGradNote`); the calling convention
    passes through unchanged."""
    note = OutputGradNote(gm, graph_id, agent)
    timer = getattr(agent, "_heartbeat", None)  # NOTE: [Time outside the compiled step]

    def run(*args, **kwargs):  # transparent: boxed (one list) or not, the args pass through
        if timer is not None and timer.step_open and torch.is_grad_enabled():
            timer.entered(agent)
        out = compiled(*args, **kwargs)
        if not note.done:
            note(out)
        return out

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run


class BindingPlan:
    """Where a compiled Dynamo graph's parameter inputs show up in the graphs recorded for it:
    ``positions`` (indices among its placeholders of the inputs that are parameters),
    ``dynamo_rows`` ((position, node name) of its ``in`` bindings), ``children`` ((graph id,
    ``in`` rows (position, node, input index k, desc), ``grad`` rows (position, node, k, has_grad,
    desc)) of its AOT graphs), and ``recorded``: the name tuples already stored."""

    __slots__ = ("dynamo_graph_id", "dynamo_rows", "children", "positions", "recorded")

    def __init__(self, dynamo_graph_id: int, dynamo_rows: list):
        self.dynamo_graph_id, self.dynamo_rows = dynamo_graph_id, dynamo_rows
        self.children: list = []
        self.positions: list[int] = []
        self.recorded: set[tuple] = set()


def child_rows(ins: list, grads: list, fqn_by_input: dict) -> list[IOBinding]:
    rows = [IOBinding("in", pos, name, fqn_by_input[k], desc=desc)
            for pos, name, k, desc in ins if fqn_by_input.get(k)]
    rows += [IOBinding("grad", pos, name, fqn_by_input.get(k), has_grad=has, desc=desc)
             for pos, name, k, has, desc in grads]
    return rows


#: Distinct parameter sets looked at per compiled graph; later new ones are not recorded.
MAX_BINDINGS_PER_GRAPH = 256


def picker(positions: list[int]):
    """``flat -> tuple(flat[i] for i in positions)`` at C speed (``operator.itemgetter``)."""
    if not positions:
        return lambda flat: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda flat: (flat[i],)
    return itemgetter(*positions)


def ids_key(params: tuple) -> bytes:
    """The identity of a call's parameters: their ``id``s packed into one ``bytes`` (the capture
    holds no parameter). One object, hashed and compared as one block of memory: a tuple of ints
    is as many objects, each a cache miss when a launch-bound step compares it with a stored one."""
    return array("q", map(id, params)).tobytes()


def binder(plan: BindingPlan, agent: "Agent"):
    """``bind(params) -> key``: record which parameters ``params`` (the call's tensors at
    ``plan.positions``, a tuple) are the first time that set is seen (NOTE: [Run-time parameter
    binding]); returns their :func:`ids_key` (None once ``MAX_BINDINGS_PER_GRAPH`` sets were seen
    or after a failure). Never raises."""
    seen: set[tuple] = set()

    def bind(params: tuple):
        if len(seen) >= MAX_BINDINGS_PER_GRAPH:
            return None
        try:
            key = ids_key(params)
            if key not in seen:
                seen.add(key)
                agent._bind(plan, list(params))
            return key
        except Exception as exc:  # capture never breaks training
            seen.add(None)
            warnings.warn(f"graphdeck: could not bind parameters at run time: {type(exc).__name__}: {exc}")
            return None

    return bind


def bind_at_run_time(compiled, plan: BindingPlan, agent: "Agent"):
    """Wrap a compiled graph so that each call whose parameter inputs are new tensors records
    which parameters they are.

    # NOTE: [Run-time parameter binding]
    # One compiled graph can serve many modules: a transformer block compiled on its own (regional
    # compilation, FSDP2's per-block hooks, a graph break inside a block's forward) is traced once
    # and then called with each block's parameters, its placeholders named relative to the frame
    # (``ln_1.weight``). Which parameters a call reads shows only at run time, so the first call
    # with each new set of tensors (keyed by identity: one tuple of ids, before the call, since a
    # boxed callee clears its argument list) looks them up by identity in the watched models and
    # stores the extra ``in``/``grad`` bindings for the graph and its AOT forward/backward.
    """
    pick = picker(plan.positions)
    bind = binder(plan, agent)
    boxed = getattr(compiled, "_boxed_call", False)

    def run(*args, **kwargs):
        flat = args[0] if boxed and len(args) == 1 and isinstance(args[0], list) else args
        try:
            bind(pick(flat))
        except Exception as exc:  # capture never breaks training (a short argument list)
            warnings.warn(f"graphdeck: could not bind parameters at run time: {type(exc).__name__}: {exc}")
        return compiled(*args, **kwargs)

    if boxed:
        run._boxed_call = True
    return run


def observe_calls(compiled, info: "GraphInfo", evidence: "GradEvidence", plan: BindingPlan | None = None,
                  agent: "Agent | None" = None, note: OutputGradNote | None = None):
    """Wrap a compiled graph so that each grad-enabled call reports its outputs to ``evidence``
    (the parameters at ``info.positions`` are read before the call: a boxed callee clears its
    argument list). With ``plan`` (and ``agent``), the same wrapper does :func:`bind_at_run_time`'s
    binding: one wrapper, one pick of the parameters and one key of their ids per call instead of
    two (each µs of a call is a µs of a launch-bound step: NOTE: [Steady mode]); a plan whose
    positions are not the evidence's gets its own wrapper. ``note``: the graph's
    :class:`OutputGradNote`, called by this same wrapper until it is done."""
    bind = None
    if plan is not None and agent is not None and plan.positions:
        if list(plan.positions) == list(info.positions):
            bind = binder(plan, agent)
        else:
            compiled = bind_at_run_time(compiled, plan, agent)
    pick = picker(info.positions)
    boxed = getattr(compiled, "_boxed_call", False)
    timer = getattr(agent, "_heartbeat", None)  # NOTE: [Time outside the compiled step]

    def run(*args, **kwargs):
        grad = torch.is_grad_enabled()
        if grad and timer is not None and timer.step_open:
            timer.entered(agent)
        if not grad and bind is None:
            return compiled(*args, **kwargs)
        flat = args[0] if boxed and len(args) == 1 and isinstance(args[0], list) else args
        try:
            params = pick(flat)
            key = bind(params) if bind is not None else ids_key(params)
        except Exception:  # noqa: BLE001 - capture never breaks training (a short argument list)
            params, key = (), None
        if not grad:
            return compiled(*args, **kwargs)
        if not evidence.before_call(info, key):  # steady mode's baseline, while the parameters are in cache
            params = ()  # let go while in cache: nothing reads them after this call
        out = compiled(*args, **kwargs)
        if note is not None and not note.done:
            note(out)
        evidence.observe_call(info, out, params, key)
        return out

    if boxed:
        run._boxed_call = True
    return run
