"""PyTorch Lightning: ``L.Trainer(..., callbacks=[GraphdeckCallback()])``.

The model may be compiled with any backend (``torch.compile(model, backend="inductor")``,
``"aot_eager"``, ``"graphdeck"``) or not at all:

    from graphdeck.integrations.lightning import GraphdeckCallback
    trainer = L.Trainer(strategy="ddp", callbacks=[GraphdeckCallback()])
    trainer.fit(torch.compile(model), loader)

NOTE: [Routing Lightning's compile]
``Trainer.fit`` unwraps a compiled LightningModule (``from_compiled``): it keeps the original
methods in ``_compiler_ctx`` and puts ``dynamo_ctx(method)`` in place of ``forward`` and the
``*_step`` methods; nothing has compiled yet. In ``setup`` (after the process group is up,
before the strategy wraps the module in DDP) the callback compiles those methods again with
``agent.backend(<the backend the user named>)`` (same ``fullgraph`` and ``dynamic``), unless they
already go through graphdeck, and watches the module. Lightning then wraps it in DDP; the DDP
wrapper is noted at the first compile, as the agent does for any job.
"""

from __future__ import annotations

import lightning as L

from graphdeck.integrations._common import inner_backend, profile_window

_STEPS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


class GraphdeckCallback(L.Callback):
    """graphdeck's capture for a ``lightning.Trainer``, in one line.

    ``store`` / ``run`` / ``profile_steps`` / ``profile_options``: as
    :class:`graphdeck.integrations.hf.GraphdeckCallback` takes them. Hooks: ``setup`` makes (or
    joins) the agent, routes the module's compile (NOTE: [Routing Lightning's compile]) and
    watches the module; ``on_train_start`` starts the profile, ``on_train_batch_end`` steps it;
    ``on_fit_end`` stops it and closes the agent; ``on_exception`` stops the profile and leaves the
    rest to the agent's exit flush (a crashed job keeps what was recorded until the crash)."""

    def __init__(self, store=None, run: str | None = None, *, profile_steps: str | tuple | None = "2:2",
                 **profile_options):
        self.store, self.run = store, run
        self.window = profile_window(profile_steps)
        self.profile_options = profile_options
        self.agent = None
        self._prof = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if self.agent is None or self.agent.closed:
            from graphdeck.capture import Agent

            self.agent = Agent(self.store, self.run)
        route_compile(self.agent, pl_module)
        self.agent.watch(pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.window is not None and self.agent is not None:
            self._prof = self.agent.profile(**self.window, **self.profile_options)
            self._prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._prof is not None:
            self._prof.step()

    def _stop_profile(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._stop_profile()
        if self.agent is not None:
            self.agent.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._stop_profile()


def route_compile(agent, pl_module) -> bool:
    """Compile ``pl_module``'s compiled methods again through ``agent``'s backend (NOTE: [Routing
    Lightning's compile]). Returns whether it did (False: not compiled, or already graphdeck's)."""
    import torch

    ctx = getattr(pl_module, "_compiler_ctx", None)
    if not ctx or ctx.get("compiler") != "dynamo":
        return False
    dynamo_ctx = ctx["dynamo_ctx"]
    inner = inner_backend(getattr(dynamo_ctx, "callback", None))
    if inner is None:
        return False
    backend = agent.backend(inner)
    fullgraph, dynamic = bool(getattr(dynamo_ctx, "fullgraph", False)), getattr(dynamo_ctx, "_dynamic", None)
    for name in _STEPS:
        original = ctx.get(f"original_{name}")
        if original is not None:
            setattr(pl_module, name, torch.compile(original, backend=backend, fullgraph=fullgraph, dynamic=dynamic))
    return True
