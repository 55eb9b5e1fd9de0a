"""``torch.compile(model, backend="graphdeck")``: the backend registered through the
``torch_dynamo_backends`` entry point, backed by one process-wide :class:`Agent`.

Configure it with environment variables: ``GRAPHDECK_STORE`` (SQLite path or URL, default
``graphdeck.db``), ``GRAPHDECK_RUN`` (run name, the same on every rank) and ``GRAPHDECK_INNER``
(the backend that really compiles, default ``inductor``).
"""

from __future__ import annotations

import os
from typing import Any

_default_agent = None


def default_agent():
    """The process-wide agent ``backend="graphdeck"`` records into (created on first use)."""
    global _default_agent
    if _default_agent is None:
        from graphdeck.capture.agent import Agent

        _default_agent = Agent()
    return _default_agent


def graphdeck_backend(gm, example_inputs: list[Any], **kwargs):
    """Record ``gm`` (and its AOTAutograd forward/backward graphs), then compile it with
    ``GRAPHDECK_INNER``; returns the inner backend's compiled callable."""
    agent = default_agent()
    inner = os.environ.get("GRAPHDECK_INNER", "inductor")
    if inner == "inductor":  # kernel -> FX node links for traces, as Agent.backend("inductor") does
        from graphdeck.capture.provenance import enable_provenance

        enable_provenance()
    return agent._compile(gm, example_inputs, inner, **kwargs)
