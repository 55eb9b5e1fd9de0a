"""A multi-rank GPT-2 job for the 2-GPU run of issue 11, runnable on CPU (gloo) as well.

Run one mode per launch, under torchrun::

    torchrun --standalone --nproc-per-node 2 tests/programs/multi_rank_run.py OUT --mode ddp
    torchrun --standalone --nproc-per-node 2 tests/programs/multi_rank_run.py OUT --mode fsdp2
    torchrun --standalone --nproc-per-node 2 tests/programs/multi_rank_run.py OUT --mode branch

Modes:
    ``ddp``: GPT-2 wrapped in DDP (``bucket_cap_mb`` 25 on CUDA, where GPT-2 small splits into
        14 buckets and DDPOptimizer splits the graph with them; 1 on CPU, where the default small
        model, 0.67 MB, is one bucket and the graph is not split), then ``torch.compile``.
    ``fsdp2``: every GPT-2 block and the whole model under ``fully_shard`` (FSDP2), then
        ``torch.compile``: the graphs and the trace carry all-gather / reduce-scatter.
    ``branch``: DDP with ``find_unused_parameters=True`` and a rank-dependent branch (rank 1 skips
        the last block's MLP), gradient case G4 made not to hang; the rank comparison and the
        gradient check must flag it.

On CUDA the process group is NCCL and ``--backend`` defaults to Inductor (Triton kernels); on CPU
it is gloo and ``aot_eager``. Every rank captures into ``OUT/<mode>.db`` (run name = mode) and
profiles ``--profile-steps`` steps after warm-up; the Kineto traces are ingested into the store by
the capture agent and also kept as ``OUT/<mode>_rank<R>.pt.trace.json.gz``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def _build(layers: int, embd: int, heads: int, vocab: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, vocab_size=vocab, n_positions=seq,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def _skip_mlp_on_rank(model, rank: int, skip_rank: int = 1) -> None:
    """Make the last block's MLP an identity on ``skip_rank`` (a rank-dependent branch)."""
    import torch

    block = model.transformer.h[-1]
    if rank == skip_rank:
        block.mlp.forward = lambda hidden_states: torch.zeros_like(hidden_states)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--mode", choices=("ddp", "fsdp2", "branch"), default="ddp")
    ap.add_argument("--backend", default=None, help="inner torch.compile backend (default: inductor on CUDA, aot_eager on CPU)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--embd", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size (default 25 on CUDA, 1 on CPU)")
    ap.add_argument("--compile-optimizer", action=argparse.BooleanOptionalAction, default=None,
                    help="compile the AdamW step too (default: on CUDA)")
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=5)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from graphdeck.capture import Agent

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    big = cuda
    layers = args.layers or (12 if big else 2)
    embd = args.embd or (768 if big else 64)
    heads = args.heads or (12 if big else 4)
    vocab = args.vocab or (50257 if big else 1024)
    batch = args.batch or (8 if big else 2)
    seq = args.seq or (512 if big else 32)
    backend = args.backend or ("inductor" if cuda else "aot_eager")
    if args.compile_optimizer is None:
        args.compile_optimizer = cuda
    if cuda:
        torch.set_float32_matmul_precision("high")
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"{args.mode}.db"
    torch.manual_seed(0)
    agent = Agent(store=str(store), run=args.mode)
    model = _build(layers, embd, heads, vocab, seq).to(device)
    if args.mode == "branch":
        _skip_mlp_on_rank(model, rank)
    model = agent.watch(model)
    if args.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, bucket_cap_mb=args.bucket_cap_mb or (25 if cuda else 1), find_unused_parameters=args.mode == "branch",
                      device_ids=[local_rank] if cuda else None)
    compiled = torch.compile(wrapped, backend=agent.backend(backend))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step_fn = opt.step
    if args.compile_optimizer:  # its kernels then map to graph nodes too
        step_fn = torch.compile(opt.step, backend=agent.backend(backend))

    gen = torch.Generator().manual_seed(1000 + rank)
    t0 = time.perf_counter()
    prof = agent.profile(wait_steps=0, warmup_steps=args.warmup_steps, active_steps=args.profile_steps, trace_dir=out)
    prof.__enter__()
    try:
        for step in range(args.warmup_steps + args.profile_steps):
            tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
            loss = compiled(input_ids=tokens, labels=tokens).loss
            loss.backward()
            step_fn()
            opt.zero_grad(set_to_none=True)
            prof.step()
            if rank == 0:
                print(f"[{args.mode}] step {step} loss {loss.item():.4f} ({time.perf_counter() - t0:.1f}s)", flush=True)
    finally:
        prof.__exit__(None, None, None)
    if cuda:
        torch.cuda.synchronize()
    agent.close()
    dist.barrier()
    if rank == 0:
        print(f"[{args.mode}] {world} ranks ({device.type}, {backend}) done in {time.perf_counter() - t0:.1f}s; store {store}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
