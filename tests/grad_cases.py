"""The gradient-path cases of ``../shared/cases/gradient-paths.md`` (G1–G9) as small models.

Lines the report must point at carry a ``# <case>-<what>`` marker; :func:`line_of` finds them,
so the tests never hard-code line numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

D = 8


def line_of(marker: str) -> str:
    """``"grad_cases.py:<line>"`` of the line carrying ``# <marker>``."""
    for i, text in enumerate(Path(__file__).read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return f"grad_cases.py:{i}"
    raise KeyError(marker)


class UnusedExtra(nn.Module):
    """G1: ``extra`` is used only when a Python attribute flag is set; it is off."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)
        self.extra = nn.Linear(D, D)
        self.use_extra = False

    def forward(self, x):
        h = torch.relu(self.enc(x))
        if self.use_extra:
            h = self.extra(h)
        return self.head(h)


class TwoHeads(nn.Module):
    """G2: a shared trunk and two heads; the loss uses ``src_logits`` only."""

    def __init__(self, d: int = D):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, d), nn.ReLU())
        self.src_head = nn.Linear(d, 3)
        self.tgt_head = nn.Linear(d, 5)

    def forward(self, x):
        h = self.trunk(x)
        return self.src_head(h), self.tgt_head(h)  # G2-return


def g2_loss(out):
    return out[0].sum()


class Featurizer:
    """G3: a helper object (not a module) whose call runs the backbone without grad."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x):
        with torch.no_grad():  # G3-region
            return self.model.backbone(x)  # G3-cut


class NoGradHelper(nn.Module):
    """G3: ``backbone`` (two Linear) runs inside the helper's ``no_grad``; ``head`` trains."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
        self.head = nn.Linear(D, 2)
        self.featurizer = Featurizer(self)

    def forward(self, x):
        features = self.featurizer(x)
        return self.head(features)


class BranchOnBatch(nn.Module):
    """G4: ``dn_embed`` is used only when the local batch has targets."""

    def __init__(self):
        super().__init__()
        self.main = nn.Linear(D, D)
        self.dn_embed = nn.Embedding(10, D)

    def forward(self, x, targets):
        h = self.main(x)
        if targets.numel() > 0:  # G4-branch
            h = h + self.dn_embed(targets).mean(0)  # G4-use
        return h


class DetachInMiddle(nn.Module):
    """G5: ``blk2``'s output is detached; ``blk1`` still reaches the loss through ``aux``."""

    def __init__(self, d: int = D):
        super().__init__()
        self.emb = nn.Embedding(16, d)
        self.blk1 = nn.Linear(d, d)
        self.blk2 = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)
        self.aux = nn.Linear(d, 1)

    def forward(self, x):
        h = torch.relu(self.emb(x))
        h = torch.relu(self.blk1(h))
        h2 = self.blk2(h).detach()  # G5-cut
        return self.head(h2) + self.aux(h).mean()


class TiedLM(nn.Module):
    """G6: the output projection shares its weight with the input embedding."""

    def __init__(self, vocab: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.lm_head = nn.Linear(D, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, x):
        return self.lm_head(torch.tanh(self.embed(x)))


class PartlyUsedChunk(nn.Module):
    """G7: ``proj`` to 2·D, ``chunk(2)``; only the first half feeds the loss."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 2 * D)

    def forward(self, x):
        a, b = self.proj(x).chunk(2, dim=-1)
        return a, b


def g7_loss(out):
    return out[0].sum()


class ArgmaxRouter(nn.Module):
    """G8: a mixture-of-experts layer whose router picks an expert by ``argmax``; with
    ``weighted=True`` the chosen expert's output is scaled by its softmax probability."""

    def __init__(self, weighted: bool = False, experts: int = 2):
        super().__init__()
        self.router = nn.Linear(D, experts)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))
        self.weighted = weighted

    def forward(self, x):
        logits = self.router(x)
        choice = logits.argmax(dim=-1)  # G8-cut
        outs = torch.stack([e(x) for e in self.experts], dim=1)
        picked = outs[torch.arange(x.shape[0]), choice]
        if self.weighted:
            prob = F.softmax(logits, dim=-1).gather(-1, choice[:, None])
            picked = picked * prob
        return picked


class DownUp(nn.Module):
    """G9: ``z = down(x)`` and ``up(z)`` are both returned by one compiled region."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 4, 1)
        self.up = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        z = self.down(x)  # G9-z
        return self.up(z), z


def g9_loss(out):
    y, z = out
    (g,) = torch.autograd.grad(y.sum(), z, create_graph=True)
    return g.pow(2).sum() + y.sum()


def factory_detach() -> nn.Module:
    """For ``graphdeck check-grads --model tests.grad_cases:factory_detach``."""
    torch.manual_seed(0)
    return DetachInMiddle()


def factory_two_heads() -> nn.Module:
    torch.manual_seed(0)
    return TwoHeads()


class InnerAutocastOff(nn.Module):
    """N2: one Linear ``w`` (64→64); the region computes ``x.float() @ w.weight.float().T`` with
    autocast disabled, while the caller runs it under an outer bfloat16 autocast. ``w.bias`` is
    never read."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.w = nn.Linear(d, d)

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return x.float() @ self.w.weight.float().T  # N2-mm


def factory_inner_autocast_off() -> nn.Module:
    """For ``graphdeck check-grads --model tests.grad_cases:factory_inner_autocast_off --numeric``."""
    torch.manual_seed(0)
    return InnerAutocastOff()
