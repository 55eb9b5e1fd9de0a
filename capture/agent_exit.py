"""The agent's exit path and two small probes, for :mod:`graphdeck.capture.agent` (kept apart to
keep that module short): what ``Agent.close`` writes, done at interpreter exit or SIGTERM for a
job that never called it."""

from __future__ import annotations

import sys


def _flush_at_exit(ref, closed: bool | None = None) -> None:
    """At interpreter exit (or SIGTERM, ``closed=False``): what :meth:`Agent.close` writes, for a
    job that never called it. ``closed`` None: finished unless an uncaught exception ended it."""
    agent = ref()
    if agent is None:
        return
    if closed is None:
        closed = getattr(sys, "last_value", None) is None
    try:
        agent.flush_events()
        agent._record_model_frames()  # NOTE: [No graph produced], for a job without close()
        agent.record_layout()
        if _dist_ready():  # the groups' timeouts: a job that died in a collective is judged against them
            from graphdeck.capture.process_groups import write_record

            write_record(agent.writer)
        if agent._evidence is not None:
            agent._evidence.flush(closed=closed)
        if getattr(agent, "_parity", None) is not None:
            agent._parity.flush()
        if getattr(agent, "_heartbeat", None) is not None and closed:
            agent._heartbeat.stop("exit")
    except Exception:  # noqa: BLE001 - never fail the interpreter's exit
        pass
    finally:  # every queued write made before the process ends (NOTE: [Writes off the compiling thread])
        if getattr(agent, "_writer", None) is not None:
            try:
                agent._writer.close()
            except Exception:  # noqa: BLE001
                pass


def _compiling() -> bool:
    """Whether this thread is inside a Dynamo compile (``graphdeck run`` watches from the backend)."""
    try:
        from torch._guards import CompileContext

        return CompileContext.current_compile_id() is not None
    except Exception:  # noqa: BLE001
        return False


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


