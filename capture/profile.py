"""The profiler helper: a torch.profiler window whose Kineto trace is stored for the rank."""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from pathlib import Path

import torch


def stored_profile(agent, *, wait_steps: int, warmup_steps: int, active_steps: int, name: str | None,
                   trace_dir: str | os.PathLike | None = None):
    """``torch.profiler.profile`` with a schedule of one window (wait, warmup, active steps);
    when the window ends its Chrome trace is exported and ingested into ``agent``'s store for
    this rank (``traces`` + ``trace_events``). CPU activity always; CUDA when available.

    ``trace_dir``: also keep the exported file there, gzip-compressed, as
    ``<run>_rank<N>.pt.trace.json.gz`` (else the temp file is deleted after the ingest)."""
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
            result = ingest_trace(writer.engine, path, run_name=agent.run, rank=writer.rank,
                                  name=name or f"rank {writer.rank} profile")
            _link(agent, writer, result.run_id)
            if trace_dir is not None:
                _keep_gzipped(path, Path(trace_dir) / f"{agent.run}_rank{writer.rank}.pt.trace.json.gz")
        finally:
            os.unlink(path)

    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait_steps, warmup=warmup_steps, active=active_steps, repeat=1),
        on_trace_ready=on_trace_ready, record_shapes=True, with_stack=False,
    )


def _keep_gzipped(src: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fin, gzip.open(dest, "wb", compresslevel=6) as fout:
        shutil.copyfileobj(fin, fout)


def _link(agent, writer, run_id: int) -> None:
    """Kernel -> FX node links for the run from the provenance records flushed so far (the
    backward graphs compile at the first backward, so their records come after the forward's)."""
    import warnings

    try:
        agent.flush_events()
        from graphdeck.analysis.trace_map import link_kernels

        link_kernels(writer.engine, run_id)
    except Exception as exc:  # noqa: BLE001 - capture never breaks training
        warnings.warn(f"graphdeck: could not link kernels to graph nodes: {type(exc).__name__}: {exc}")
