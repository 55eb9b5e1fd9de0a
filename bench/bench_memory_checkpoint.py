"""Validate the activation-checkpointing what-if against a real compiled run.

GPT-2 (transformers, random weights; --layers, n_embd 128, vocab 2048, batch 4 × 64), compiled with
Inductor (whose min-cut partitioner honours checkpointing) and captured by graphdeck. One
training step is profiled with ``profile_memory=True`` twice: as is, and with block 0 wrapped in
``torch.utils.checkpoint`` (non-reentrant) and recompiled. Printed: the graph-derived estimate of
checkpointing block 0 (``checkpoint_estimate`` on the captured forward/backward graphs) next to
the measured change of the profiler's peak ``Total Allocated`` (parameters excluded on both
sides: the profiler counts allocations since it started).

    TORCHINDUCTOR_COMPILE_THREADS=1 python bench/bench_memory_checkpoint.py [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.utils.checkpoint
from sqlalchemy import select
from sqlalchemy.orm import Session
from torch.profiler import ProfilerActivity, profile

from graphdeck.analysis.memory import checkpoint_estimate, step_memory
from graphdeck.capture import Agent
from graphdeck.demo import build_model
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph


def peak_bytes(step, tmp: Path) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    path = tmp / "t.json"
    prof.export_chrome_trace(str(path))
    return max(e["args"]["Total Allocated"] for e in json.loads(path.read_text())["traceEvents"]
               if e.get("name") == "[memory]")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    store = tmp / "ckpt.db"
    torch.manual_seed(0)
    agent = Agent(store=store, run="ckpt")
    model = agent.watch(build_model(n_layer=args.layers, n_embd=128, vocab_size=2048, n_positions=64))
    tokens = torch.randint(0, 2048, (4, 64))
    compiled = torch.compile(model, backend=agent.backend("inductor"))

    def step(m):
        return lambda: m(input_ids=tokens, labels=tokens).loss.backward()

    step(compiled)()
    agent.close()
    model.zero_grad(set_to_none=True)
    base = peak_bytes(step(compiled), tmp)

    block = model.transformer.h[0]
    plain = block.forward
    block.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(plain, *a, use_reentrant=False, **k)
    torch._dynamo.reset()
    ck = torch.compile(model, backend="inductor")
    step(ck)()
    model.zero_grad(set_to_none=True)
    with_ckpt = peak_bytes(step(ck), tmp)

    with Session(open_engine(store, read_only=True)) as s:
        fw = s.scalar(select(Graph.id).where(Graph.kind == "aot_forward").order_by(Graph.id))
        bw = s.scalar(select(Graph.id).where(Graph.kind == "aot_backward").order_by(Graph.id))
        curve = step_memory(s, fw, bw)
        est = checkpoint_estimate(s, fw, bw, "transformer/h/0")
    params = curve.by_kind_at_peak.get("parameter", 0)
    print(f"graph-derived step peak (no params): {curve.peak_bytes - params:,} B; measured compiled: {base:,} B "
          f"({(curve.peak_bytes - params - base) / base * 100:+.1f}%)")
    print(f"checkpoint block 0 — estimated: {est.baseline_peak_bytes - params:,} -> {est.estimated_peak_bytes - params:,}"
          f" B (saves {est.saving_bytes:,}); measured: {base:,} -> {with_ckpt:,} B (saves {base - with_ckpt:,})")


if __name__ == "__main__":
    main()
