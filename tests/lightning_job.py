"""A PyTorch Lightning 2.6 job (strategy="ddp", accelerator="cpu", devices=2; gloo), trained twice in
one launch: first as the user wrote it (``torch.compile(model, backend="aot_eager")``, no graphdeck),
then the same ``fit`` with one more callback, ``graphdeck.integrations.lightning.GraphdeckCallback``
(docs/integrations.md; store and run from ``GRAPHDECK_STORE`` / ``GRAPHDECK_RUN``): it compiles
the module's steps again through the agent's backend around ``aot_eager``.

    GRAPHDECK_STORE=S GRAPHDECK_RUN=lightning \\
        python -m torch.distributed.run --standalone --nproc-per-node 2 tests/lightning_job.py OUT_DIR
    graphdeck run --store S --run NAME -- \
        python -m torch.distributed.run --standalone --nproc-per-node 2 tests/lightning_job.py --plain OUT_DIR

``--plain``: only the user's script, exactly as written (``torch.compile(model,
backend="aot_eager")``, no graphdeck imported), for ``graphdeck run`` (tests/test_frameworks.py);
each rank writes ``OUT_DIR/losses_rank<N>.json``: ``{"plain": [...]}``.

``training_step`` does not call ``self.log``: Lightning compiles ``training_step`` itself, and
Dynamo 2.13 raises on ``self.log``'s signature check (``InternalTorchDynamoError: 'method' object
has no attribute '__dict__'``) with or without graphdeck. Each rank writes
``OUT_DIR/losses_rank<N>.json``: ``{"reference": [...], "captured": [...]}``, this rank's loss at
every step.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

STEPS = 4


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit(model, callbacks: list) -> list[float]:
    losses = Losses()
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[losses, *callbacks])
    trainer.fit(model, data())
    return losses.losses


def main(out: str) -> None:
    L.seed_everything(0)
    reference = fit(torch.compile(Regressor(), backend="aot_eager"), [])
    torch._dynamo.reset()

    # ---- the capture: the same script, plus one line (docs/integrations.md) ----
    from graphdeck.integrations.lightning import GraphdeckCallback

    L.seed_everything(0)
    captured = fit(torch.compile(Regressor(), backend="aot_eager"), [GraphdeckCallback()])
    # ---- end of the capture ----

    with open(os.path.join(out, f"losses_rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"reference": reference, "captured": captured}, f)


def plain(out: str) -> None:
    """The user's script as written: no graphdeck anywhere."""
    L.seed_everything(0)
    losses = fit(torch.compile(Regressor(), backend="aot_eager"), [])
    with open(os.path.join(out, f"losses_rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"plain": losses}, f)


if __name__ == "__main__":
    if sys.argv[1] == "--plain":
        plain(sys.argv[2])
    else:
        main(sys.argv[1])
