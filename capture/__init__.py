"""The capture agent: records Dynamo graphs, graph breaks, DDP bucket partitions, AOTAutograd
forward/backward graphs, compile records and profiler traces of each rank into the store.

Imports no web framework (it lives inside training jobs); torch is imported on first use.
"""

from __future__ import annotations

__all__ = ["Agent", "graphdeck_backend"]


def __getattr__(name):
    if name == "Agent":
        from graphdeck.capture.agent import Agent

        return Agent
    if name == "graphdeck_backend":
        from graphdeck.capture.backend import graphdeck_backend

        return graphdeck_backend
    raise AttributeError(name)
