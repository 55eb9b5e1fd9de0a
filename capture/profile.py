"""The profiler helper: a torch.profiler window whose Kineto trace is stored for the rank."""

from __future__ import annotations

import os
import tempfile

import torch


def stored_profile(agent, *, wait_steps: int, warmup_steps: int, active_steps: int, name: str | None):
    """``torch.profiler.profile`` with a schedule of one window (wait, warmup, active steps);
    when the window ends its Chrome trace is exported and ingested into ``agent``'s store for
    this rank (``traces`` + ``trace_events``). CPU activity always; CUDA when available."""
    from graphdeck.store.traces import ingest_trace

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def on_trace_ready(prof):
        writer = agent.writer
        fd, path = tempfile.mkstemp(prefix=f"graphdeck-rank{writer.rank}-", suffix=".pt.trace.json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            ingest_trace(writer.engine, path, run_name=agent.run, rank=writer.rank,
                         name=name or f"rank {writer.rank} profile")
        finally:
            os.unlink(path)

    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait_steps, warmup=warmup_steps, active=active_steps, repeat=1),
        on_trace_ready=on_trace_ready, record_shapes=True, with_stack=False,
    )
