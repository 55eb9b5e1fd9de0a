"""What a peer waits when one rank compiles alone, with and without graphdeck's capture (issue 34).

Two gloo ranks train a small GPT-2 (``transformers``, random weights) under ``torch.compile``;
after the warm-up step rank 0 alone compiles and runs an evaluation forward (a frame the other
rank never compiles: a rank-0-only evaluation), then both ranks enter an all-reduce. Reported per
run: rank 0's compile of that frame (the first evaluation call, s), and rank 1's wait in the
all-reduce (s). Anchor: the same job with ``backend=INNER``; ours: ``backend=agent.backend(INNER)``
with ``Agent.watch``. Runs alternate plain/captured (order reversed every other pair), each pair
in fresh processes with a fresh Inductor cache. The figure the issue bounds: the extra wait the
capture adds, ``median(wait captured) − median(wait plain)``, as a share of rank 0's plain compile
(≤ 10%), and the capture's compile overhead per compile (captured / plain compile of the frame).

    python bench/bench_compile_skew.py [--inner aot_eager|inductor] [--pairs 3] [--layers 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def rank_main(rank: int, mode: str, inner: str, layers: int, port: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=512, n_positions=128)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    agent = None
    if mode == "captured":
        from graphdeck.capture import Agent

        agent = Agent(store=store, run="skew")
        agent.watch(model)
        backend = agent.backend(inner)
    else:
        backend = inner
    train = torch.compile(model, backend=backend)
    tokens = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    train(input_ids=tokens, labels=tokens).loss.backward()  # warm-up: both ranks compile it
    dist.barrier()
    row: dict = {"rank": rank, "mode": mode}
    if rank == 0:  # a rank-0-only evaluation: a frame the other rank never compiles
        def evaluate(m, t):
            with torch.no_grad():
                return m(input_ids=t).logits.softmax(-1).amax(-1).mean()

        ev = torch.compile(evaluate, backend=backend)
        c0, t0 = cpu_s(), time.perf_counter()
        ev(model, tokens)
        row["compile_s"], row["compile_cpu_s"] = time.perf_counter() - t0, cpu_s() - c0
    t0 = time.perf_counter()
    x = torch.ones(1)
    dist.all_reduce(x)
    row["wait_s"] = time.perf_counter() - t0
    if agent is not None:
        agent.close()
    with open(out, "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def run_pair_member(mode: str, inner: str, layers: int, tmp: Path) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp / f"cache-{mode}-{time.time_ns()}"), OMP_NUM_THREADS="1")
    procs, outs = [], []
    for rank in (0, 1):
        out = tmp / f"{mode}-{rank}-{time.time_ns()}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--mode", mode, "--inner", inner,
                                       "--layers", str(layers), "--port", str(port), "--store",
                                       str(tmp / f"{mode}-{time.time_ns()}.db"), "--out", str(out)], env=env))
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"a {mode} rank failed: {p.returncode}")
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    return {"mode": mode, "compile_s": r0["compile_s"], "compile_cpu_s": r0["compile_cpu_s"], "wait_s": r1["wait_s"]}


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", default="aot_eager")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.mode, args.inner, args.layers, args.port, args.store, args.out)
        return
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.pairs):
            for mode in (("plain", "captured") if i % 2 == 0 else ("captured", "plain")):
                rows.append(run_pair_member(mode, args.inner, args.layers, Path(d)))
                print(json.dumps(rows[-1]), flush=True)
    by = {m: [r for r in rows if r["mode"] == m] for m in ("plain", "captured")}
    for m, rs in by.items():
        print(f"{m:9s} rank 0 compile s {spread([r['compile_s'] for r in rs])}, CPU s "
              f"{spread([r['compile_cpu_s'] for r in rs])}; rank 1 wait s {spread([r['wait_s'] for r in rs])}")
    pc, cc = (statistics.median(r["compile_s"] for r in by[m]) for m in ("plain", "captured"))
    pw, cw = (statistics.median(r["wait_s"] for r in by[m]) for m in ("plain", "captured"))
    pairs = [c["compile_cpu_s"] / p["compile_cpu_s"] for p, c in zip(by["plain"], by["captured"])]
    print(f"capture compile overhead (this frame): x{cc / pc:.3f} wall, CPU per pair "
          f"{', '.join(f'x{x:.3f}' for x in pairs)}")
    print(f"extra peer wait under capture: {cw - pw:+.2f} s = {100 * (cw - pw) / pc:+.1f}% of rank 0's plain compile")


if __name__ == "__main__":
    main()
