"""The profiler helper: a torch.profiler window whose Kineto trace is stored for the rank."""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch


def stored_profile(agent, *, wait_steps: int, warmup_steps: int, active_steps: int, name: str | None,
                   trace_dir: str | os.PathLike | None = None, **profiler_options):
    """``torch.profiler.profile`` with a schedule of one window (wait, warmup, active steps);
    when the window ends its Chrome trace is exported and ingested into ``agent``'s store for
    this rank (``traces`` + ``trace_events``). CPU activity always; CUDA when available.

    ``trace_dir``: also keep the exported file there, gzip-compressed, as
    ``<run>_rank<N>.pt.trace.json.gz`` (else the temp file is deleted after the ingest).

    ``profiler_options``: passed on to ``torch.profiler.profile`` (``profile_memory``,
    ``with_stack``, ``record_shapes`` — default True —, ``with_flops``, ``activities`` ...);
    ``schedule`` and ``on_trace_ready`` are this helper's own.

    Raises:
        UsageError: ``schedule`` or ``on_trace_ready`` given, or an option
        ``torch.profiler.profile`` does not take."""
    import inspect

    from graphdeck.errors import UsageError
    from graphdeck.store.traces import ingest_trace

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def on_trace_ready(prof):  # inside the job's prof.step(): never raises (NOTE: [Capture never ends a job])
        try:
            store_trace(prof)
        except Exception as exc:  # noqa: BLE001 - capture never ends a job
            warnings.warn(f"graphdeck: the profile's trace was not stored: {type(exc).__name__}: {exc}; training is "
                          "not affected")

    def store_trace(prof):
        writer = agent.writer
        fd, path = tempfile.mkstemp(prefix=f"graphdeck-rank{writer.rank}-", suffix=".pt.trace.json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            agent.record_comm_groups()
            result = ingest_trace(writer.engine, path, run_name=agent.run, rank=writer.rank,
                                  name=name or f"rank {writer.rank} profile")
            _link(agent, writer, result.run_id)
            from graphdeck.store.node_times import refresh  # the links may have made the ingest's node times stale

            refresh(writer.engine, result.trace_id)
            from graphdeck.analysis.traces.export_map import refresh_links  # and export's kept links

            refresh_links(writer.engine, result.trace_id)
            if trace_dir is not None:
                _keep_gzipped(path, Path(trace_dir) / f"{agent.run}_rank{writer.rank}.pt.trace.json.gz")
        finally:
            os.unlink(path)

    own = {"schedule", "on_trace_ready"} & set(profiler_options)
    if own:
        raise UsageError(f"stored_profile sets {', '.join(sorted(own))} itself")
    accepted = inspect.signature(torch.profiler.profile.__init__).parameters
    unknown = sorted(k for k in profiler_options if k not in accepted)
    if unknown:
        raise UsageError(f"torch.profiler.profile takes no option {', '.join(map(repr, unknown))}")
    options = {"activities": activities, "record_shapes": True, "with_stack": False, **profiler_options}
    with warnings.catch_warnings():  # no warm-up is the caller's explicit choice, not a surprise to print
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
        schedule = torch.profiler.schedule(wait=wait_steps, warmup=warmup_steps, active=active_steps, repeat=1)
    return torch.profiler.profile(schedule=schedule, on_trace_ready=on_trace_ready, **options)


def enable_cpu_kernel_profile() -> bool:
    """Make Inductor's generated C++ kernels visible to the profiler
    (``torch._inductor.config.cpp.enable_kernel_profile``: each kernel opens a ``RecordFunction``
    named ``graph_<n>_<kernel>``; NOTE: [CPU trace mapping]) unless the user set the option
    (``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE`` or in code). Returns whether it is on
    afterwards. Never raises: a torch without the option keeps its default."""
    try:
        from torch._inductor import config

        if os.environ.get("TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE") is None and config._is_default("cpp.enable_kernel_profile"):
            config.cpp.enable_kernel_profile = True
        return bool(config.cpp.enable_kernel_profile)
    except Exception:  # noqa: BLE001 - capture never breaks training
        return False


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
        from graphdeck.analysis.traces.mapping import link_kernels

        link_kernels(writer.engine, run_id)
    except Exception as exc:  # noqa: BLE001 - capture never breaks training
        warnings.warn(f"graphdeck: could not link kernels to graph nodes: {type(exc).__name__}: {exc}")
