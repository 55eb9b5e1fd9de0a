"""The live watch's cost per training step (issue 38 benchmark, first half): the demo's model
(GPT-2, 2 blocks, DDP on a 1-rank gloo group, compiled with aot_eager, AdamW) on CPU, in one
process, with the agent's heartbeat thread on (B) and off (A) in alternating blocks of the same
steps (NOTE: [Live watch] in capture/heartbeat.py).

Reported: per block pair, the process's CPU seconds per step (all threads: the heartbeat's
included) and B/A - 1; their median and spread; and the heartbeat's own accounting — its thread's
CPU seconds per beat (``Heartbeat.cpu_s / beats``) times the beats per step, over the CPU seconds
per step. The second figure is the one noise cannot hide (a 0.1% effect is below the blocks'
spread on a shared machine); the first checks it. Last, the training thread's own cost of the
step timing (NOTE: [Time outside the compiled step]): the two calls a step, timed alone.

    python bench/bench_heartbeat.py [--pairs 6] [--steps 30] [--interval 2] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30, help="steps per block")
    ap.add_argument("--interval", type=float, default=2.0, help="heartbeat seconds (the default)")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ["GRAPHDECK_HEARTBEAT_S"] = "0"  # the bench starts and stops the thread itself

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from graphdeck.capture import Agent
    from graphdeck.capture.heartbeat import Heartbeat
    from graphdeck.demo import _quiet_dynamo_record_function, build_model

    _quiet_dynamo_record_function()
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    store = os.path.join(tempfile.mkdtemp(prefix="bench-hb-"), "s.db")
    agent = Agent(store=store, run="bench")
    model = agent.watch(build_model(n_layer=args.layers))
    compiled = torch.compile(DDP(model, bucket_cap_mb=1), backend=agent.backend("aot_eager"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)

    def block(n: int) -> float:
        t0 = time.process_time()
        for _ in range(n):
            tokens = torch.randint(0, 2048, (4, 64), generator=gen)
            compiled(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.process_time() - t0) / n

    block(3)  # compile, warm up
    # One heartbeat thread for the whole run, as in a job (its SQLite connection is opened once);
    # in A blocks its beats do nothing (the thread still wakes: a few µs).
    hb = Heartbeat(agent, args.interval, None)
    ratios, a_steps, b_steps = [], [], []
    for i in range(args.pairs):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        got = {}
        for which in order:
            if which == "B":
                hb.__dict__.pop("beat", None)
            else:
                hb.beat = lambda *a, **k: None
            got[which] = block(args.steps)
        a_steps.append(got["A"])
        b_steps.append(got["B"])
        ratios.append(got["B"] / got["A"] - 1)
        print(f"pair {i}: A {got['A'] * 1e3:.1f} ms/step, B {got['B'] * 1e3:.1f} ms/step, B/A-1 {ratios[-1]:+.2%}",
              flush=True)
    step_cpu = statistics.median(a_steps)
    hb._stop.set()
    hb._thread.join()
    beats, beat_cpu = hb.beats, hb.cpu_s
    per_beat = beat_cpu / beats if beats else float("nan")
    b_steps_n = args.pairs * args.steps
    own = per_beat * beats / b_steps_n / step_cpu if beats else float("nan")
    print(f"A/B: median B/A-1 {statistics.median(ratios):+.2%}, spread {min(ratios):+.2%} .. {max(ratios):+.2%} "
          f"({args.pairs} pairs x {args.steps} steps; CPU {step_cpu * 1e3:.1f} ms/step)")
    print(f"heartbeat's own CPU: {per_beat * 1e3:.2f} ms/beat x {beats} beats over {b_steps_n} steps = "
          f"{own:.3%} of a step's CPU (interval {args.interval:g} s)")
    # The step timing on the training thread (NOTE: [Time outside the compiled step]): at each
    # optimizer step and at the next step's first compiled call, a clock read and the recorder's
    # status (whether a collective came in between); timed alone, many times.
    hb.step_open = False
    n = 2000
    t0 = time.process_time()
    for _ in range(n):
        hb._step_ended()
        hb.entered(agent)
    per_step = (time.process_time() - t0) / n
    print(f"time outside the compiled step (training thread): {per_step * 1e6:.1f} us/step = "
          f"{per_step / step_cpu:.3%} of a step's CPU")
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
