"""What the gradient fingerprints (NOTE: [Gradient fingerprints] in capture/grad_prints.py) cost a
training step: paired A/B in one process.

The demo model (``graphdeck.demo.build_model``: GPT-2, 2 layers, 128 wide, vocab 2048; ``--layers``
/ ``--embd`` to grow it), AdamW, ``torch.compile`` through the capture agent (``--backend``,
aot_eager by default), batch ``--batch`` × ``--seq`` on ``--device``. One agent and one model; the
fingerprinter is switched per step between three modes, in turn, order rotated each round:

* **off**: no fingerprints (the evidence without ``GradPrints``);
* **idle**: fingerprints on, this step not due (the cost of every step between fingerprinted ones);
* **print**: this step fingerprinted (gradients at the optimizer's pre-hook, parameters at its
  post-hook, one ``compile_events`` row written).

Per step the process CPU seconds (``time.process_time``; on CUDA also the CUDA-event time) of
forward + backward + ``optimizer.step()``. Printed: the median step per mode, and the paired
per-round differences idle − off and print − off (median over rounds of the per-round medians, with
the min–max spread), as a fraction of the off step; and the default cadence's cost on a steady step
(idle − off + (print − off) / 100: one step in 100 fingerprinted).

    python bench/bench_grad_prints.py                          # CPU, demo model
    python bench/bench_grad_prints.py --device cuda --backend inductor --layers 12 --embd 768 --vocab 50257 \\
        --batch 8 --seq 512 --dtype bf16 --fused
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--fused", action="store_true", help="fused AdamW")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="steps per mode per round")
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    from graphdeck.capture import Agent
    from graphdeck.capture.grad_prints import GradPrints

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=4, vocab_size=args.vocab,
                     n_positions=max(128, args.seq), bos_token_id=0, eos_token_id=0, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).to(args.device)
    model.loss_type = "ForCausalLM"
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    store = os.path.join(tempfile.mkdtemp(prefix="bench-prints-"), "b.db")
    agent = Agent(store=store, run="bench", grad_prints="off")
    agent.watch(model)
    ev = agent._evidence
    prints = GradPrints(agent, ev._params, (0, 1))
    own: dict[str, list[float]] = {"idle": [], "print": []}  # thread CPU inside the two hooks, per step
    mode_now = ["off"]
    for name in ("before_step", "after_step"):
        inner = getattr(prints, name)

        def timed(*a, _inner=inner, _first=name == "before_step"):
            t0 = time.thread_time()
            _inner(*a)
            dt = time.thread_time() - t0
            if _first:
                own[mode_now[0]].append(dt)
            else:
                own[mode_now[0]][-1] += dt

        setattr(prints, name, timed)
    compiled = torch.compile(model, backend=agent.backend(args.backend))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused or None)
    gen = torch.Generator().manual_seed(1)
    cuda = args.device.startswith("cuda")

    def step() -> tuple[float, float]:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
        if cuda:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        c0 = time.process_time()
        out = compiled(input_ids=tokens, labels=tokens)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            e1.record()
            torch.cuda.synchronize()
        c1 = time.process_time()
        return c1 - c0, (e0.elapsed_time(e1) / 1e3 if cuda else float("nan"))

    def set_mode(mode: str) -> None:
        mode_now[0] = mode
        if mode == "off":
            ev._prints = None
        else:
            ev._prints = prints
            prints.cadence = (0, 1) if mode == "print" else (0, 0)
            prints._prev_last = None

    for _ in range(args.warmup):
        set_mode("print")
        step()
    modes = ["off", "idle", "print"]
    per: dict[str, list[list[float]]] = {m: [] for m in modes}
    gpu: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes[r % 3:] + modes[:r % 3]
        got = {m: [] for m in modes}
        for _ in range(args.steps):
            for m in order:
                set_mode(m)
                cpu, g = step()
                got[m].append(cpu)
                gpu[m].append(g)
        for m in modes:
            per[m].append(got[m])
    med = {m: statistics.median(x for rnd in per[m] for x in rnd) for m in modes}
    print(f"model: GPT-2 {args.layers} layers × {args.embd}, vocab {args.vocab}, "
          f"{sum(p.numel() for p in model.parameters())/1e6:.2f} M params in "
          f"{sum(1 for _ in model.parameters())} tensors; {args.device}, {args.backend}, {args.dtype}, "
          f"batch {args.batch}×{args.seq}; {args.rounds} rounds × {args.steps} steps per mode")
    for m in modes:
        extra = f", GPU-event {statistics.median(gpu[m]) * 1e3:.2f} ms" if cuda else ""
        print(f"  {m:5s}: median CPU {med[m] * 1e3:.2f} ms/step{extra}")
    for m in ("idle", "print"):
        diffs = [statistics.median(a) - statistics.median(b) for a, b in zip(per[m], per["off"])]
        d = statistics.median(diffs)
        print(f"  {m} − off: {d * 1e3:+.3f} ms/step = {d / med['off'] * 100:+.2f}% of the step "
              f"(per-round spread {min(diffs) * 1e3:+.3f} … {max(diffs) * 1e3:+.3f} ms)")
    idle = statistics.median([statistics.median(a) - statistics.median(b) for a, b in zip(per["idle"], per["off"])])
    fp = statistics.median([statistics.median(a) - statistics.median(b) for a, b in zip(per["print"], per["off"])])
    steady = idle + fp / 100
    for m in ("idle", "print"):
        xs = sorted(own[m][-args.rounds * args.steps:])
        print(f"  the fingerprint hooks' own thread CPU, {m} step: median {statistics.median(xs) * 1e3:.3f} ms "
              f"(p10 {xs[len(xs) // 10] * 1e3:.3f}, p90 {xs[len(xs) * 9 // 10] * 1e3:.3f}) = "
              f"{statistics.median(xs) / med['off'] * 100:.2f}% of the off step")
    print(f"  default cadence (5,100) on a steady step: {steady * 1e3:+.3f} ms = {steady / med['off'] * 100:+.3f}%")
    agent.close()


if __name__ == "__main__":
    main()
