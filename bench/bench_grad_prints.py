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

Per step: on CPU the process CPU seconds (``time.process_time``: robust to other load on a shared
machine); on CUDA the wall time between two ``torch.cuda.synchronize()`` calls
(``time.perf_counter``) and the CUDA-event time of the same span. Printed: the median step per mode,
and the paired per-round differences idle − off and print − off (median over rounds of the
per-round medians, with the min–max spread), as a fraction of the off step; the default cadence's
cost on a steady step (idle − off + (print − off) / 100: one step in 100 fingerprinted); then one
JSON line (``--json FILE`` writes it too) with ``fingerprinted_step_ratio`` and
``default_cadence_ratio`` (fractions of the off step, by the primary clock: ``cpu`` or ``wall``).

    OMP_NUM_THREADS=1 python bench/bench_grad_prints.py --rounds 12 --steps 8      # CPU, demo model
    python bench/bench_grad_prints.py --device cuda --backend inductor --gpt2 --batch 8 --seq 512 \\
        --dtype bf16 --fused                  # GPU: GPT-2 12 layers, bf16 weights, fused AdamW
    python bench/bench_grad_prints.py --device cuda --backend inductor --gpt2 --batch 8 --seq 512 \\
        --autocast bf16 --fused               # the same with fp32 weights under bf16 autocast
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
    ap.add_argument("--gpt2", action="store_true", help="GPT-2 small: 12 layers, 768 wide, 12 heads, vocab 50257")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: 4, 12 with --gpt2)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the model's weights")
    ap.add_argument("--autocast", default=None, choices=["bf16"], help="forward under torch.autocast")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the JSON result here")
    ap.add_argument("--fused", action="store_true", help="fused AdamW")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="steps per mode per round")
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()
    if args.gpt2:
        args.layers, args.embd, args.vocab, args.heads = 12, 768, 50257, args.heads or 12

    from transformers import GPT2Config, GPT2LMHeadModel

    from graphdeck.capture import Agent
    from graphdeck.capture.grad_prints import GradPrints

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads or 4, vocab_size=args.vocab,
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

    amp = (torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16) if args.autocast
           else contextlib.nullcontext())

    def step() -> tuple[float, float, float]:
        """(process CPU s, wall s, CUDA-event s or nan) of forward + backward + optimizer step."""
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
        if cuda:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        c0, w0 = time.process_time(), time.perf_counter()
        with amp:
            loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            e1.record()
            torch.cuda.synchronize()
        c1, w1 = time.process_time(), time.perf_counter()
        return c1 - c0, w1 - w0, (e0.elapsed_time(e1) / 1e3 if cuda else float("nan"))

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
    clock = "wall" if cuda else "cpu"  # the primary clock (see the docstring)
    per: dict[str, list[list[float]]] = {m: [] for m in modes}
    other: dict[str, dict[str, list[float]]] = {m: {"cpu": [], "wall": [], "gpu": []} for m in modes}
    for r in range(args.rounds):
        order = modes[r % 3:] + modes[:r % 3]
        got = {m: [] for m in modes}
        for _ in range(args.steps):
            for m in order:
                set_mode(m)
                cpu, wall, g = step()
                got[m].append(wall if cuda else cpu)
                for k, v in (("cpu", cpu), ("wall", wall), ("gpu", g)):
                    other[m][k].append(v)
        for m in modes:
            per[m].append(got[m])
    med = {m: statistics.median(x for rnd in per[m] for x in rnd) for m in modes}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: GPT-2 {args.layers} layers × {args.embd}, vocab {args.vocab}, {n_params / 1e6:.2f} M params in "
          f"{sum(1 for _ in model.parameters())} tensors; {args.device}, {args.backend}, weights {args.dtype}"
          f"{', autocast ' + args.autocast if args.autocast else ''}{', fused AdamW' if args.fused else ''}, "
          f"batch {args.batch}×{args.seq}; {args.rounds} rounds × {args.steps} steps per mode; clock: {clock}")
    for m in modes:
        extra = (f" (CPU {statistics.median(other[m]['cpu']) * 1e3:.2f} ms, GPU-event "
                 f"{statistics.median(other[m]['gpu']) * 1e3:.2f} ms)" if cuda else "")
        print(f"  {m:5s}: median {clock} {med[m] * 1e3:.2f} ms/step{extra}")
    diff = {}
    for m in ("idle", "print"):
        diffs = [statistics.median(a) - statistics.median(b) for a, b in zip(per[m], per["off"])]
        diff[m] = statistics.median(diffs)
        print(f"  {m} − off: {diff[m] * 1e3:+.3f} ms/step = {diff[m] / med['off'] * 100:+.2f}% of the step "
              f"(per-round spread {min(diffs) * 1e3:+.3f} … {max(diffs) * 1e3:+.3f} ms)")
    steady = diff["idle"] + diff["print"] / 100
    own_med = {}
    for m in ("idle", "print"):
        xs = sorted(own[m][-args.rounds * args.steps:])
        own_med[m] = statistics.median(xs)
        print(f"  the fingerprint hooks' own thread CPU, {m} step: median {own_med[m] * 1e3:.3f} ms "
              f"(p10 {xs[len(xs) // 10] * 1e3:.3f}, p90 {xs[len(xs) * 9 // 10] * 1e3:.3f}) = "
              f"{own_med[m] / med['off'] * 100:.2f}% of the off step")
    print(f"  default cadence (5,100) on a steady step: {steady * 1e3:+.3f} ms = {steady / med['off'] * 100:+.3f}%")
    result = {"device": args.device, "device_name": torch.cuda.get_device_name() if cuda else None,
              "torch": torch.__version__, "backend": args.backend, "layers": args.layers, "embd": args.embd,
              "vocab": args.vocab, "params": n_params, "tensors": sum(1 for _ in model.parameters()),
              "weights": args.dtype, "autocast": args.autocast, "fused_adamw": bool(args.fused),
              "batch": args.batch, "seq": args.seq, "rounds": args.rounds, "steps": args.steps, "clock": clock,
              "off_step_s": med["off"], "idle_step_s": med["idle"], "print_step_s": med["print"],
              "idle_minus_off_s": diff["idle"], "print_minus_off_s": diff["print"],
              "fingerprinted_step_ratio": diff["print"] / med["off"], "default_cadence_ratio": steady / med["off"],
              "hooks_thread_cpu_s": own_med}
    print(json.dumps(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    agent.close()


if __name__ == "__main__":
    main()
