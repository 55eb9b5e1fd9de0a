"""torch's structured-logging time under capture, with the trace-log gate on and off (NOTE: [Only
the kept records are built] in capture/compile_log.py).

Each run is a fresh process: a GPT-2 (``graphdeck.demo.build_model``, random weights) compiled
through ``agent.backend(INNER)``, one forward + backward; printed per run: the first step's CPU
seconds, torch's own ``structured_logging_overhead_s`` summed over the compilation metrics, and
the agent's own time. "off" makes the gate's truth test plain (any handler listening: every
record built, as before the gate). Runs alternate on/off.

    python bench/bench_log_gate.py [--pairs 2] [--layers 12] [--inner aot_eager]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time


def once(mode: str, layers: int, inner: str) -> None:
    import torch

    if mode == "off":
        import graphdeck.capture.compile_log as c

        c._GatedHandlers.__bool__ = lambda self: len(self) > 0
    from graphdeck.capture import Agent
    from graphdeck.demo import build_model

    torch.manual_seed(0)
    agent = Agent(store=tempfile.mkdtemp() + "/s.db", run="gate")
    model = build_model(n_layer=layers, n_embd=32, vocab_size=256, n_positions=32)
    agent.watch(model)
    compiled = torch.compile(model, backend=agent.backend(inner))
    x = torch.randint(0, 256, (1, 16))
    t0 = time.process_time()
    compiled(input_ids=x, labels=x).loss.backward()
    cpu = time.process_time() - t0
    agent.close()
    log = sum((m.structured_logging_overhead_s or 0) for m in torch._dynamo.utils.get_compilation_metrics())
    print(f"{mode}: first step CPU {cpu:.2f} s, torch structured logging {log:.3f} s, "
          f"agent {agent.capture_time_s:.3f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--inner", default="aot_eager")
    ap.add_argument("--once", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.once:
        once(args.once, args.layers, args.inner)
        return
    for _ in range(args.pairs):
        for mode in ("on", "off"):
            out = subprocess.run([sys.executable, __file__, "--once", mode, "--layers", str(args.layers),
                                  "--inner", args.inner], capture_output=True, text=True)
            print(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-800:], flush=True)


if __name__ == "__main__":
    main()
