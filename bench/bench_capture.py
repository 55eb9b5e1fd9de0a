"""Capture overhead: graphdeck's backend vs the same inner backend alone, in one process.

Anchor: ``torch.compile(model, backend=INNER)``. Measured: ``torch.compile(model,
backend=agent.backend(INNER))`` on the same model in the same process. For each, the first step
(Dynamo + compile, plus capture for graphdeck; Inductor's caches off) and the median of the
steady-state steps after it, in three interleaved rounds. Steady state must be ~1.0x:
capture runs at compile time only.

    python bench/bench_capture.py [--inner aot_eager|inductor] [--layers 2] [--steps 10]

``--isolated N``: the cold first step as a job sees it, N alternating plain/captured runs, each
in a fresh process with a fresh ``TORCHINDUCTOR_CACHE_DIR`` (Inductor's and AOTAutograd's caches
on, as by default, but empty). Reported per run: the first step's CPU seconds (the process and
its children: Inductor's g++ runs in child processes) and, for captured runs, where the agent's
own time goes: the shadow AOT trace (``capture/aot.py``), the rest of recording before the inner
compile (layout, Dynamo graph), and writing the graphs after it (``Agent._finish``).

    TORCHINDUCTOR_COMPILE_THREADS=1 python bench/bench_capture.py --inner inductor --layers 2 --isolated 3

``--modes captured_sync,captured``: the capture with every store write on the compiling thread
(``GRAPHDECK_WRITER_THREAD=0``, as before the writer thread) against the capture as it is, in
alternating fresh-process pairs; per mode the capture's CPU seconds on the compiling thread
(``capture_compiling_cpu_s``: the backend, the late backward write and the structured-log
handler; per compile too) and on the ``graphdeck-writer`` thread (``writer_thread_cpu_s``).

    python bench/bench_capture.py --inner aot_eager --layers 4 --isolated 4 --modes captured_sync,captured
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
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


def cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (user + system)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(holder: dict, key: str, fn):
    """``fn`` wrapped so that its CPU seconds (the calling thread's only: the graphdeck-writer
    thread's work is not counted) add up in ``holder[key]``."""
    def run(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            holder[key] = holder.get(key, 0.0) + time.thread_time() - t0
    return run


def once(inner: str, layers: int, mode: str) -> dict:
    """One cold first step in this process (``mode`` plain, captured, or shadow: captured with
    the shadow AOT trace for every graph, as before the graphs came from the inner compile);
    a JSON-able dict."""
    from graphdeck.capture import Agent
    from graphdeck.capture import agent as agent_mod
    from graphdeck.demo import build_model

    torch.manual_seed(0)
    model = build_model(n_layer=layers)
    tokens = torch.randint(0, model.config.vocab_size, (4, 64))
    phases: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        agent = None
        if mode == "shadow":  # no graphs from the inner compile (NOTE: [Graphs from the inner compile])
            agent_mod.recording_backend = lambda *a, **k: None
        if mode not in ("plain", "config"):  # captured, captured_sync, shadow
            from graphdeck.capture import aot as aot_mod
            from graphdeck.capture import compile_record as record_mod

            # the shadow trace is called from the agent (a cache hit) and from compile_record
            shadow = timed(phases, "shadow_aot_s", agent_mod.shadow_trace)
            agent_mod.shadow_trace = record_mod.shadow_trace = shadow
            agent_mod.Agent._finish = timed(phases, "finish_write_s", agent_mod.Agent._finish)
            aot_mod.Handover.keep = timed(phases, "handover_copy_s", aot_mod.Handover.keep)
            record_mod.write_late_backward = timed(phases, "backward_write_s", record_mod.write_late_backward)
            real_compile = agent_mod.Agent._compile

            def counted(*a, **k):
                phases["compiles"] = phases.get("compiles", 0) + 1
                return real_compile(*a, **k)

            agent_mod.Agent._compile = counted
            agent = Agent(store=Path(tmp) / "bench.db", run="bench")
            agent.watch(model)
            backend = agent.backend(inner)
        else:
            backend = inner
        if mode == "config" and inner == "inductor":  # plain, with the settings agent.backend makes
            from graphdeck.capture.profile import enable_cpu_kernel_profile
            from graphdeck.capture.provenance import enable_provenance

            enable_provenance()
            enable_cpu_kernel_profile()
        compiled = torch.compile(model, backend=backend)
        c0, w0 = cpu_s(), time.perf_counter()
        compiled(input_ids=tokens, labels=tokens).loss.backward()
        out = {"mode": mode, "first_step_cpu_s": cpu_s() - c0, "first_step_wall_s": time.perf_counter() - w0,
               "torch_structured_logging_s": _torch_logging_s()}
        if agent is not None:
            # the capture's CPU seconds on the compiling thread (backend + late backward write, and
            # the structured-log handler), before close() makes what is still queued
            on_compile = {"capture_compiling_cpu_s": agent.capture_cpu_s + agent._handler.cpu_s,
                          "log_handler_cpu_s": agent._handler.cpu_s}
            agent.close()
            out.update(phases, **on_compile, capture_wall_s=agent.capture_time_s, graphs=len(agent.graph_ids),
                       writer_thread_cpu_s=agent._writer.thread_cpu_s if agent._writer is not None else 0.0)
            n = max(phases.get("compiles", 1), 1)
            out["capture_compiling_cpu_per_compile_s"] = out["capture_compiling_cpu_s"] / n
    return out


def _torch_logging_s() -> float:
    """torch's own ``structured_logging_overhead_s`` summed over this process's compiles (the time
    it spent building structured records for a listener, the capture's log handler included)."""
    try:
        from torch._dynamo.utils import get_compilation_metrics

        return sum(getattr(m, "structured_logging_overhead_s", 0) or 0 for m in get_compilation_metrics())
    except Exception:  # noqa: BLE001 - an older torch
        return 0.0


def isolated(args) -> None:
    rows = []
    modes = ("plain", "captured", "shadow") if args.with_shadow else ("plain", "captured")
    if args.modes:
        modes = tuple(args.modes.split(","))
    for i in range(args.isolated):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache + "/triton")
                if mode == "captured_sync":  # every store write on the compiling thread, as before
                    env["GRAPHDECK_WRITER_THREAD"] = "0"
                else:  # the writer thread is opt-in (capture/writer_thread.py)
                    env.setdefault("GRAPHDECK_WRITER_THREAD", "1")
                res = subprocess.run([sys.executable, __file__, "--once",
                                      "captured" if mode == "captured_sync" else mode, "--inner", args.inner,
                                      "--layers", str(args.layers)], env=env, capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"{mode} run failed:\n{res.stderr[-3000:]}")
            row = json.loads(res.stdout.strip().splitlines()[-1])
            row["mode"] = mode
            rows.append(row)
            print(json.dumps(row), flush=True)

    def stat(mode, key):
        vals = [r[key] for r in rows if r["mode"] == mode and key in r]
        return statistics.median(vals), min(vals), max(vals)

    plain = stat(modes[0], "first_step_cpu_s")
    print(f"GPT-2 {args.layers} layers, inner={args.inner}, {args.isolated} runs each, fresh process + cache per run")
    print(f"first step CPU s: {modes[0]} {plain[0]:.2f} ({plain[1]:.2f}-{plain[2]:.2f})")
    for mode in modes:
        capt = stat(mode, "first_step_cpu_s")
        print(f"{mode}: first step CPU s {capt[0]:.2f} ({capt[1]:.2f}-{capt[2]:.2f}): x{capt[0] / plain[0]:.3f} of plain")
        for key in ("shadow_aot_s", "handover_copy_s", "finish_write_s", "backward_write_s", "capture_wall_s",
                    "capture_compiling_cpu_s", "log_handler_cpu_s", "capture_compiling_cpu_per_compile_s",
                    "writer_thread_cpu_s", "torch_structured_logging_s"):
            if any(key in r for r in rows if r["mode"] == mode):
                m, lo, hi = stat(mode, key)
                print(f"  {key}: {m:.3f} ({lo:.3f}-{hi:.3f}) = {m / plain[0]:.1%} of {modes[0]}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="aot_eager")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--isolated", type=int, default=0, help="alternating fresh-process runs per mode")
    parser.add_argument("--with-shadow", action="store_true",
                        help="--isolated also runs the capture with the shadow trace for every graph (the old way)")
    parser.add_argument("--modes", help="--isolated: the modes alternated (default plain,captured; captured_sync: "
                        "GRAPHDECK_WRITER_THREAD=0, every store write on the compiling thread, as before the writer thread)")
    parser.add_argument("--once", choices=("plain", "captured", "shadow", "config"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the per-run rows of --isolated here")
    args = parser.parse_args()
    if args.once:
        print(json.dumps(once(args.inner, args.layers, args.once)))
        return
    if args.isolated:
        isolated(args)
        return

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
