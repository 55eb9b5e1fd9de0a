"""Capture overhead: graphdeck's backend vs the same inner backend alone, in one process.

Anchor: ``torch.compile(model, backend=INNER)``. Measured: ``torch.compile(model,
backend=agent.backend(INNER))``. For each, the first step (Dynamo + compile, plus capture for
graphdeck) and the median of the steady-state steps after it. Steady state must be ~1.0x:
capture runs at compile time only.

    python bench/bench_capture.py [--inner aot_eager|inductor] [--layers 2] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def measure(backend, model, tokens, steps: int) -> tuple[float, float]:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        compiled(input_ids=tokens, labels=tokens).loss.backward()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="aot_eager")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    from graphdeck.capture import Agent
    from graphdeck.demo import build_model

    torch.manual_seed(0)
    model = build_model(n_layer=args.layers)
    tokens = torch.randint(0, model.config.vocab_size, (4, 64))
    anchor_first, anchor_steady = measure(args.inner, model, tokens, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(store=Path(tmp) / "bench.db", run="bench")
        agent.watch(model)
        ours_first, ours_steady = measure(agent.backend(args.inner), model, tokens, args.steps)
        agent.close()
        graphs = len(agent.graph_ids)
    print(f"GPT-2 {args.layers} layers, inner={args.inner}, {graphs} graphs captured")
    print(f"first step (compile): anchor {anchor_first:.2f} s, graphdeck {ours_first:.2f} s, "
          f"ratio {ours_first / anchor_first:.2f}x (capture itself {agent.capture_time_s:.2f} s)")
    print(f"steady step (median): anchor {anchor_steady * 1e3:.1f} ms, graphdeck {ours_steady * 1e3:.1f} ms, "
          f"ratio {ours_steady / anchor_steady:.2f}x")


if __name__ == "__main__":
    main()
