"""One backward pass's *window* of gradient evidence (NOTE: [Gradient evidence] in
``grad_evidence.py``): what it saw — accumulation counts, autograd tasks, compiled outputs live or
skipped, the graphs' parameter reads — and which parameters it leaves zero-filled."""

from __future__ import annotations

from typing import Any

LIVE, DEAD = 1, 2  # bits of an output's fate in Window.outputs


class Window:
    """One backward pass as the hooks see it (NOTE: [Gradient evidence]): accumulations per
    parameter index, the autograd tasks in it, the compiled outputs live or skipped."""

    __slots__ = ("counts", "tasks", "pending", "closed", "opt_at_open", "fwd_at_open", "outputs", "reads",
                 "multi_sites", "loss_site", "output_site", "output_names", "thread", "forced", "dead")

    def __init__(self, opt_steps: int, fwd_gen: int):
        self.counts: dict[int, int] = {}
        self.tasks: set[int] = set()
        self.pending: set[int] = set()
        self.closed = False
        self.opt_at_open, self.fwd_at_open = opt_steps, fwd_gen
        self.outputs: dict[int, dict[str, int]] = {}  # graph key -> output name -> LIVE|DEAD bits
        self.reads: dict[int, set[tuple]] = {}  # graph key -> {Read (GraphInfo, fqns)}
        self.multi_sites: dict[int, str | None] = {}
        self.loss_site = self.output_site = None  # output_site: raw user_frames of the call
        self.output_names: list[str] = []
        self.thread: int | None = None
        self.forced = False  # closed at an optimizer step, no hook having opened it (NOTE: [Steady mode])
        self.dead: set[tuple[int, int]] = set()  # (id(grad_fn), output_nr) of skipped outputs (grad_branch.py)


def zero_filled(w: Window, params: list[tuple[str, Any]]) -> set[str]:
    """The fqns of ``params`` (index → ``(fqn, weak ref)``) that window ``w`` leaves zero-filled: a
    gradient was accumulated into them, every observed output they reach was skipped and no live
    output reaches them (NOTE: [Gradient evidence])."""
    cand: set[str] = set()
    live: set[str] = set()
    for key, seen in w.outputs.items():
        dead_names = {n for n, b in seen.items() if b == DEAD}
        if not dead_names:
            continue
        live_names = {n for n, b in seen.items() if b & LIVE}
        for info, fqns in w.reads.get(key, ()):
            for pname, fqn in zip(info.names, fqns):
                if not fqn:
                    continue
                r = info.reach.get(pname, frozenset()) & seen.keys()
                if r & live_names:
                    live.add(fqn)
                elif r:
                    cand.add(fqn)
    # A parameter counts as zero-filled only if a gradient was accumulated into it.
    acc = {params[i][0] for i in w.counts}
    return (cand - live) & acc
