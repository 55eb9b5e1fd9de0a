"""Capture overhead: graphdeck's backend vs the same inner backend alone, in one process.

Anchor: ``torch.compile(model, backend=INNER)``. Measured: ``torch.compile(model,
backend=agent.backend(INNER))`` on the same model in the same process. For each, the first step
(Dynamo + compile, plus capture for graphdeck; Inductor's caches off) and the median of the
steady-state steps after it, in three interleaved rounds. Steady state must be ~1.0x:
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


def first_step(compiled, tokens) -> float:
    t0 = time.perf_counter()
    compiled(input_ids=tokens, labels=tokens).loss.backward()
    return time.perf_counter() - t0


def steady_ms(compiled, tokens, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        compiled(input_ids=tokens, labels=tokens).loss.backward()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


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
    # One throwaway compile absorbs one-time import/initialisation costs; Inductor's caches are
    # off so neither side is served by the other's compile.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    first_step(torch.compile(build_model(n_layer=1), backend=args.inner), tokens)
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(store=Path(tmp) / "bench.db", run="bench")
        agent.watch(model)
        anchor = torch.compile(model, backend=args.inner)
        ours = torch.compile(model, backend=agent.backend(args.inner))
        anchor_first = first_step(anchor, tokens)
        ours_first = first_step(ours, tokens)
        anchor_ms, ours_ms = [], []
        for _ in range(3):  # interleaved rounds: drift hits both sides alike
            anchor_ms += steady_ms(anchor, tokens, args.steps)
            ours_ms += steady_ms(ours, tokens, args.steps)
        agent.close()
        graphs = len(agent.graph_ids)
    anchor_steady, ours_steady = statistics.median(anchor_ms) / 1e3, statistics.median(ours_ms) / 1e3
    print(f"GPT-2 {args.layers} layers, inner={args.inner}, {graphs} graphs captured")
    print(f"first step (compile): anchor {anchor_first:.2f} s, graphdeck {ours_first:.2f} s, "
          f"ratio {ours_first / anchor_first:.2f}x; capture itself {agent.capture_time_s:.2f} s = "
          f"{agent.capture_time_s / anchor_first:.2f}x of the anchor's compile")
    if args.inner == "inductor":
        print("  (Inductor's compiled C++ kernels are cached on disk by content even with the FX/AOT caches"
              " off, so the second compile reuses the first's kernels: read the capture time, not the ratio)")
    print(f"steady step (median): anchor {anchor_steady * 1e3:.1f} ms, graphdeck {ours_steady * 1e3:.1f} ms, "
          f"ratio {ours_steady / anchor_steady:.2f}x")


if __name__ == "__main__":
    main()
