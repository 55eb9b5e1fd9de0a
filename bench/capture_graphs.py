"""Capture the benchmark graphs of ``bench/bench_svg.py`` into stores under ``/tmp`` (not git).

A random-weight GPT-2 (``graphdeck.demo.build_model``) compiled with the graphdeck backend around
``aot_eager``, one forward + backward on a batch of 1 × 16 tokens: the store gets the Dynamo
graph and the AOT forward and backward graphs, as ``graphdeck demo`` records them.

Run::

    python bench/capture_graphs.py --layers 12 --n-embd 768 --dropout 0.1 --store /tmp/graphdeck-bench-gpt2-12.db
    python bench/capture_graphs.py --layers 200 --n-embd 16 --store /tmp/graphdeck-bench-deep-200.db

An existing store is kept (delete it to capture again).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def capture(store: Path, layers: int, n_embd: int, dropout: float) -> None:
    import torch

    from graphdeck.capture import Agent
    from graphdeck.demo import build_model

    torch.manual_seed(0)
    agent = Agent(store=str(store), run=f"gpt2-{layers}x{n_embd}")
    model = build_model(n_layer=layers, n_embd=n_embd, vocab_size=256, n_positions=32)
    for module in model.modules():  # GPT-2's default dropout (build_model turns it off)
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
    model = agent.watch(model)
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    ids = torch.randint(0, 256, (1, 16))
    compiled(input_ids=ids, labels=ids).loss.backward()
    agent.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 blocks")
    parser.add_argument("--n-embd", type=int, default=768, help="hidden size")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout p (GPT-2's default is 0.1)")
    parser.add_argument("--store", type=Path, required=True, help="SQLite store to write")
    args = parser.parse_args()
    if args.store.exists():
        print(f"{args.store} exists; kept")
        return
    start = time.perf_counter()
    capture(args.store, args.layers, args.n_embd, args.dropout)
    print(f"captured {args.layers} layers into {args.store} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
