"""The main job: a small GPT-2 (transformers, random weights, no download) trained for a few steps
under DDP + torch.compile on every rank, with the capture agent recording into the store.

Run it under torchrun (``graphdeck demo`` does that for you)::

    torchrun --standalone --nproc-per-node 2 -m graphdeck.demo --store runs.db --run-name demo

Each rank: seeds, builds ``GPT2LMHeadModel(GPT2Config(n_layer=2, ...))``, wraps it in DDP
(``bucket_cap_mb=1`` so DDPOptimizer splits the graph into buckets), compiles it with the
graphdeck backend around ``--backend`` (Inductor by default), trains ``--steps`` steps of
next-token prediction on random tokens, and profiles two steps after compilation. With Inductor
the agent's backend turns on ``torch._inductor.config.cpp.enable_kernel_profile`` (unless it was
set), so the CPU trace shows each C++ kernel and maps it to graph nodes (NOTE: [CPU trace mapping]).
"""

from __future__ import annotations

import argparse
import os
import time


def build_model(n_layer: int = 2, n_embd: int = 128, vocab_size: int = 2048, n_positions: int = 128):
    """A GPT-2 language model with random weights (no download).

    ``loss_type = "ForCausalLM"`` avoids transformers' logging call that otherwise breaks the
    Dynamo graph once per forward; ``use_cache=False`` (as in training) keeps the key/value cache
    out of the graphs' outputs.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab_size,
                        n_positions=n_positions, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="graphdeck.db", help="SQLite path or SQLAlchemy URL")
    parser.add_argument("--run-name", default="demo", help="run name (the same on every rank)")
    parser.add_argument("--backend", default="inductor", help="inner torch.compile backend")
    parser.add_argument("--steps", type=int, default=4, help="training steps")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=2, help="GPT-2 blocks")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler trace")
    parser.add_argument("--upload-url", default=None,
                        help="graphdeck server to upload to: each rank captures into a local temp store, then "
                             "uploads it (trace included) with resumable retries; token from $GRAPHDECK_TOKEN")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from graphdeck.capture import Agent

    t0 = time.perf_counter()
    _quiet_dynamo_record_function()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))

    store = args.store
    if args.upload_url:
        import tempfile

        local_dir = tempfile.mkdtemp(prefix=f"graphdeck-rank{rank}-")
        store = os.path.join(local_dir, "capture.db")
    agent = Agent(store=store, run=args.run_name)
    model = agent.watch(build_model(n_layer=args.layers))
    ddp = DDP(model, bucket_cap_mb=1)
    compiled = torch.compile(ddp, backend=agent.backend(args.backend))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(1000 + rank)
    vocab = model.config.vocab_size
    # Step 0 compiles; one warm-up step, then up to two profiled steps.
    warmup = 1 if args.steps >= 3 else 0
    prof = None if args.no_profile else agent.profile(wait_steps=1, warmup_steps=warmup,
                                                     active_steps=min(2, max(1, args.steps - 1 - warmup)))
    if prof is not None:
        prof.__enter__()
    try:
        for step in range(args.steps):
            tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
            out = compiled(input_ids=tokens, labels=tokens)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if prof is not None:
                prof.step()
            if rank == 0:
                print(f"[graphdeck demo] step {step} loss {out.loss.item():.4f} "
                      f"({time.perf_counter() - t0:.1f}s)", flush=True)
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    agent.close()
    if args.upload_url:
        _upload(args.upload_url, store, args.run_name, rank)
    dist.barrier()
    if rank == 0:
        print(f"[graphdeck demo] {world} ranks done in {time.perf_counter() - t0:.1f}s; "
              f"capture overhead {agent.capture_time_s:.2f}s on rank 0; "
              f"{'uploaded to ' + args.upload_url if args.upload_url else 'store ' + args.store}", flush=True)
    dist.destroy_process_group()


def _quiet_dynamo_record_function() -> None:
    """Drop Dynamo's "Profiler record function … will be ignored" warning from this demo's output:
    it is printed once per rank because DDP's forward opens a ``record_function`` that Dynamo does
    not trace, which is expected here and tells a reader of the demo nothing."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return "Profiler record function" not in record.getMessage()

    for name in ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch"):  # where Dynamo logs it
        logging.getLogger(name).addFilter(keep)


def _upload(url: str, store: str, run_name: str, rank: int) -> None:
    """Send this rank's local store to the server (:func:`graphdeck.capture.upload.upload_store`),
    then delete it; the upload retries with backoff and resumes where it stopped."""
    import shutil

    from graphdeck.capture.upload import upload_store

    t0 = time.perf_counter()
    status = upload_store(url, store, run=run_name, rank=rank,
                          log=lambda msg: print(f"[graphdeck demo] rank {rank}: {msg}", flush=True))
    rows = sum((status["result"] or {}).get("rows", {}).values())
    print(f"[graphdeck demo] rank {rank}: uploaded to {url} in {time.perf_counter() - t0:.1f}s "
          f"(upload {status['id']}, {rows} rows merged)", flush=True)
    shutil.rmtree(os.path.dirname(store), ignore_errors=True)


if __name__ == "__main__":
    main()
