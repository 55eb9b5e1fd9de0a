"""Validate the activation-checkpointing what-if against real checkpointed runs (CPU).

GPT-2 (transformers, random weights), compiled with each ``--backends`` entry and captured by
graphdeck; one training step profiled with ``profile_memory=True``; then block 0 wrapped in
``torch.utils.checkpoint`` (non-reentrant), recompiled, captured again and profiled (the same
program as ``tests/programs/memory_gpt2.py --checkpoint``, which also explains how a step's
peak is read from the profiler). Printed per backend: the graph-derived step peak of the plain
run, the estimate of checkpointing block 0 (``checkpoint_estimate`` on the plain run's graphs),
the graph-derived peak of the captured checkpointed graphs, and the measured peaks — all without
parameters (allocated before profiling) — with the gaps.

    TORCHINDUCTOR_COMPILE_THREADS=1 python bench/bench_memory_checkpoint.py \
        [--backends aot_eager_default_partitioner,aot_eager,inductor] [--batch 8 --seq 128 --vocab 512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory.core import checkpoint_estimate, step_memory
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph, Run

PROGRAM = Path(__file__).resolve().parents[1] / "tests" / "programs" / "memory_gpt2.py"


def pair(session: Session, run: str) -> tuple[int, int]:
    rid = session.scalar(select(Run.id).where(Run.name == run))
    ids = {kind: session.scalar(select(Graph.id).where(Graph.run_id == rid, Graph.kind == kind).order_by(Graph.id))
           for kind in ("aot_forward", "aot_backward")}
    return ids["aot_forward"], ids["aot_backward"]


def gap(a: int, b: int) -> str:
    return f"{(a - b) / b * 100:+.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="aot_eager_default_partitioner,aot_eager,inductor")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    for backend in args.backends.split(","):
        store, out = tmp / f"{backend}.db", tmp / f"{backend}.json"
        code = (f"import sys; sys.argv[0] = {str(PROGRAM)!r}; sys.path.insert(0, {str(PROGRAM.parent)!r});"
                f"import memory_gpt2 as m; m.validate_checkpoint({str(store)!r}, {str(out)!r}, {backend!r}, "
                f"layers={args.layers}, vocab={args.vocab}, batch={args.batch}, seq={args.seq})")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode:
            print(f"{backend}: failed\n{proc.stderr[-3000:]}")
            continue
        measured = json.loads(out.read_text())
        with Session(open_engine(store, read_only=True)) as s:
            fw, bw = pair(s, "base")
            base = step_memory(s, fw, bw)
            params = base.by_kind_at_peak.get("parameter", 0)
            est = checkpoint_estimate(s, fw, bw, "transformer/h/0")
            cf, cb = pair(s, "ckpt")
            real = step_memory(s, cf, cb)
            real_params = real.by_kind_at_peak.get("parameter", 0)
        m_base, m_ckpt = measured["base"], measured["ckpt"]
        ours_base, ours_est = base.peak_bytes - params, est.estimated_peak_bytes - params
        saving_m = m_base - m_ckpt
        print(f"== {backend}: GPT-2 {args.layers} layers, batch {args.batch} x {args.seq}, vocab {args.vocab}")
        print(f"  plain step peak:    graph-derived {ours_base:,} B at {base.peak_node}; measured {m_base:,} B "
              f"({measured['base_phase']}); gap {gap(ours_base, m_base)}")
        print(f"  checkpoint block 0: estimated {ours_est:,} B at {est.estimated_peak_node} ({est.peak_phase}); "
              f"measured {m_ckpt:,} B ({measured['ckpt_phase']}); gap {gap(ours_est, m_ckpt)}")
        print(f"  saving:             estimated {est.saving_bytes:,} B (saved bytes removed {est.saved_bytes_removed:,}); "
              f"measured {saving_m:,} B; gap {gap(est.saving_bytes, saving_m) if saving_m else 'n/a'}")
        print(f"  captured checkpointed graphs: graph-derived {real.peak_bytes - real_params:,} B at {real.peak_node}; "
              f"gap to measured {gap(real.peak_bytes - real_params, m_ckpt)}")


if __name__ == "__main__":
    main()
