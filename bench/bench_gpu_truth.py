"""GPU truth (issue 22): one captured GPT-2 run's artifacts, and what the capture costs on a GPU.

GPT-2 (``transformers``, random weights, ``--layers`` blocks, 768 wide, eager attention) trained
with fused AdamW (``foreach`` on CPU) under ``torch.compile`` (Inductor) and bf16 autocast.

``artifact OUT``: one run captured as a user would: ``Agent.watch`` + ``backend=agent.backend(...)``,
``TORCH_TRACE`` on (set by the caller), two warm-up steps, then ``agent.profile`` over two active
steps with CUDA memory history recording (``torch.cuda.memory._record_memory_history``) around
them. Written to OUT: ``gpt2.db.gz`` (the store, WAL folded), ``gpt2_rank0.pt.trace.json.gz``
(Kineto), ``snapshot.pickle.gz`` (``torch.cuda.memory._snapshot()`` after the recorded steps),
``info.json`` (versions, ``max_memory_allocated`` over the recorded steps in bytes, step ms).

``once --mode plain|captured``: one fresh process (the caller gives it a fresh Inductor and Triton
cache): the first step's wall seconds (Dynamo + Inductor compile + the step, synchronised) and
the steady steps' times (CUDA events, ms), the compiling process's CPU seconds over the first step
(``--profile PATH``: a cProfile of it), printed as one JSON line.

``bench``: ``--runs`` × (plain, captured) ``once`` processes, alternating (order reversed in odd
runs), each with fresh ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``; prints per-run figures
and the captured/plain ratios of compile time and steady step (medians, min–max spread).

    TORCH_TRACE=/tmp/tt python bench/bench_gpu_truth.py artifact OUT --layers 6
    python bench/bench_gpu_truth.py bench --layers 6 --runs 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(layers: int, device: str, seed: int = 0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                     attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).to(device)
    model.config.use_cache = False
    return model


def setup(args, captured: bool, store: Path | None):
    """(step function, agent or None)."""
    import torch

    device = args.device
    model = build(args.layers, device)
    agent = None
    if captured:
        from graphdeck.capture import Agent

        agent = Agent(store=store, run="gpt2")
        agent.watch(model)
        compiled = torch.compile(model, backend=agent.backend(args.backend))
    else:
        compiled = torch.compile(model, backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device == "cuda" else {"foreach": True}))
    batch = torch.randint(0, 50257, (args.batch, args.seq), device=device,
                          generator=torch.Generator(device=device).manual_seed(0))
    dtype = torch.bfloat16

    def step():
        with torch.autocast(device_type=device, dtype=dtype):
            loss = compiled(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, agent


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed_steps(step, n: int, device: str) -> list[float]:
    import torch

    out = []
    for _ in range(n):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def once(args) -> None:
    import resource

    tmp = Path(tempfile.mkdtemp(prefix="gpu-truth-"))
    step, agent = setup(args, args.mode.startswith("captured"), tmp / "s.db")
    sync(args.device)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    c0, k0 = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    step()
    sync(args.device)
    compile_s = time.perf_counter() - t0
    # The compiling process's own CPU (Dynamo, AOTAutograd, Inductor's lowering and codegen, the
    # capture; all of it on the step's path), and the compile workers' that ended (Triton builds).
    compile_cpu_s = time.process_time() - c0
    k1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    children_cpu_s = (k1.ru_utime + k1.ru_stime) - (k0.ru_utime + k0.ru_stime)
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    timed_steps(step, 3, args.device)
    ms = timed_steps(step, args.steps, args.device)
    capture_s, metrics, split = None, torch_metrics(), {}
    if agent is not None:
        capture_s = agent.capture_time_s
        # where the capture's time went (CPU seconds; NOTE: [Writes off the compiling thread]):
        # on the compiling thread, in the backend and the late backward write, and in the
        # structured-log handler (inside torch's structured_logging_overhead_s); on the writer thread
        split = {"capture_compiling_cpu_s": agent.capture_cpu_s, "capture_log_handler_cpu_s": agent._handler.cpu_s}
        agent.close()
        split["capture_writer_thread_cpu_s"] = agent._writer.thread_cpu_s if agent._writer is not None else 0.0
    print("RESULT " + json.dumps({"mode": args.mode, "compile_s": compile_s, "compile_cpu_s": compile_cpu_s,
                                  "children_cpu_s": children_cpu_s, "step_ms": ms, "capture_s": capture_s,
                                  **split, "metrics": metrics}), flush=True)


def torch_metrics() -> dict:
    """Sums of torch's own compile metrics in this process (``torch._dynamo.utils.
    get_compilation_metrics()``, seconds; plain and captured runs alike): the split of the compile,
    ``structured_logging_overhead_s`` included (the time torch spent building structured records
    for a handler, here the agent's)."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:
        return {}
    out: dict[str, float] = {}
    for m in get_compilation_metrics():
        for k, v in vars(m).items():
            if k.endswith(("_s", "_us")) and isinstance(v, (int, float)) and not isinstance(v, bool):
                key = "compilation_metrics." + (k[:-3] + "_s" if k.endswith("_us") else k)
                out[key] = out.get(key, 0.0) + (v / 1e6 if k.endswith("_us") else v)
    return out


def bench(args) -> None:
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.runs):
        order = modes if r % 2 == 0 else modes[::-1]
        for mode in order:
            tmp = tempfile.mkdtemp(prefix="gpu-truth-cache-")
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "TRITON_CACHE_DIR": f"{tmp}/triton"}
            env.pop("TORCH_TRACE", None)
            if mode == "captured_noprov":  # the capture without Inductor's provenance tracking
                env["GRAPHDECK_PROVENANCE"] = "0"
            if mode == "captured_sync":  # every store write on the compiling thread (no graphdeck-writer)
                env["GRAPHDECK_WRITER_THREAD"] = "0"
            else:  # the writer thread is opt-in (capture/writer_thread.py)
                env.setdefault("GRAPHDECK_WRITER_THREAD", "1")
            cmd = [sys.executable, __file__, "once", "--mode", mode, "--layers", str(args.layers), "--device",
                   args.device, "--backend", args.backend, "--batch", str(args.batch), "--seq", str(args.seq),
                   "--steps", str(args.steps)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(out.stdout[-2000:], out.stderr[-4000:], flush=True)
                raise SystemExit(f"{mode} run {r} failed")
            res = json.loads(line[7:])
            results[mode].append(res)
            print(f"[bench] run {r} {mode}: first step {res['compile_s']:.2f} s "
                  f"(CPU {res.get('compile_cpu_s', 0):.2f} s), steady median "
                  f"{statistics.median(res['step_ms']):.3f} ms (min {min(res['step_ms']):.3f}, "
                  f"max {max(res['step_ms']):.3f})"
                  + (f", capture itself {res['capture_s']:.2f} s" if res.get("capture_s") is not None else "")
                  + (f" (CPU: compiling thread {res['capture_compiling_cpu_s']:.2f} s + log handler "
                     f"{res['capture_log_handler_cpu_s']:.2f} s; writer thread {res['capture_writer_thread_cpu_s']:.2f} s)"
                     if "capture_compiling_cpu_s" in res else "")
                  + "".join(f", {k.split('.')[-1]} {v:.2f}" for k, v in (res.get("metrics") or {}).items()
                            if k.startswith("compilation_metrics.") and ("logging" in k or "inductor" in k)),
                  flush=True)
            shutil.rmtree(tmp, ignore_errors=True)
            if args.json:  # written after every run: a run cut short by a time limit keeps what it had
                Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    if "plain" not in results or "captured" not in results:
        return
    cp = [x["compile_s"] for x in results["plain"]]
    cc = [x["compile_s"] for x in results["captured"]]
    sp = [statistics.median(x["step_ms"]) for x in results["plain"]]
    sc = [statistics.median(x["step_ms"]) for x in results["captured"]]
    summary = {
        "compile_plain_s": cp, "compile_captured_s": cc, "step_plain_ms": sp, "step_captured_ms": sc,
        "compile_ratio_median": statistics.median(cc) / statistics.median(cp),
        "compile_ratio_per_run": [c / p for c, p in zip(cc, cp)],
        "compile_cpu_plain_s": [x.get("compile_cpu_s") for x in results["plain"]],
        "compile_cpu_captured_s": [x.get("compile_cpu_s") for x in results["captured"]],
        # the capture's added compile work (captured − plain CPU of the compiling process, medians)
        # as a share of the plain first step's wall time
        "compile_cpu_added_share": (statistics.median(x.get("compile_cpu_s", 0) for x in results["captured"])
                                    - statistics.median(x.get("compile_cpu_s", 0) for x in results["plain"]))
        / statistics.median(cp),
        "step_ratio_median": statistics.median(sc) / statistics.median(sp),
        "step_ratio_per_run": [c / p for c, p in zip(sc, sp)],
        **{f"compile_ratio_median_{m}": statistics.median(x["compile_s"] for x in results[m]) / statistics.median(cp)
           for m in results if m not in ("plain", "captured") and results[m]},
    }
    for m in results:  # the capture's own CPU seconds, compiling thread vs writer thread (medians)
        rows = [x for x in results[m] if "capture_compiling_cpu_s" in x]
        if not rows:
            continue
        on_compile = [x["capture_compiling_cpu_s"] + x["capture_log_handler_cpu_s"] for x in rows]
        summary[f"capture_split_{m}"] = {
            "compiling_thread_cpu_s": on_compile,
            "writer_thread_cpu_s": [x["capture_writer_thread_cpu_s"] for x in rows],
            "compiling_thread_share_of_plain": statistics.median(on_compile) / statistics.median(cp)}
    print("[bench] SUMMARY " + json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results, "summary": summary}, indent=1))


def keep_store(store: Path, dest: Path) -> None:
    """Gzip a SQLite store with its write-ahead log folded in (a test input that travels whole)."""
    con = sqlite3.connect(store)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    with open(store, "rb") as fin, gzip.open(dest, "wb", compresslevel=9) as fout:
        shutil.copyfileobj(fin, fout)


def artifact(args) -> None:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-truth-art-"))
    store = tmp / "gpt2.db"
    step, agent = setup(args, True, store)
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    step()
    sync(args.device)
    first = time.perf_counter() - t0
    step()
    sync(args.device)
    prof = agent.profile(wait_steps=0, warmup_steps=1, active_steps=2, trace_dir=str(tmp))
    info = {"torch": torch.__version__, "first_step_s": first, "layers": args.layers, "batch": args.batch,
            "seq": args.seq, "backend": args.backend}
    if cuda:
        import inspect

        import triton

        info.update(device_name=torch.cuda.get_device_name(), triton=triton.__version__)
        kw = {"max_entries": 200000, "stacks": "python", "context": "all"}
        params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
        if "compile_context" in params:
            kw["compile_context"] = True
        info["record_kwargs"] = kw
        torch.cuda.memory._record_memory_history(**kw)
        torch.cuda.reset_peak_memory_stats()
        info["allocated_before_bytes"] = torch.cuda.memory_allocated()
    ms = []
    with prof:
        for _ in range(3):
            ms += timed_steps(step, 1, args.device)
            prof.step()
    if cuda:
        info["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
        info["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
        info["allocated_after_bytes"] = torch.cuda.memory_allocated()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        import pickle

        with gzip.open(out / "snapshot.pickle.gz", "wb", compresslevel=9) as f:
            pickle.dump(snap, f)
    info["step_ms"] = ms
    agent.close()
    keep_store(store, out / "gpt2.db.gz")
    for p in tmp.glob("*.pt.trace.json.gz"):
        shutil.copy(p, out / p.name)
    (out / "info.json").write_text(json.dumps(info, indent=1))
    print("[artifact] " + json.dumps(info)[:2000], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["artifact", "once", "bench"])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--mode", default="plain", choices=["plain", "captured", "captured_noprov", "captured_sync"])
    ap.add_argument("--modes", default="plain,captured",
                    help="bench: modes alternated per run (captured_noprov: GRAPHDECK_PROVENANCE=0; "
                         "captured_sync: GRAPHDECK_WRITER_THREAD=0, every store write on the compiling thread)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--profile", help="once: cProfile of the first step, written to this path")
    args = ap.parse_args()
    {"artifact": artifact, "once": once, "bench": bench}[args.what](args)


if __name__ == "__main__":
    main()
