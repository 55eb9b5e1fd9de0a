"""The memory what-ifs checked against measured runs of the changed job on a GPU (issue 22 item 2).

GPT-2 (``transformers``, random weights, ``--layers`` blocks, 768 wide, eager attention, batch
``--batch`` × ``--seq``) trained with fused AdamW under ``torch.compile`` (Inductor) and captured
by graphdeck's Agent, three ways in one process (``torch._dynamo.reset()`` between them):

- ``base``: bf16 autocast — the run the what-ifs are computed on;
- ``ckpt``: the same with every block under ``torch.utils.checkpoint`` (non-reentrant) — the
  checkpoint what-if of module path ``--ckpt-path`` (default ``transformer/h``, every block);
- ``fp32``: no autocast — the dtype what-if of the base run with activations in float32.

Per way: two warm-up steps (the compiles), then one forward + backward with the CUDA caching
allocator's history recorded (``torch.cuda.memory._record_memory_history``) after
``reset_peak_memory_stats``. Measured, in bytes above what was allocated when the step began
(parameters, optimizer state): the snapshot's replayed peak (graphdeck's
``analysis.memory.measured.measure``) and ``torch.cuda.max_memory_allocated()``.
Graph-derived, from each way's stored forward/backward graphs without parameters: the step peak
(``step_memory``), and on the base run the estimates (``checkpoint_estimate``,
``dtype_estimate``). Printed and written to ``--json``: each estimate beside the changed run's
measured peak, and the estimated saving beside the measured one (base measured − changed
measured).

    python bench/bench_gpu_whatif.py --layers 6 --json /tmp/whatif.json [--keep DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def checkpoint_blocks(model) -> None:
    import torch.utils.checkpoint

    for block in model.transformer.h:
        plain = block.forward
        block.forward = (lambda f: lambda *a, **k: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False, **k))(plain)


def measure_way(way: str, args, store: Path, snap_dir: Path) -> dict:
    """One way's measured step: bytes above the step's start, from the snapshot and the allocator."""
    import torch
    from bench_gpu_truth import build

    from graphdeck.capture import Agent

    torch._dynamo.reset()
    model = build(args.layers, args.device)
    if way == "ckpt":
        checkpoint_blocks(model)
    agent = Agent(store=store, run=way)
    agent.watch(model)
    compiled = torch.compile(model, backend=agent.backend(args.backend))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    batch = torch.randint(0, 50257, (args.batch, args.seq), device=args.device)
    autocast = way != "fp32"

    def fwd_bwd():
        with torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=autocast):
            loss = compiled(input_ids=batch, labels=batch).loss
        loss.backward()

    for _ in range(2):
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out: dict = {"way": way}
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
        fwd_bwd()
        torch.cuda.synchronize()
        out["max_allocated_above_start_bytes"] = torch.cuda.max_memory_allocated() - before
        out["allocated_at_start_bytes"] = before
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        import pickle

        with gzip.open(snap_dir / f"{way}.snapshot.pickle.gz", "wb", compresslevel=6) as f:
            pickle.dump(snap, f)
        from graphdeck.analysis.memory.measured import measure

        m = measure(snap, {}, device=0)
        out["snapshot_peak_above_start_bytes"] = m.peak_bytes - m.baseline_bytes
        out["snapshot_baseline_bytes"] = m.baseline_bytes
    agent.close()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def derived(store: Path, args) -> dict:
    """Graph-derived step peaks (parameters excluded) and the base run's what-if estimates."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.analysis.memory.core import checkpoint_estimate, dtype_estimate, step_memory
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Graph, Run

    out: dict = {}
    with Session(open_engine(store, read_only=True)) as s:
        def pair(run: str) -> tuple[int, int]:
            rid = s.scalar(select(Run.id).where(Run.name == run))
            return tuple(s.scalar(select(Graph.id).where(Graph.run_id == rid, Graph.kind == k).order_by(Graph.id))
                         for k in ("aot_forward", "aot_backward"))

        for way in ("base", "ckpt", "fp32"):
            fw, bw = pair(way)
            curve = step_memory(s, fw, bw)
            params = curve.by_kind_at_peak.get("parameter", 0)
            out[f"{way}_derived_bytes"] = curve.peak_bytes - params
            if way == "base":
                base_params = params
        fw, bw = pair("base")
        ck = checkpoint_estimate(s, fw, bw, args.ckpt_path)
        dt = dtype_estimate(s, fw, bw, "float32")
        out["ckpt_estimate_bytes"] = ck.estimated_peak_bytes - base_params
        out["ckpt_estimate_saving_bytes"] = ck.saving_bytes
        out["ckpt_estimate_phase"] = ck.peak_phase
        out["fp32_estimate_bytes"] = dt.estimated_peak_bytes - base_params
        out["fp32_estimate_saving_bytes"] = dt.saving_bytes  # negative: float32 grows the step
    return out


def gap(a: float, b: float) -> str:
    return f"{(a - b) / b * 100:+.1f}%" if b else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor", help="aot_eager: a quick check of the script on CPU")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--ckpt-path", default="transformer/h")
    ap.add_argument("--json")
    ap.add_argument("--keep", help="folder for the store (gzip) and the three snapshots")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="whatif-"))
    store = tmp / "whatif.db"
    measured = {w: measure_way(w, args, store, tmp) for w in ("base", "ckpt", "fp32")}
    d = derived(store, args)
    res = {"args": vars(args), "measured": measured, "derived": d}
    mib = 2 ** 20
    if args.device == "cuda":
        mb = {w: measured[w]["snapshot_peak_above_start_bytes"] for w in measured}
        res["compare"] = {
            "base": {"derived": d["base_derived_bytes"], "measured": mb["base"]},
            "ckpt": {"estimate": d["ckpt_estimate_bytes"], "changed_run_derived": d["ckpt_derived_bytes"],
                     "measured": mb["ckpt"], "estimated_saving": d["ckpt_estimate_saving_bytes"],
                     "measured_saving": mb["base"] - mb["ckpt"]},
            "fp32": {"estimate": d["fp32_estimate_bytes"], "changed_run_derived": d["fp32_derived_bytes"],
                     "measured": mb["fp32"], "estimated_saving": d["fp32_estimate_saving_bytes"],
                     "measured_saving": mb["base"] - mb["fp32"]},
        }
        for way, c in res["compare"].items():
            if way == "base":
                print(f"[whatif] base step: derived {c['derived'] / mib:,.1f} MiB, measured {c['measured'] / mib:,.1f} "
                      f"MiB ({gap(c['derived'], c['measured'])})")
                continue
            print(f"[whatif] {way}: estimate {c['estimate'] / mib:,.1f} MiB vs measured {c['measured'] / mib:,.1f} MiB "
                  f"({gap(c['estimate'], c['measured'])}); the changed run's own graphs {c['changed_run_derived'] / mib:,.1f}"
                  f" MiB ({gap(c['changed_run_derived'], c['measured'])}); saving estimated "
                  f"{c['estimated_saving'] / mib:,.1f} MiB vs measured {c['measured_saving'] / mib:,.1f} MiB "
                  f"({gap(c['estimated_saving'], c['measured_saving'])})")
        for w in measured:
            print(f"[whatif] {w}: snapshot peak {measured[w]['snapshot_peak_above_start_bytes'] / mib:,.1f} MiB, "
                  f"max_memory_allocated {measured[w]['max_allocated_above_start_bytes'] / mib:,.1f} MiB above the "
                  f"step's start ({measured[w]['allocated_at_start_bytes'] / mib:,.1f} MiB then)")
    else:
        print("[whatif] derived only (no CUDA): " + json.dumps(d))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.keep:
        keep = Path(args.keep)
        keep.mkdir(parents=True, exist_ok=True)
        from bench_gpu_truth import keep_store

        keep_store(store, keep / "whatif.db.gz")
        for p in tmp.glob("*.snapshot.pickle.gz"):
            shutil.copy(p, keep / p.name)


if __name__ == "__main__":
    main()
