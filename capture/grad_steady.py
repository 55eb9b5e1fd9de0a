"""Steady mode of the gradient evidence: once backward passes repeat, one cheap look at every
watched parameter's ``.grad`` per backward instead of a Python hook per parameter (a helper of
:mod:`graphdeck.capture.grad_evidence`; see NOTE: [Gradient evidence] there).

# NOTE: [Steady mode]
# A launch-bound training step (GPT-2 6 layers on an H200: ~12 ms, all of it the host's Python
# and kernel launches) shows every µs of Python the capture adds. Full mode runs a gradient hook
# per parameter per backward (a few µs each on autograd's thread: ~0.6-0.8 ms a step at ~150
# parameters). Once STEADY_AFTER backward passes in a row gave the same state — each after a
# compiled forward of its own, compiled outputs marking its end, no parameter accumulated twice —
# the hooks come off, torch's C++ hook on each tensor with them (NOTE: [Hooks stay on the
# tensor]), and each backward costs:
#
# * at the first grad-enabled compiled call after the last backward (before it runs), one
#   C-speed pass over the weakly held parameters' ``.grad`` (~0.1 µs a parameter): the *baseline*. Usually
#   every ``.grad`` is None there (``zero_grad(set_to_none=True)``, torch's default); those that
#   are not are remembered as (weak reference, ``_version``), so ``zero_grad(set_to_none=False)``
#   before the forward and accumulation over micro-batches are told apart from a new gradient.
#   Tensors whose ``.grad`` torch's own ``Optimizer.zero_grad(set_to_none=True)`` set to None
#   since the last backward are left out of the pass (none, in the usual loop): the evidence
#   wraps that method on each optimizer instance at its first step (:func:`watch_zero_grad`;
#   nothing else changes, and an optimizer whose class overrides ``zero_grad`` is not wrapped),
#   and the wrapper says which tensors the param groups held, by ``id`` — no tensor is touched;
# * at the end of the backward (the callback the window already queues), the same map again:
#   a parameter *received* a gradient when its ``.grad`` is not None and is another tensor than
#   the baseline's or the same one at another version. The list of booleans is compared with the
#   steady one, and the compiled outputs seen live/skipped (and which parameters their graphs
#   read) with the steady ones: equal, the row's end moves; different, the hooks go back on and
#   this backward's state is computed in full from what was received — so a parameter whose
#   gradient stops arriving at step N is NO_GRAD at step N, and a skipped compiled output makes
#   its parameters zero-filled at step N, as in full mode.
#
# What steady mode does not see, stated: how many times a gradient was accumulated in one
# backward (twice looks like once: READY_TWICE needs full mode, which is why a window with
# ``multi`` never enters steady mode; the first steps of a run, where it shows, are always in full
# mode); a backward with no compiled forward since the last one (``retain_graph`` reuse) has no
# baseline, so it is judged by ``.grad is not None`` and ends steady mode for the rest of the run
# (a gradient left over from an earlier backward of the same step would count as received:
# the step's result is the same, since a step is what its backward passes accumulated); and
# ``zero_grad(set_to_none=False)`` between the forward and ``backward()`` makes every zeroed
# ``.grad`` look new; a ``.grad`` the job assigns itself between the optimizer's
# ``zero_grad(set_to_none=True)`` and the forward counts as arriving in that step. New parameters (``add_model``), a compiled graph the steady state did not
# read, or any change of state end steady mode.
#
# A compiled graph with one output (typically the one computing the loss) gets no pre-hook in
# steady mode while another graph is watched: its output cannot be skipped while another is used
# (the backward runs its node or does not reach it at all, and then its parameters' ``.grad``
# says so). Every pre-hook costs ~20-50 µs of a launch-bound step (registering it, the call from
# the engine; measured cold, inside a training step). Should a backward then reach no watched
# graph, no window opens for it: the optimizer step's pre-hook sees a forward without a closed
# window and closes one from ``.grad`` alone (steady mode ends there), so no step goes unjudged.
"""

from __future__ import annotations

import weakref
from itertools import chain, repeat
from operator import is_not

import torch

_NONES = repeat(None)
_CALL = weakref.ref.__call__
_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _grads(refs: tuple):
    """``.grad`` of each weakly referenced parameter (None for one gone), at C speed."""
    return map(getattr, map(_CALL, refs), repeat("grad"), _NONES)


class SteadyCheck:
    """The steady state and the cheap per-backward check (NOTE: [Steady mode]).

    ``refs``: weak references to the watched tensors, index-aligned with ``GradEvidence._params``
    (the capture holds no parameter: one gone from the program reads as no ``.grad``); ``got``:
    per index, whether the steady backward passes received a gradient; ``outputs``/``reads``: the
    window's compiled outputs seen (graph key → output name → LIVE/DEAD bits) and the (GraphInfo,
    parameter names) read, as in the steady passes."""

    __slots__ = ("refs", "got", "outputs", "reads", "base", "skip_single", "_with", "_without", "ids", "stale",
                 "_index_of")

    def __init__(self, refs: tuple, got: list[bool], outputs: dict, reads: dict):
        self.refs = refs
        self.got = got
        # The steady answer checked in one pass without building a list (received()).
        self._with = tuple(r for r, x in zip(refs, got) if x)
        self._without = tuple(r for r, x in zip(refs, got) if not x)
        # Graphs of one output are not watched in steady mode when another graph is (NOTE:
        # [Steady mode]): their pre-hook tells nothing the ``.grad`` check does not.
        single = {k for k, r in reads.items() if r and all(info.single for info, _ in r)}
        self.skip_single = bool(set(outputs) - single)
        if not self.skip_single:
            single = set()
        self.outputs = {k: dict(v) for k, v in outputs.items() if k not in single}
        self.reads = {k: set(v) for k, v in reads.items() if k not in single}
        self.base: tuple | None = None  # None: no forward since the last backward; (): every .grad None
        # ids of the live tensors (unique while they live; one gone reads as no .grad, whatever
        # its id is reused for) and the ones whose .grad may be set: None, all of them (a
        # backward ran since the last zero_grad that cleared any).
        self._index_of = {id(t): i for i, t in enumerate(map(_CALL, refs)) if t is not None}
        self.ids = frozenset(self._index_of)
        self.stale: frozenset | None = None

    @classmethod
    def from_refs(cls, params: list, counts: dict, outputs: dict, reads: dict) -> "SteadyCheck":
        """From ``GradEvidence._params`` (``(fqn, weak ref)``) and a window's accumulation counts."""
        refs = tuple(ref for _fqn, ref in params)
        return cls(refs, [i in counts for i in range(len(refs))], outputs, reads)

    def cleared(self, opt: torch.optim.Optimizer) -> None:
        """``opt``'s own ``zero_grad(set_to_none=True)`` just returned: every tensor in its param
        groups has ``.grad`` None until the next backward (``id``s only: no tensor is read)."""
        held = set(map(id, chain.from_iterable(g["params"] for g in opt.param_groups)))
        self.stale = (self.ids if self.stale is None else self.stale).difference(held)

    def snapshot(self) -> None:
        """The baseline, taken at the forward: which ``.grad`` exist before the backward (a pass
        over the tensors no ``zero_grad`` cleared since the last backward: :meth:`cleared`)."""
        stale = self.stale
        if stale is None:
            refs, where = self.refs, None
        elif not stale:
            self.base = ()  # the usual loop: the optimizer's zero_grad(set_to_none=True) ran
            return
        else:
            where = sorted(self._index_of[i] for i in stale)
            refs = [self.refs[i] for i in where]
        if not any(map(is_not, _grads(refs), _NONES)):
            self.base = ()  # every .grad None: zero_grad(set_to_none=True) ran
            return
        grads = list(_grads(refs))
        pos = [k for k, g in enumerate(grads) if g is not None]
        self.base = ([k if where is None else where[k] for k in pos], [weakref.ref(grads[k]) for k in pos],
                     [grads[k]._version for k in pos])

    def received(self) -> tuple[list[bool], bool]:
        """(per index: a gradient arrived since the baseline, whether there was a baseline);
        resets the baseline for the next backward."""
        base, self.base = self.base, None
        self.stale = None  # a backward ran: any .grad may be set again
        if not base:  # every .grad was None at the forward (or there was no forward)
            if all(map(is_not, _grads(self._with), _NONES)) and not any(map(is_not, _grads(self._without), _NONES)):
                return self.got, base is not None  # the steady answer (not to be changed by the caller)
            return list(map(is_not, _grads(self.refs), _NONES)), base is not None
        grads = list(_grads(self.refs))
        got = list(map(is_not, grads, _NONES))
        if base:
            for i, ref, v in zip(*base):
                g = grads[i]
                if g is not None and ref() is g and g._version == v:
                    got[i] = False  # the baseline's tensor, untouched: nothing arrived
        return got, base is not None

    def nothing(self, got: list[bool]) -> bool:
        """Whether a backward received no gradient at all where the steady ones did (a
        ``torch.autograd.grad`` pass: NOTE: [Backward passes that fill no .grad])."""
        return bool(self._with) and not any(got)

    def same(self, got: list[bool], outputs: dict, reads: dict) -> bool:
        """Whether a backward that received ``got`` and saw ``outputs``/``reads`` is in the steady state."""
        return got == self.got and outputs == self.outputs and reads == self.reads


def watch_zero_grad(opt, on_cleared) -> bool:
    """Wrap ``opt.zero_grad`` on the instance so that after torch's own ``zero_grad`` returns
    with ``set_to_none`` true, ``on_cleared()`` (a weak method, or any callable returning a
    callable or None) is called with ``opt`` (NOTE: [Steady mode]). The call, its arguments,
    result and errors are torch's; the wrapper holds ``opt`` weakly (no cycle keeps a dropped
    optimizer and its state alive) and, like torch's, is skipped by Dynamo. Returns whether it
    wrapped: not for a class that overrides ``zero_grad`` (its meaning is its own), an instance
    that already carries one, or while Dynamo traces."""
    func = type(opt).zero_grad
    if func is not _ZERO_GRAD or "zero_grad" in vars(opt) or torch.compiler.is_compiling():
        return False
    ref = weakref.ref(opt)

    @torch._disable_dynamo
    def zero_grad(*args, **kwargs):
        o = ref()
        out = func(o, *args, **kwargs)
        if args[0] if args else kwargs.get("set_to_none", True):
            try:
                cb = on_cleared()
                if cb is not None:
                    cb(o)
            except Exception:  # noqa: BLE001 - capture never breaks training
                pass
        return out

    zero_grad.__name__, zero_grad.__qualname__, zero_grad.__doc__ = "zero_grad", func.__qualname__, func.__doc__
    zero_grad.__wrapped__ = func
    opt.zero_grad = zero_grad
    return True
