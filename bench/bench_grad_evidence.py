"""What the run-time gradient evidence costs a training step, and the store per step.

GPT-2 (``transformers``, random weights, ``--layers`` blocks; ``--model stacks``: two stacks of
small linears with GPT-2's parameter count, SGD) trained with AdamW under ``torch.compile``; three
copies built from one seed: **plain** (``torch.compile(model, backend=INNER)``), **no_evidence**
(the capture with ``GRAPHDECK_GRAD_EVIDENCE=0``) and **captured** (``Agent.watch(model)`` +
``backend=agent.backend(INNER)``: graph capture at compile time, and per backward the gradient
evidence — in steady mode two C-speed passes over the parameters' ``.grad`` and a pre-hook on each
compiled call's outputs; NOTE: [Steady mode] in ``capture/grad_steady.py``). After warm-up (the
compiles), ``--rounds`` rounds of ``--steps`` steps each, one step of each mode in turn (order
reversed in odd rounds). Per step: CUDA events (GPU) or ``perf_counter`` (CPU) for the step's
time; the host CPU of ``step()`` itself (process CPU on CUDA, where autograd's device thread runs
the backward; the calling thread's CPU on a CPU). Printed: median step time per mode and round,
the captured/plain ratio of the medians and its spread (min–max of the per-round ratios), CPU
seconds per step, **the capture's host CPU per step** (captured − plain, no_evidence − plain,
captured − no_evidence: medians of the paired per-step differences, per-round spread), whether
the evidence was in steady mode at the end, and the store: ``grad_steps`` rows and bytes after
the warm-up and after all timed steps (every timed step is unchanged, so the target is no new
row and ≤ 1 KiB per step).

    python bench/bench_grad_evidence.py                                # CPU: 12 layers, aot_eager, fp32
    python bench/bench_grad_evidence.py --model stacks --params 76 --rounds 10 --steps 40   # CPU, the capture alone
    python bench/bench_grad_evidence.py --device cuda --backend inductor --dtype bf16 --batch 8 --seq 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch


def build(layers: int, device: str, seed: int = 0, embd: int = 768, vocab: int = 50257):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    special = min(50256, vocab - 1)  # GPT-2's <|endoftext|>, inside a smaller test vocabulary
    cfg = GPT2Config(n_layer=layers, n_embd=embd, n_head=12, vocab_size=vocab, n_positions=1024,
                     attn_implementation="eager", bos_token_id=special, eos_token_id=special)
    model = GPT2LMHeadModel(cfg).to(device)
    model.config.use_cache = False
    model.loss_type = "ForCausalLM"  # said, not guessed (transformers warns when it guesses)
    return model


class _Out(NamedTuple):
    loss: torch.Tensor


class TwoStacks(torch.nn.Module):
    """``--model stacks``: the capture's per-step machinery without the model's own cost — two
    stacks of 4×4 linear layers (``params`` tensors in all, as GPT-2 with ``params`` = 76 at 6
    layers, 148 at 12) compiled as two graphs (a graph break between them, as GPT-2's loss under
    Dynamo), a step of ~1-5 ms on a CPU, where a few µs show."""

    def __init__(self, params: int):
        super().__init__()
        n = max(1, params // 4)
        self.a = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n)])
        self.b = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n)])

    def forward(self, input_ids=None, labels=None):
        h = self.a(input_ids)
        torch._dynamo.graph_break()
        loss = self.b(h).pow(2).mean()
        return _Out(loss)


def make_step(model, compiled, opt, batch, dtype, device):
    def step():
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            loss = compiled(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def timed(step, steps: int, device: str) -> tuple[list[float], float, list[float]]:
    """Per-step milliseconds, CPU seconds per step (with the wait for the GPU), and per step the
    CPU seconds of ``step()`` itself (before any wait: the host's work, which a launch-bound
    step's time is made of)."""
    times, host = [], []
    # CPU: autograd runs the backward on the calling thread, so this thread's CPU is the step's
    # (other processes' and threads' noise stays out); CUDA: the backward runs on autograd's device
    # thread, so the whole process's CPU.
    clock = time.process_time if device == "cuda" else time.thread_time
    cpu0 = clock()
    for _ in range(steps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            c0 = clock()
            step()
            host.append(clock() - c0)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0, c0 = time.perf_counter(), clock()
            step()
            host.append(clock() - c0)
            times.append((time.perf_counter() - t0) * 1e3)
    return times, (clock() - cpu0) / steps, host


def store_size(path: Path) -> tuple[int, int, int]:
    """(grad_steps rows, bytes of their state_json, file bytes incl. WAL)."""
    import sqlite3

    con = sqlite3.connect(path)
    rows, size = con.execute("SELECT count(*), coalesce(sum(length(state_json)), 0) FROM grad_steps").fetchone()
    con.close()
    files = sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
    return rows, size, files


def checkpointed(path: Path) -> None:
    """Fold the WAL into the main file, so file bytes measure the store, not the log."""
    import sqlite3

    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()


def model_of(args, device: str) -> torch.nn.Module:
    if args.model == "stacks":
        torch.manual_seed(0)
        return TwoStacks(args.params).to(device)
    return build(args.layers, device, embd=args.embd, vocab=args.vocab)


def optimizer(model, args, fused: dict):
    """AdamW for GPT-2 (fused on CUDA); plain SGD for ``--model stacks`` (the optimizer is not what
    is measured there, and ~76 tiny AdamW states would be most of the step)."""
    if args.model == "stacks":
        return torch.optim.SGD(model.parameters(), lr=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--embd", type=int, default=768, help="hidden size (a multiple of 12; small on CPU: the "
                    "capture's Python per step is then visible beside the model's own work)")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--model", default="gpt2", choices=["gpt2", "stacks"])
    ap.add_argument("--params", type=int, default=76, help="--model stacks: parameter tensors")
    args = ap.parse_args()
    from graphdeck.capture import Agent

    device, dtype = args.device, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    tmp = Path(tempfile.mkdtemp(prefix="bench-evidence-"))
    store = tmp / "bench.db"
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), device=device,
                          generator=torch.Generator(device=device).manual_seed(0))
    if args.model == "stacks":
        batch = torch.randn(args.batch, 4, device=device, generator=torch.Generator(device=device).manual_seed(0))
    fused = {"fused": True} if device == "cuda" else {"foreach": True}

    plain_model = model_of(args, device)
    plain_opt = optimizer(plain_model, args, fused)
    plain = make_step(plain_model, torch.compile(plain_model, backend=args.backend), plain_opt, batch, dtype, device)

    cap_model = model_of(args, device)
    agent = Agent(store=store, run="bench")
    agent.watch(cap_model)
    cap_opt = optimizer(cap_model, args, fused)
    captured = make_step(cap_model, torch.compile(cap_model, backend=agent.backend(args.backend)), cap_opt, batch,
                         dtype, device)
    # The same capture with the gradient evidence switched off: what the evidence alone costs.
    os.environ["GRAPHDECK_GRAD_EVIDENCE"] = "0"
    noev_model = model_of(args, device)
    noev_agent = Agent(store=tmp / "noev.db", run="bench")
    noev_agent.watch(noev_model)
    del os.environ["GRAPHDECK_GRAD_EVIDENCE"]
    noev_opt = optimizer(noev_model, args, fused)
    no_evidence = make_step(noev_model, torch.compile(noev_model, backend=noev_agent.backend(args.backend)), noev_opt,
                            batch, dtype, device)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        plain()
        captured()
        no_evidence()
    if device == "cuda":
        torch.cuda.synchronize()
    what = (f"two stacks of 4x4 linears, {args.params} parameters, 2 graphs" if args.model == "stacks" else
            f"GPT-2 {args.layers} layers (n_embd {args.embd}, vocabulary {args.vocab})")
    print(f"[bench] {what}, {args.backend}, {args.dtype}, batch {args.batch}x{args.seq}, "
          f"{device}{' ' + torch.cuda.get_device_name() if device == 'cuda' else ''}, torch {torch.__version__}; "
          f"warm-up {args.warmup} steps each: {time.perf_counter() - t0:.1f} s")
    agent._evidence.flush()
    checkpointed(store)
    before = store_size(store)
    per_round = []
    host: dict[str, list[float]] = {"plain": [], "captured": [], "no_evidence": []}
    for r in range(args.rounds):
        order = [("plain", plain), ("no_evidence", no_evidence), ("captured", captured)]
        if r % 2:
            order.reverse()
        res = {name: ([], 0.0, []) for name, _ in order}
        for _ in range(args.steps):  # one step of each in turn: the host's noise falls on all three alike
            for name, fn in order:
                t, c, h = timed(fn, 1, device)
                res[name] = (res[name][0] + t, res[name][1] + c / args.steps, res[name][2] + h)
        mp, mc, mn = (statistics.median(res[k][0]) for k in ("plain", "captured", "no_evidence"))
        per_round.append((mp, mc, res["plain"][1], res["captured"][1], mn, res["no_evidence"][1],
                          *(statistics.median(res[k][2]) for k in ("plain", "captured", "no_evidence"))))
        for k in host:
            host[k] += res[k][2]
        print(f"[bench] round {r}: plain {mp:.2f} ms/step (cpu {res['plain'][1] * 1e3:.1f} ms), capture without "
              f"evidence {mn:.2f} (cpu {res['no_evidence'][1] * 1e3:.1f}), captured {mc:.2f} ms/step "
              f"(cpu {res['captured'][1] * 1e3:.1f} ms); captured/plain {mc / mp:.4f}, captured/no-evidence {mc / mn:.4f}")
    agent._evidence.flush()
    checkpointed(store)
    after = store_size(store)
    agent.close()
    ratios = [x[1] / x[0] for x in per_round]
    ev_ratios = [x[1] / x[4] for x in per_round]
    mp = statistics.median(x[0] for x in per_round)
    mc = statistics.median(x[1] for x in per_round)
    mn = statistics.median(x[4] for x in per_round)
    timed_steps = args.rounds * args.steps
    print(f"[bench] step time: plain {mp:.2f} ms, captured {mc:.2f} ms; captured/plain {mc / mp:.4f} "
          f"(per round {min(ratios):.4f}–{max(ratios):.4f}); CPU s/step plain "
          f"{statistics.median(x[2] for x in per_round):.4f}, captured {statistics.median(x[3] for x in per_round):.4f}, "
          f"without evidence {statistics.median(x[5] for x in per_round):.4f}")
    print(f"[bench] the evidence alone: captured/no-evidence {mc / mn:.4f} (per round {min(ev_ratios):.4f}–"
          f"{max(ev_ratios):.4f}); CPU s/step difference "
          f"{statistics.median(x[3] - x[5] for x in per_round) * 1e3:+.3f} ms")
    # The capture's own CPU: step() alone (no wait), per step. The three modes run one step each in
    # turn, so the i-th steps of two modes share the host's state: the figure is the median over all
    # timed steps of the paired differences; spread = min–max over rounds of that round's median.
    med = {k: statistics.median(v) * 1e6 for k, v in host.items()}

    def paired(a: str, b: str) -> tuple[float, float, float]:
        d = [(x - y) * 1e6 for x, y in zip(host[a], host[b])]
        rounds = [statistics.median(d[r * args.steps:(r + 1) * args.steps]) for r in range(args.rounds)]
        return statistics.median(d), min(rounds), max(rounds)

    cap, noev, ev_only = paired("captured", "plain"), paired("no_evidence", "plain"), paired("captured", "no_evidence")
    print(f"[bench] host CPU of step() (µs, median over {timed_steps} steps per mode): plain {med['plain']:.0f}, "
          f"no_evidence {med['no_evidence']:.0f}, captured {med['captured']:.0f}")
    print(f"[bench] capture's CPU per step (median of paired per-step differences, per-round min to max): "
          f"captured − plain {cap[0]:+.0f} µs ({cap[1]:+.0f} to {cap[2]:+.0f}) = {cap[0] / med['plain']:+.2%} of plain, "
          f"captured/plain {(med['plain'] + cap[0]) / med['plain']:.4f}; no_evidence − plain {noev[0]:+.0f} µs "
          f"({noev[1]:+.0f} to {noev[2]:+.0f}); captured − no_evidence {ev_only[0]:+.0f} µs "
          f"({ev_only[1]:+.0f} to {ev_only[2]:+.0f})")
    ev = agent._evidence
    if ev is not None:
        print(f"[bench] evidence: steady mode {'on' if ev._steady else 'OFF'} at the end, "
              f"{ev._backwards} backward passes observed, stopped: {ev._failed}")
    print(f"[bench] store: after warm-up {before[0]} grad_steps rows ({before[1]} B of state), after "
          f"{timed_steps} more unchanged steps {after[0]} rows ({after[1]} B); file bytes {before[2]} -> {after[2]} "
          f"({(after[2] - before[2]) / timed_steps:.1f} B/step)")


if __name__ == "__main__":
    main()
