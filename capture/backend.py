"""``torch.compile(model, backend="graphdeck")``: the backend registered through the
``torch_dynamo_backends`` entry point, backed by the process's :class:`Agent`.

Configure it with environment variables: ``GRAPHDECK_STORE`` (SQLite path or URL, default
``graphdeck.db``), ``GRAPHDECK_RUN`` (run name, the same on every rank) and ``GRAPHDECK_INNER``
(the backend that really compiles, default ``inductor``).

NOTE: [One agent per process and run]
Each agent listens to torch's structured compile log, so two agents of one run in one process
would each store every compile record (a job that made ``Agent(...)`` and also compiled with
``backend="graphdeck"`` counted 12 restarts for 8). So: ``Agent(store, run)`` returns the live
agent of that store and run when there is one (the same object: ``watch``, ``profile`` and
``close`` act on it), and ``default_agent()`` — the agent ``backend="graphdeck"`` records into —
is the process's live agent when there is one, whatever its store and run, else a new one from the
environment. A closed agent is no longer live.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

_default_agent = None
_live: list[weakref.ref] = []  # the agents made in this process, oldest first


def default_run_name() -> str | None:
    """The run name an agent made without one takes: ``GRAPHDECK_RUN``, else torchrun's run id,
    else None (the agent then names the run by the time)."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    return os.environ.get("GRAPHDECK_RUN") or (elastic if elastic not in (None, "none") else None)


def _store_key(store: str | os.PathLike | None) -> str:
    s = os.fspath(store or os.environ.get("GRAPHDECK_STORE", "graphdeck.db"))
    return s if "://" in s else os.path.abspath(s)


def register(agent) -> None:
    """Note ``agent`` as one of the process's agents (``Agent.__init__`` calls it)."""
    _live[:] = [r for r in _live if r() is not None]
    _live.append(weakref.ref(agent))


def live_agent(store: str | os.PathLike | None = None, run: str | None = None):
    """The newest agent of this process, not closed, that records ``store`` (default
    ``GRAPHDECK_STORE``) and ``run`` (default :func:`default_run_name`; with no name at all, any
    run of that store), or None."""
    run = run or default_run_name()
    key = _store_key(store)
    for ref in reversed(_live):
        a = ref()
        if a is not None and not a.closed and _store_key(a.store) == key and (run is None or run in (a.run, getattr(a, "requested_run", None))):
            return a
    return None


def default_agent():
    """The agent ``backend="graphdeck"`` records into: the process's newest live agent (the one
    your code made with ``Agent(...)``, whatever its store and run), else one made now from
    ``GRAPHDECK_STORE`` / ``GRAPHDECK_RUN`` (NOTE: [One agent per process and run])."""
    global _default_agent
    if _default_agent is not None and not _default_agent.closed:
        return _default_agent
    for ref in reversed(_live):
        a = ref()
        if a is not None and not a.closed:
            _default_agent = a
            return a
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
