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
#   before the forward and accumulation over micro-batches are told apart from a new gradient;
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
# ``.grad`` look new. New parameters (``add_model``), a compiled graph the steady state did not
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
from itertools import repeat
from operator import is_not

_NONES = repeat(None)
_CALL = weakref.ref.__call__


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

    __slots__ = ("refs", "got", "outputs", "reads", "base", "skip_single", "_with", "_without")

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

    @classmethod
    def from_refs(cls, params: list, counts: dict, outputs: dict, reads: dict) -> "SteadyCheck":
        """From ``GradEvidence._params`` (``(fqn, weak ref)``) and a window's accumulation counts."""
        refs = tuple(ref for _fqn, ref in params)
        return cls(refs, [i in counts for i in range(len(refs))], outputs, reads)

    def snapshot(self) -> None:
        """The baseline, taken at the forward: which ``.grad`` exist before the backward."""
        if not any(map(is_not, _grads(self.refs), _NONES)):
            self.base = ()  # the usual case: zero_grad(set_to_none=True) ran
            return
        grads = list(_grads(self.refs))
        idx = [i for i, g in enumerate(grads) if g is not None]
        self.base = (idx, [weakref.ref(grads[i]) for i in idx], [grads[i]._version for i in idx])

    def received(self) -> tuple[list[bool], bool]:
        """(per index: a gradient arrived since the baseline, whether there was a baseline);
        resets the baseline for the next backward."""
        base, self.base = self.base, None
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
