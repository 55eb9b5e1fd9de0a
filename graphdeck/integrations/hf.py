"""Hugging Face ``Trainer``: ``Trainer(..., callbacks=[GraphdeckCallback()])``.

With ``TrainingArguments(torch_compile=True)`` (any ``torch_compile_backend`` accelerate knows)
the callback makes accelerate's own ``torch.compile`` go through the agent's backend around the
backend named there, so graphdeck records what the Trainer really compiles: the DDP-wrapped
model (DDPOptimizer's bucket graphs included), not a second compile inside DDP. accelerate
refuses ``torch_compile_backend="graphdeck"`` (its ``DynamoBackend`` enum lists the backends it
knows); no backend name is needed here.

    from graphdeck.integrations.hf import GraphdeckCallback
    Trainer(model=model, args=TrainingArguments(torch_compile=True, ...), train_dataset=ds,
            callbacks=[GraphdeckCallback()]).train()

NOTE: [Routing accelerate's compile]
``Trainer.__init__`` builds the ``Accelerator`` (its ``TorchDynamoPlugin`` holds the backend) and
then sends ``on_init_end``; ``train()`` compiles in ``accelerator.prepare`` (the plugin's
``to_kwargs()`` are ``torch.compile``'s arguments) before ``on_train_begin``. So at
``on_init_end`` the callback makes the agent, watches the model and gives that plugin object a
``to_kwargs`` whose ``backend`` is ``agent.backend(<the backend named>)``, while the agent is
live (a Trainer made after ``close()`` compiles as it asked). The model's steps are the
optimizer's (the agent's step hooks): ``check-grads`` step k is the Trainer's ``global_step``
k + 1 of a run that started at step 0.
"""

from __future__ import annotations

import warnings

from transformers import TrainerCallback

from graphdeck.integrations._common import profile_window


class GraphdeckCallback(TrainerCallback):
    """graphdeck's capture for a ``transformers.Trainer``, in one line.

    ``store`` / ``run``: as :class:`~graphdeck.capture.Agent` takes them (default
    ``GRAPHDECK_STORE`` / ``GRAPHDECK_RUN``, else torchrun's run id); an agent of that store and
    run already live in the process is joined, not doubled. ``profile_steps``: the steps to
    profile, ``"A:B"`` from 0 (:func:`~graphdeck.integrations.profile_window`), None for none;
    ``profile_options`` go to :meth:`Agent.profile`.

    Events: ``on_init_end`` makes/joins the agent, ``watch``es the model and routes accelerate's
    compile (NOTE: [Routing accelerate's compile]); ``on_train_begin`` starts the profile;
    ``on_step_end`` steps it; ``on_train_end`` stops it and closes the agent. A Trainer has no
    event for an exception: a job that raises keeps what the agent recorded through its exit
    flush (compile records, layout, evidence, Flight Recorder), as any agent does.
    """

    def __init__(self, store=None, run: str | None = None, *, profile_steps: str | tuple | None = "2:2",
                 **profile_options):
        self.store, self.run = store, run
        self.window = profile_window(profile_steps)
        self.profile_options = profile_options
        self.agent = None
        self._prof = None

    def _start(self, model) -> None:
        if self.agent is None or self.agent.closed:
            from graphdeck.capture import Agent

            self.agent = Agent(self.store, self.run)
            if model is not None:
                self.agent.watch(model)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._start(model)
        if getattr(args, "torch_compile", False):
            _route_accelerate_compile(self.agent)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.agent is None or self.agent.closed:  # added after the Trainer was made, or trained again
            self._start(model)
            if getattr(args, "torch_compile", False):
                warnings.warn("graphdeck: GraphdeckCallback was not there when the Trainer was made: accelerate's "
                              "compile is not recorded; pass it in Trainer(callbacks=[...])", stacklevel=2)
        if self.window is not None:
            self._prof = self.agent.profile(**self.window, **self.profile_options)
            self._prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._prof is not None:
            self._prof.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
        if self.agent is not None:
            self.agent.close()


def _route_accelerate_compile(agent) -> bool:
    """Make accelerate's ``torch.compile`` use ``agent``'s backend around the one it names, while
    ``agent`` is live (NOTE: [Routing accelerate's compile]). Returns whether it could."""
    try:
        from accelerate.state import AcceleratorState

        plugin = AcceleratorState._shared_state.get("dynamo_plugin")
    except Exception:  # noqa: BLE001 - an accelerate without the state: nothing to route
        plugin = None
    if plugin is None or not hasattr(plugin, "to_kwargs"):
        warnings.warn("graphdeck: accelerate's compile settings were not found: the Trainer's compile is not "
                      "recorded", stacklevel=3)
        return False
    base = type(plugin)
    if getattr(base, "_graphdeck_routed", False):  # routed for an earlier agent: route for this one
        base = base.__mro__[1]

    def to_kwargs(self):
        kwargs = base.to_kwargs(self)
        if agent.closed or "backend" not in kwargs:
            return kwargs
        inner = kwargs["backend"]
        mode, options = kwargs.pop("mode", None), kwargs.pop("options", None)
        if inner == "inductor" and (mode not in (None, "default") or options):
            import torch

            inner = torch._TorchCompileInductorWrapper(mode, options, kwargs.get("dynamic"))
        elif mode not in (None, "default") or options:  # another backend's mode/options: as torch.compile passes them
            kwargs.update({k: v for k, v in (("mode", mode), ("options", options)) if v})
        kwargs["backend"] = agent.backend(inner)
        return kwargs

    # The plugin's to_dict() lists its instance attributes, so the method goes on a subclass.
    plugin.__class__ = type(base.__name__, (base,), {"to_kwargs": to_kwargs, "_graphdeck_routed": True,
                                                     "__module__": base.__module__})
    return True
