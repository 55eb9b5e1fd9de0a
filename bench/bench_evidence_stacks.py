"""The capture's per-step CPU on a CPU, with as little else as possible (issue 22 item 4).

Two stacks of 4x4 linear layers (PARAMS parameter tensors: 76 as GPT-2 at 6 layers, 148 at 12),
compiled with aot_eager as two graphs (a graph break between them, as GPT-2's under Dynamo), SGD,
``zero_grad(set_to_none=True)``. Three copies: plain ``torch.compile``, the capture with
``GRAPHDECK_GRAD_EVIDENCE=0``, the full capture. After 8 warm-up steps (the evidence is then in
steady mode), STEPS turns of one step each (order reversed every other turn); per step the calling
thread's CPU time (``time.thread_time``: on a CPU the backward runs on that thread, and other
processes' load stays out). Printed: medians per mode and the median of the paired per-step
differences, in µs.

    python bench/bench_evidence_stacks.py 76 400
    PYTHONPATH=/tmp/old python bench/bench_evidence_stacks.py 76 400   # an older checkout, made with
        # git archive COMMIT capture graphdeck store analysis | tar -x -C /tmp/old
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


class Stacks(torch.nn.Module):
    def __init__(self, params: int):
        super().__init__()
        self.a = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(params // 4)])
        self.b = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(params // 4)])

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h).pow(2).mean()


def main() -> None:
    from graphdeck.capture import Agent

    params, steps = int(sys.argv[1]), int(sys.argv[2])
    tmp = Path(tempfile.mkdtemp(prefix="bench-stacks-"))
    x = torch.randn(2, 4)
    fns, agent = {}, None
    for mode in ("plain", "no_evidence", "captured"):
        torch.manual_seed(0)
        model = Stacks(params)
        if mode == "plain":
            compiled = torch.compile(model, backend="aot_eager")
        else:
            if mode == "no_evidence":
                os.environ["GRAPHDECK_GRAD_EVIDENCE"] = "0"
            ag = Agent(store=tmp / f"{mode}.db", run="stacks")
            ag.watch(model)
            os.environ.pop("GRAPHDECK_GRAD_EVIDENCE", None)
            compiled = torch.compile(model, backend=ag.backend("aot_eager"))
            agent = ag if mode == "captured" else agent
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(compiled=compiled, opt=opt):
            compiled(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        fns[mode] = step
    for _ in range(8):
        for f in fns.values():
            f()
    res: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(steps):
        for k, f in (list(fns.items()) if i % 2 == 0 else list(reversed(fns.items()))):
            t = time.thread_time()
            f()
            res[k].append(time.thread_time() - t)
    med = {k: statistics.median(v) * 1e6 for k, v in res.items()}

    def paired(a: str, b: str) -> float:
        return statistics.median(p - q for p, q in zip(res[a], res[b])) * 1e6

    ev = agent._evidence
    print(f"{len(ev._params)} parameters, {steps} steps each, steady mode {'on' if ev._steady else 'OFF'}: "
          f"plain {med['plain']:.0f} µs, no_evidence {med['no_evidence']:.0f}, captured {med['captured']:.0f}; "
          f"captured − plain {paired('captured', 'plain'):+.0f} µs, no_evidence − plain "
          f"{paired('no_evidence', 'plain'):+.0f}, captured − no_evidence {paired('captured', 'no_evidence'):+.0f}")


if __name__ == "__main__":
    main()
