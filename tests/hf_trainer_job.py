"""A Hugging Face ``Trainer`` job (transformers + accelerate, DDP on 2 gloo CPU ranks), trained twice
in one launch: first as the user wrote it (``TrainingArguments(torch_compile=True,
torch_compile_backend="aot_eager")``, no graphdeck), then the same ``train`` with one more
callback, ``graphdeck.integrations.hf.GraphdeckCallback`` (docs/integrations.md): accelerate
compiles the DDP-wrapped model through the agent's backend around ``aot_eager``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/hf_trainer_job.py STORE OUT_DIR
    graphdeck run --store S --run NAME -- \
        python -m torch.distributed.run --standalone --nproc-per-node 2 tests/hf_trainer_job.py --plain OUT_DIR

``--plain``: only the user's script, exactly as written (``torch_compile=True``, no graphdeck
imported), for ``graphdeck run`` (tests/test_frameworks.py); each rank writes
``OUT_DIR/losses_rank<N>.json``: ``{"plain": [...]}``.

Both runs use the same seed, data and tiny GPT-2 (2 layers, random weights, no download); the
model keeps transformers' default ``loss_type`` (its one-time logging call is a graph break, which
graphdeck must name as the framework's). Each rank writes ``OUT_DIR/losses_rank<N>.json``:
``{"reference": [...], "captured": [...]}``, the loss the Trainer logged at every step.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

STEPS = 4
VOCAB, SEQ = 128, 16


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same for every seed of the Trainer (item ``i`` seeds itself)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        t = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": t, "labels": t}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False))


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def train(out: str, model, *, compile_in_accelerate: bool, callbacks: list) -> list[float]:
    losses = Losses()
    args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1,
                             use_cpu=True, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                             torch_compile=compile_in_accelerate,
                             torch_compile_backend="aot_eager" if compile_in_accelerate else None)
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[losses, *callbacks]).train()
    return losses.losses


def main(store: str, out: str) -> None:
    reference = train(out, tiny_gpt2(), compile_in_accelerate=True, callbacks=[])
    torch._dynamo.reset()

    # ---- the capture: the same script, plus one line (docs/integrations.md) ----
    from graphdeck.integrations.hf import GraphdeckCallback

    captured = train(out, tiny_gpt2(), compile_in_accelerate=True, callbacks=[GraphdeckCallback(store, run="hf")])
    # ---- end of the capture ----

    rank = dist.get_rank()
    with open(os.path.join(out, f"losses_rank{rank}.json"), "w") as f:
        json.dump({"reference": reference, "captured": captured}, f)


def plain(out: str) -> None:
    """The user's script as written: no graphdeck anywhere."""
    losses = train(out, tiny_gpt2(), compile_in_accelerate=True, callbacks=[])
    with open(os.path.join(out, f"losses_rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"plain": losses}, f)


if __name__ == "__main__":
    if sys.argv[1] == "--plain":
        plain(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
