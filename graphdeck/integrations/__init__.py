"""One line that turns graphdeck's capture on inside a training framework (docs/integrations.md).

* Hugging Face ``Trainer``: ``callbacks=[graphdeck.integrations.hf.GraphdeckCallback()]``
* PyTorch Lightning: ``callbacks=[graphdeck.integrations.lightning.GraphdeckCallback()]``
* torchtitan: ``--override.imports graphdeck.integrations.torchtitan.capture`` on its command line

Each callback gives what the hand-written :class:`~graphdeck.capture.Agent` code gives: the graphs
of the framework's own ``torch.compile`` (recorded through the agent's backend around the backend
the job names), the watched model (its parameter names), per-step gradient evidence, the parallel
layout, a profiled window of steps and the close at the end of training. Importing this package
imports no framework; each submodule imports its own.
"""

from __future__ import annotations

__all__ = ["inner_backend", "profile_window"]

from graphdeck.integrations._common import inner_backend, profile_window
