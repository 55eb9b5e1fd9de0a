"""torchtitan 0.3: ``--override.imports graphdeck.integrations.torchtitan.capture``.

One entry on torchtitan's own command line (or in its config) turns the capture on, with
``--compile.backend`` left as it is (``inductor``; ``aot_eager`` on CPU): torchtitan's
FlexAttention guard accepts only those two names, so no backend name can carry the capture
(``--compile.backend graphdeck`` is refused). Store and run come from ``GRAPHDECK_STORE`` /
``GRAPHDECK_RUN`` (else torchrun's run id); the profiled steps from ``GRAPHDECK_PROFILE_STEPS``
(``"A:B"``, default ``"2:3"``; ``"off"``: none), or as the entry's kwargs
(``("graphdeck.integrations.torchtitan.capture", {"store": ..., "run": ..., "profile_steps": ...})``).

NOTE: [The torchtitan hook]
torchtitan applies ``--override.imports`` inside ``Trainer.__init__``, on every rank, after the
process group is up and before it builds the model, the loss and the compile. ``capture`` claims
the ``metrics`` config and returns it unchanged; calling it makes the agent (or joins the live
one) and routes what torchtitan compiles through the agent's backend around the backend it
chose: the transformer blocks (the result of ``_maybe_regional_inductor_backend``, so its
FlexAttention handling stays) and the loss (``BaseLoss._maybe_compile``). ``Trainer.train``
then watches the model parts as they are after ``fully_shard`` / ``parallelize_module`` (every
parameter named), profiles the chosen steps (stepped after each ``train_step``) and closes the
agent at the end; a run that raises keeps what was recorded through the agent's exit flush.
Steps are the optimizer container's (counted once per ``train_step``).
"""

from __future__ import annotations

import os

import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config.override import override

from graphdeck.integrations._common import profile_window

_agent = None


@override(target=MetricsProcessor.Config, description="graphdeck capture (the config is unchanged)")
def capture(config, *, store: str | None = None, run: str | None = None, profile_steps: str | None = None):
    """The override factory: installs the hooks once (NOTE: [The torchtitan hook]) and returns
    ``config`` unchanged."""
    steps = profile_steps or os.environ.get("GRAPHDECK_PROFILE_STEPS", "2:3")
    install(store, run, None if steps == "off" else steps)
    return config


def install(store: str | None = None, run: str | None = None, profile_steps: str | None = "2:3"):
    """Make (or join) the agent and route torchtitan's compiles, watch and profile through it;
    idempotent. Returns the agent."""
    global _agent
    if _agent is not None and not _agent.closed:
        return _agent
    from torchtitan import trainer as titan_trainer
    from torchtitan.components import loss as titan_loss
    from torchtitan.distributed import compile as titan_compile

    from graphdeck.capture import Agent

    agent = _agent = Agent(store, run)
    window = profile_window(profile_steps)

    chosen = titan_compile._maybe_regional_inductor_backend

    def routed(model, backend):
        return agent.backend(chosen(model, backend))

    titan_compile._maybe_regional_inductor_backend = routed

    maybe_compile = titan_loss.BaseLoss._maybe_compile

    def loss_compile(self, compile_config):
        if compile_config is not None and compile_config.enable and "loss" in compile_config.components:
            self.fn = torch.compile(self.fn, backend=agent.backend(compile_config.backend))
            return None
        return maybe_compile(self, compile_config)

    titan_loss.BaseLoss._maybe_compile = loss_compile

    train, train_step = titan_trainer.Trainer.train, titan_trainer.Trainer.train_step
    profiling: list = []

    def watched_train(self, *args, **kwargs):
        for part in self.model_parts:
            agent.watch(part)
        prof = agent.profile(**window) if window is not None else None
        if prof is not None:
            prof.__enter__()
            profiling.append(prof)
        try:
            out = train(self, *args, **kwargs)
        finally:
            if prof is not None:
                profiling.remove(prof)
                prof.__exit__(None, None, None)
        agent.close()
        return out

    def stepped(self, *args, **kwargs):
        out = train_step(self, *args, **kwargs)
        for prof in profiling:
            prof.step()
        return out

    titan_trainer.Trainer.train, titan_trainer.Trainer.train_step = watched_train, stepped
    return agent
