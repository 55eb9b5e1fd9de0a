"""Trace replay: :class:`TraceReplayer` (``graphdeck.replay.TraceReplayer``) and replay frames.

Importing this package does not import torch or the web stack.
"""

from graphdeck.replay.replayer import ReplayPlan, TraceReplayer

__all__ = ["ReplayPlan", "TraceReplayer"]
