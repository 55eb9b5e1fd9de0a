"""The capture's own host time in a steady training step, timed from inside (issue 22 item 4).

``bench_grad_evidence.py`` measures the capture as a difference between copies of a model (plain,
captured, captured without the evidence), which on a shared machine resolves a few hundred µs, i.e.
1-3% of a GPT-2 step. This one times the capture's own code where it runs, in one captured model:
the wrapper the agent puts around each compiled call (with the evidence on, ``observe_calls`` +
``GradEvidence.observe_call``, which also binds parameters and notes the outputs' gradients; else
``watch_output_grads`` and ``bind_at_run_time``: their time minus the compiled call's) and every
hook the gradient evidence has autograd or the optimizer call (the outputs' pre-hook, the
end-of-backward callback, the per-parameter hooks while they are on, the optimizer step's pre- and
post-hooks), with ``time.perf_counter_ns`` (wall: each runs with the GIL held, on the calling thread
or autograd's device thread, on the step's path). Not in it: the engine's own cost of calling a
Python hook (a GIL hand-over, ~1 µs a call) and the timers' (~0.1 µs a call).

After ``--warmup`` steps (steady mode on), ``--steps`` steps each timed whole (CUDA events on a GPU,
``perf_counter`` on a CPU) with the capture's parts summed per step. Printed: per part the median
µs a step and calls a step, the total's median and spread, the total as a share of the median step,
and how many parameters still carry a hook (torch's own C++ hook included: NOTE: [Hooks stay on the
tensor]). ``--ab``: each step is paired with one where the evidence is muted (its hooks and checks
return at once; the wrapper still picks and keys the parameters), in turn; printed: the median
paired difference of step time with a 95% bootstrap interval — what the job feels, with the GPU's
queue hiding what host time it can; ``--zero-ab`` adds a third step per round, the evidence blind to the
optimizer's ``zero_grad`` (a full baseline pass), and prints its paired differences. ``--sub-parts``: the passes over ``.grad``, the close and
``observe_call`` timed too (nested; their timers inflate what they are nested in).

    python bench/bench_evidence_own.py --device cuda --backend inductor --dtype bf16 --batch 8 --seq 512 --layers 12 --ab
    python bench/bench_evidence_own.py --layers 6 --embd 96 --vocab 512 --seq 16   # CPU, aot_eager
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from functools import wraps
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_grad_evidence import build, make_step, timed  # noqa: E402

NS: dict[str, int] = defaultdict(int)  # part -> ns this step
CALLS: dict[str, int] = defaultdict(int)  # part -> calls this step
CPU_MS: dict[str, list[float]] = defaultdict(list)  # arm -> host CPU ms of each of its steps
BLIND = [False]  # --zero-ab: this step's evidence ignores the optimizer's zero_grad
_pc = time.perf_counter_ns


def timed_factory(factory, part: str):
    """A wrapper factory like ``factory`` whose wrappers add (their time − the compiled call's) to ``part``."""

    def make(compiled, *a, **k):
        inner_ns = [0]

        def inner(*x, **kw):
            t = _pc()
            try:
                return compiled(*x, **kw)
            finally:
                inner_ns[0] += _pc() - t

        if getattr(compiled, "_boxed_call", False):
            inner._boxed_call = True
        wrapped = factory(inner, *a, **k)

        def outer(*x, **kw):
            t, i0 = _pc(), inner_ns[0]
            try:
                return wrapped(*x, **kw)
            finally:
                NS[part] += (_pc() - t) - (inner_ns[0] - i0)
                CALLS[part] += 1

        if getattr(wrapped, "_boxed_call", False):
            outer._boxed_call = True
        return outer

    return make


def timed_method(cls, name: str, part: str) -> None:
    fn = getattr(cls, name, None)
    if fn is None:  # a hook this version of the capture does not have
        return

    @wraps(fn)
    def method(*a, **k):
        t = _pc()
        try:
            return fn(*a, **k)
        finally:
            NS[part] += _pc() - t
            CALLS[part] += 1

    setattr(cls, name, method)


def instrument(sub_parts: bool = False) -> None:
    """Time the capture's parts (before any agent exists: hooks bind methods when registered);
    ``sub_parts``: also the steady check's passes over ``.grad``, the window's close and
    ``observe_call`` ("x ..." lines, nested in the parts: the timers' own cost inflates the total)."""
    from graphdeck.capture import agent as agent_mod
    from graphdeck.capture import callwrap
    from graphdeck.capture.grad_evidence import GradEvidence

    agent_mod.watch_output_grads = timed_factory(callwrap.watch_output_grads, "call: output-gradient note")
    agent_mod.bind_at_run_time = timed_factory(callwrap.bind_at_run_time, "call: parameter binding")
    callwrap.observe_calls = timed_factory(callwrap.observe_calls, "call: evidence (observe_call, pre-hook put on)")
    if sub_parts:
        from graphdeck.capture.grad_steady import SteadyCheck

        for cls, name, part in ((SteadyCheck, "snapshot", "x snapshot (baseline pass)"),
                                (SteadyCheck, "received", "x received (end-of-backward pass)"),
                                (GradEvidence, "_close", "x close"), (GradEvidence, "observe_call", "x observe_call")):
            timed_method(cls, name, part)
    for name, part in (("_on_output_grads", "hook: outputs' pre-hook"), ("_task_done", "hook: end of backward"),
                       ("_on_grad", "hook: per-parameter (full mode)"),
                       ("_on_step_pre", "hook: optimizer step"), ("_on_optimizer_step", "hook: optimizer step")):
        timed_method(GradEvidence, name, part)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sub-parts", action="store_true", help="also time the sub-parts (nested; inflates the total)")
    ap.add_argument("--ab", action="store_true",
                    help="also time a step with the evidence muted after (or before) each one, in turn")
    ap.add_argument("--zero-ab", action="store_true",
                    help="with --ab, a third step per round: the evidence on but blind to the optimizer's zero_grad "
                         "(a full baseline pass over .grad, as before that shortcut); rounds rotate the order")
    args = ap.parse_args()
    instrument(args.sub_parts)
    if args.zero_ab:
        from graphdeck.capture.grad_steady import SteadyCheck

        snapshot = SteadyCheck.snapshot

        def maybe_blind(self):  # the blind step's baseline: a pass over every .grad
            if BLIND[0]:
                self.stale = None
            snapshot(self)

        SteadyCheck.snapshot = maybe_blind
    from graphdeck.capture import Agent

    device, dtype = args.device, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build(args.layers, device, embd=args.embd, vocab=args.vocab)
    agent = Agent(store=Path(tempfile.mkdtemp(prefix="bench-own-")) / "s.db", run="bench")
    agent.watch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device == "cuda" else {"foreach": True}))
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), device=device,
                          generator=torch.Generator(device=device).manual_seed(0))
    step = make_step(model, torch.compile(model, backend=agent.backend(args.backend)), opt, batch, dtype, device)
    for _ in range(args.warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    per_step: list[dict[str, int]] = []
    calls: list[dict[str, int]] = []
    step_ms: list[float] = []
    off_ms: list[float] = []  # --ab: the steps with the evidence muted
    blind_ms: list[float] = []  # --zero-ab: the steps blind to zero_grad
    blind_parts: list[dict[str, int]] = []
    ev = agent._evidence
    arms = ["on", "muted", "blind"] if args.zero_ab else ["on", "muted"] if args.ab else ["on"]
    for i in range(args.steps):
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:  # each arm first in turn
            NS.clear()
            CALLS.clear()
            if arm == "muted":
                ev._failed = True  # muted for this step: observe_call, the hooks and the optimizer's return at once
            BLIND[0] = arm == "blind"
            try:
                res = timed(step, 1, device)
                ms = res[0][0]  # CUDA events on a GPU, perf_counter on a CPU
                CPU_MS[arm].append(res[2][0] * 1e3)  # the step's host CPU (this thread's on a CPU)
            finally:
                ev._failed = False
                BLIND[0] = False
            if arm == "on":
                step_ms.append(ms)
                per_step.append(dict(NS))
                calls.append(dict(CALLS))
            else:
                (off_ms if arm == "muted" else blind_ms).append(ms)
                if arm == "blind":
                    blind_parts.append(dict(NS))
    steady = bool(ev is not None and ev._steady)
    left = sum(1 for p in model.parameters() if p._backward_hooks is not None or p._post_accumulate_grad_hooks is not None)
    agent.close()
    parts = sorted({k for d in per_step for k in d})
    totals = [sum(v for k, v in d.items() if not k.startswith("x ")) / 1e3 for d in per_step]  # sub-parts nest
    med_step = statistics.median(step_ms)
    what = f"GPT-2 {args.layers} layers (n_embd {args.embd}), {args.backend}, {args.dtype}, batch {args.batch}x{args.seq}"
    print(f"[own] {what}, {device}{' ' + torch.cuda.get_device_name() if device == 'cuda' else ''}, torch "
          f"{torch.__version__}; {args.steps} steps after {args.warmup}; steady mode {'on' if steady else 'OFF'}")
    for p in parts:
        xs = [d.get(p, 0) / 1e3 for d in per_step]
        n = statistics.median([d.get(p, 0) for d in calls])
        print(f"[own]   {p:48s} {statistics.median(xs):8.1f} µs/step (p90 {sorted(xs)[int(0.9 * len(xs))]:.1f}), "
              f"{n:g} calls")
    q = sorted(totals)
    print(f"[own] the capture's own time per step: median {statistics.median(totals):.1f} µs (p10 {q[len(q) // 10]:.1f}, "
          f"p90 {q[9 * len(q) // 10]:.1f}); step median {med_step:.3f} ms; share "
          f"{statistics.median(totals) / (med_step * 1e3):.3%}")
    if off_ms:
        d = [a - b for a, b in zip(step_ms, off_ms)]
        lo, hi = bootstrap_median(d)
        print(f"[own] A/B in this process, {len(d)} pairs: step with the evidence {statistics.median(step_ms):.3f} ms, "
              f"muted {statistics.median(off_ms):.3f} ms; paired difference median {statistics.median(d) * 1e3:+.1f} µs "
              f"(95% bootstrap {lo * 1e3:+.1f} .. {hi * 1e3:+.1f}) = {statistics.median(d) / statistics.median(off_ms):+.3%}")
    if blind_ms:
        print("[own] arms: on = the evidence as shipped; muted = its hooks and checks return at once; blind to "
              "zero_grad = on, but the forward's pass reads every .grad (as before the optimizer's zero_grad was "
              "watched; --sub-parts shows that pass as 'x snapshot')")
        for p in sorted({k for d in blind_parts for k in d}):
            xs = [d.get(p, 0) / 1e3 for d in blind_parts]
            print(f"[own]   blind to zero_grad: {p:28s} {statistics.median(xs):8.1f} µs/step")
        for name, xs, ys in (("blind to zero_grad − muted", blind_ms, off_ms), ("on − blind to zero_grad", step_ms, blind_ms)):
            d = [a - b for a, b in zip(xs, ys)]
            lo, hi = bootstrap_median(d)
            print(f"[own] A/B {name}: paired difference median {statistics.median(d) * 1e3:+.1f} µs (95% bootstrap "
                  f"{lo * 1e3:+.1f} .. {hi * 1e3:+.1f}) = {statistics.median(d) / statistics.median(off_ms):+.3%}")
    if off_ms:  # the same pairs by the host's CPU time: on a CPU, the calling thread's (no other process's)
        for a, b in (("on", "muted"), ("blind", "muted"), ("on", "blind")):
            if CPU_MS[a] and CPU_MS[b]:
                d = [x - y for x, y in zip(CPU_MS[a], CPU_MS[b])]
                lo, hi = bootstrap_median(d)
                print(f"[own] host CPU time, {a} − {b}: paired difference median {statistics.median(d) * 1e3:+.1f} µs "
                      f"(95% bootstrap {lo * 1e3:+.1f} .. {hi * 1e3:+.1f}) of a {statistics.median(CPU_MS[b]):.3f} ms step")
    print(f"[own] parameters with a hook left on them in steady mode (torch's C++ hook included): {left} of "
          f"{sum(1 for _ in model.parameters())}")


def bootstrap_median(xs: list[float], n: int = 2000) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``xs``."""
    import random

    rnd = random.Random(0)
    meds = sorted(statistics.median(rnd.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n)]


if __name__ == "__main__":
    main()
