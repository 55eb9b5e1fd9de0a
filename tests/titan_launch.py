"""torchtitan on CPU: the smallest launcher shim (docs/frameworks.md, "torchtitan on CPU: the shim").

Run by torchrun in place of ``-m torchtitan.train``, with torchtitan's own arguments::

    torchrun --nproc-per-node 2 tests/titan_launch.py --module llama3 --config llama3_debugmodel ...

torchtitan 0.3.0 has no CPU path; this file changes only what stands between it and a gloo CPU run,
before torchtitan is imported, and nothing in its training step:

1. the device type is ``cpu`` (torchtitan falls back to ``"cuda"``) and ``torch.cpu`` answers the
   few device queries torchtitan makes (name, properties, memory stats, ``current_device() == 0``);
2. ``torch.distributed.set_timeout`` (called after step 1; absent in torch 2.13.0) is a no-op;
3. FSDP2 groups reduce with a plain sum (gloo has no ``PREMUL_SUM``), as
   ``FSDPModule.set_force_sum_reduction_for_comms(True)`` sets it;
4. FlexAttention's device check, which refuses CPU inputs that need gradients, is skipped: under
   ``aot_eager`` the flex call is traced into the block's graph and differentiated there;
5. the blocks compile with the backend named by ``--compile.backend`` as it is: torchtitan would
   wrap ``aot_eager`` to lower FlexAttention's region with Inductor (no CPU backward for it), and
   refuses any other backend name for a FlexAttention model.

To capture, name graphdeck's backend, ``--compile.backend graphdeck`` with ``GRAPHDECK_STORE``,
``GRAPHDECK_RUN`` and ``GRAPHDECK_INNER=aot_eager`` set (the blocks and the loss compile through
it), and the trainer's model parts are watched by the same agent; ``TITAN_PROFILE=1`` profiles
steps 2-3 with ``Agent.profile`` (the trace stored for each rank). Rank 0 writes each
step's loss, as torchtitan logs it, to ``$TITAN_LOSSES`` (JSON lines) when that is set.
"""

from __future__ import annotations

import json
import os
import sys
import types


def patch_cpu() -> None:
    """Items 1-4 of the module docstring; call before torchtitan is imported."""
    import torch._utils
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.nn.attention import flex_attention

    # 1. the CPU device
    torch._utils._get_available_device_type = lambda: "cpu"
    queries = {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: types.SimpleNamespace(name="cpu", total_memory=64 << 30),
        "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "set_device": lambda device=None: None,
        "current_device": lambda: 0,
    }
    for name, fn in queries.items():
        setattr(torch.cpu, name, fn)
    # 2. set_timeout
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None
    # 3. sum reduction for FSDP2's gradients (gloo has no PREMUL_SUM)
    group_init = _fsdp_param_group.FSDPParamGroup.__init__

    def sum_group_init(self, *args, **kwargs):
        group_init(self, *args, **kwargs)
        self.force_sum_reduction_for_comms = True

    _fsdp_param_group.FSDPParamGroup.__init__ = sum_group_init
    # 4. FlexAttention's CPU check: refuses inputs that need gradients (no fused CPU backward);
    # under aot_eager the flex call is traced into the block's graph and differentiated there
    flex_attention._validate_device = lambda query, key, value: None


def make_assets(folder: str, lines: int = 400, vocab: int = 512) -> str:
    """A tiny byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) trained on
    synthetic text in ``folder`` (what ``--hf-assets-path`` reads), and a JSONL dataset of
    ``{"text": ...}`` lines in ``folder/data`` (``--dataloader.dataset c4_test
    --dataloader.dataset-path``). Deterministic (a seeded generator). Returns ``folder``."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["model", "rank", "graph", "shard", "tensor", "mesh", "loss", "step", "token", "layer", "the", "a",
             "of", "and", "gradient", "compile", "parallel", "vocab", "batch", "train"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 90))) + "." for _ in range(lines)]
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    with open(os.path.join(folder, "data", "train.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<bos>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return folder


def main() -> None:
    patch_cpu()
    import torch.distributed as dist

    # 5. the backend named as it is (no regional Inductor for FlexAttention)
    from torchtitan.distributed import compile as titan_compile

    titan_compile._maybe_regional_inductor_backend = lambda model, backend: backend

    from torchtitan import trainer as titan_trainer
    from torchtitan.components import metrics as titan_metrics

    init, log = titan_trainer.Trainer.__init__, titan_metrics.MetricsProcessor.log

    def watched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if capture:
            from graphdeck.capture.backend import default_agent

            for m in self.model_parts:
                default_agent().watch(m)

    losses = os.environ.get("TITAN_LOSSES")
    # TITAN_HOOK=override: graphdeck comes in through torchtitan's own --override.imports
    # (graphdeck.integrations.torchtitan.capture); the shim then only makes the CPU run possible.
    capture = bool(os.environ.get("GRAPHDECK_STORE")) and os.environ.get("TITAN_HOOK") != "override"

    def logged(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        if losses and dist.get_rank() == 0:
            with open(losses, "a") as f:
                f.write(json.dumps({"step": step, "loss": global_avg_loss, "grad_norm": grad_norm}) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    train, train_step = titan_trainer.Trainer.train, titan_trainer.Trainer.train_step
    profiling: list = []

    def profiled_train(self, *args, **kwargs):
        """Steps 2-3 profiled by the agent (its trace stored for this rank) with TITAN_PROFILE=1."""
        if not (capture and os.environ.get("TITAN_PROFILE") == "1"):
            return train(self, *args, **kwargs)
        from graphdeck.capture.backend import default_agent

        with default_agent().profile(wait_steps=1, warmup_steps=0, active_steps=2) as prof:
            profiling.append(prof)
            return train(self, *args, **kwargs)

    def stepped(self, *args, **kwargs):
        out = train_step(self, *args, **kwargs)
        for prof in profiling:
            prof.step()
        return out

    titan_trainer.Trainer.__init__ = watched_init
    titan_trainer.Trainer.train = profiled_train
    titan_trainer.Trainer.train_step = stepped
    titan_metrics.MetricsProcessor.log = logged
    from torchtitan.train import main as titan_main

    titan_main()
    if capture:
        from graphdeck.capture.backend import default_agent

        default_agent().close()


if __name__ == "__main__":
    sys.exit(main())
