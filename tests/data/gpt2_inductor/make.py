"""Make the GPT-2 + Inductor trace and store in this folder (the GPU test input).

Run on a CUDA machine (it was made on one NVIDIA H200, see README.md here)::

    python tests/data/gpt2_inductor/make.py OUT_DIR [--layers 12 --embd 768 --batch 8 --seq 512]

A GPT-2 (transformers, random weights, fixed seed) is compiled with
``torch.compile(backend=agent.backend("inductor"))`` (Triton kernels on CUDA) and its AdamW step
too; three warm-up steps, then two profiled steps under ``agent.profile``. Written to OUT_DIR:
``gpt2.db`` (the graphdeck store: graphs, compile records with Inductor's provenance artifacts,
the trace), ``gpt2_rank0.pt.trace.json.gz`` (the raw Kineto trace) and ``info.json``.
On a machine without CUDA it runs the same on CPU (C++ kernels) with ``--layers 1``-sized
defaults, which is how the code path is checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from graphdeck.capture import Agent

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")
    config = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=max(args.seq, 64), bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    agent = Agent(store=str(out / "gpt2.db"), run="gpt2")
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    model = agent.watch(model.to(device))
    compiled = torch.compile(model, backend=agent.backend("inductor"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    @torch.compile(backend=agent.backend("inductor"))
    def opt_step():
        opt.step()

    gen = torch.Generator(device="cpu").manual_seed(0)
    times = []
    t0 = time.perf_counter()
    with agent.profile(wait_steps=args.steps - 2, warmup_steps=0, active_steps=2, name="gpt2 rank 0",
                       trace_dir=str(out)) as prof:
        for step in range(args.steps):
            s0 = time.perf_counter()
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
            with torch.profiler.record_function(f"train_step#{step}"):
                loss = compiled(input_ids=tokens, labels=tokens).loss
                loss.backward()
                opt_step()
                opt.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - s0)
            print(f"step {step}: loss {loss.item():.4f} {times[-1]:.3f} s", flush=True)
            prof.step()
    agent.close()
    src = out / "gpt2_rank0.pt.trace.json.gz"
    if src.exists():
        src.rename(out / "gpt2_rank0.pt.trace.json.gz")
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "args": vars(args), "step_s": times, "total_s": time.perf_counter() - t0,
            "triton": getattr(sys.modules.get("triton"), "__version__", None)}
    (out / "info.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    main()
