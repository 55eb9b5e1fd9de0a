"""``graphdeck memory`` (graph-derived memory and what-ifs) and ``graphdeck memory-snapshot`` (a
measured CUDA snapshot). Registered on the ``graphdeck`` group by graphdeck/cli.py
(:data:`COMMANDS`)."""

from __future__ import annotations

import click

from graphdeck.cli_common import DEFAULT_STORE, _fail, _find_run, _mib, _store_arg, store_and_run
from graphdeck.errors import GraphdeckError


@click.command("memory")
@store_and_run()
@click.argument("graph_id", type=int)
@click.option("--scope", type=click.Choice(["step", "graph"]), default=None,
              help="step: the graph's forward then backward graph (one training step; the default, as on the "
                   "memory page, falling back to the graph alone when it has no forward/backward pair); "
                   "graph: this graph alone.")
@click.option("--step", is_flag=True, hidden=True, help="Same as --scope step (kept for old scripts).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Holders (and saved activations) to list at the peak.")
@click.option("--checkpoint", "checkpoint_module", default=None, help="Estimate checkpointing this module path.")
@click.option("--dtype", default=None, help="Estimate activations stored in this dtype (e.g. bfloat16).")
def memory_cmd(run_name: str, graph_id: int, store: str, scope: str | None, step: bool, top: int,
               checkpoint_module: str | None, dtype: str | None) -> None:
    """Graph-derived memory of GRAPH_ID (of run RUN_NAME): the peak, where it occurs and its top
    holders by module path; optionally a checkpointing or dtype what-if for its step."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.memory.core import (
        checkpoint_estimate,
        dtype_estimate,
        forward_backward_pair,
        graph_memory,
        step_memory,
    )
    from graphdeck.errors import NotFoundError, UsageError
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Graph

    try:
        with Session(open_engine(store, read_only=True)) as s:
            run = _find_run(s, run_name, store)
            graph = s.get(Graph, graph_id)
            if graph is None or graph.run_id != run.id:
                raise NotFoundError(f"graph {graph_id} not found in run {run.name!r}")
            asked_step = step or scope == "step" or bool(checkpoint_module or dtype)
            if scope == "graph" and (checkpoint_module or dtype):
                given = " and ".join(o for o, v in (("--checkpoint", checkpoint_module), ("--dtype", dtype)) if v)
                raise UsageError(f"{given}: a what-if of a training step (forward + backward graph), not of one "
                                 "graph; drop --scope graph (or use --scope step)")
            pair = None
            if scope != "graph":
                try:
                    pair = forward_backward_pair(s, graph_id)
                except NotFoundError:
                    if asked_step:
                        raise
                    click.echo(f"(graph {graph_id} has no forward/backward pair: this graph alone)")
            if pair is not None:
                fw, bw = pair
                # The what-ifs first: a bad --checkpoint or --dtype fails before any report is printed.
                estimates = ([checkpoint_estimate(s, fw, bw, checkpoint_module)] if checkpoint_module else []) + \
                    ([dtype_estimate(s, fw, bw, dtype)] if dtype else [])
                curve = step_memory(s, fw, bw)
                what = f"step (forward {fw} + backward {bw})"
            else:
                estimates = []
                curve = graph_memory(s, graph_id)
                what = f"graph {graph_id} ({graph.kind})"
            click.echo(f"{what}: peak {_mib(curve.peak_bytes)} at node {curve.peak_node} "
                       f"(#{curve.peak_index} of {len(curve.nodes)})")
            click.echo("  by kind: " + ", ".join(f"{k} {_mib(v)}" for k, v in sorted(curve.by_kind_at_peak.items())))
            click.echo("  top holders at the peak (module path, bytes, tensors):")
            for h in curve.top_holders(top):
                click.echo(f"    {h.module_path:<48s} {_mib(h.size_bytes):>12s} {h.tensors:>5d}")
            from graphdeck.analysis.memory.recompute import recomputation_lines

            for line in recomputation_lines(curve.recomputation):
                click.echo(f"  {line}")
            if curve.saved:
                click.echo(f"  saved activations: {_mib(sum(x['size_bytes'] for x in curve.saved))} in {len(curve.saved)} tensors"
                           + f"; the largest {min(top, len(curve.saved))} and the backward node that frees each:")
                for x in sorted(curve.saved, key=lambda x: -x["size_bytes"])[:top]:
                    freed = f"freed by {x['freed_by']}" if x["freed_by"] else "held past the step"
                    click.echo(f"    {x['name']} ({_mib(x['size_bytes'])}) -> {freed}")
            for est in estimates:
                click.echo(f"  what-if {est.what}: peak {_mib(est.baseline_peak_bytes)} -> {_mib(est.estimated_peak_bytes)}"
                           f" (saves {_mib(est.saving_bytes)}; {est.note})".rstrip("; )") + ")")
                if est.peak_phase:
                    click.echo(f"    estimated peak at {est.estimated_peak_node} ({est.peak_phase})")
    except GraphdeckError as exc:
        _fail(exc)


@click.command("memory-snapshot")
@click.argument("snapshot", type=click.Path(exists=True, dir_okay=False))
@click.option("--store", default=DEFAULT_STORE, show_default=True, help="Store holding the run's compile records.")
@click.option("--run", "run_name", default=None, help="Run whose Inductor output code names the graphs (optional).")
@click.option("--device", type=int, default=0, show_default=True, help="CUDA device index in the snapshot.")
@click.option("--top", type=int, default=10, show_default=True, help="Places to list at the peak.")
def memory_snapshot_cmd(snapshot: str, store: str, run_name: str | None, device: int, top: int) -> None:
    """Replay a CUDA memory snapshot pickle (torch.cuda.memory._dump_snapshot) and print its
    measured peak and who holds the bytes then, on the run's graph nodes where Inductor code
    allocated them (graphdeck.analysis.memory.measured)."""
    from graphdeck.analysis.memory.measured import load_snapshot, measure, output_code_files
    from graphdeck.errors import UsageError

    try:
        snap = load_snapshot(snapshot)
        code, model = {}, None
        if run_name is not None:
            from sqlalchemy import select
            from sqlalchemy.orm import Session

            from graphdeck.store.db import open_engine
            from graphdeck.store.schema import Run

            engine = open_engine(_store_arg(store))
            with Session(engine) as s:
                run_id = s.scalar(select(Run.id).where(Run.name == run_name))
            if run_id is None:
                raise UsageError(f"no run named {run_name!r} in {store}")
            code = output_code_files(engine, run_id)
            from graphdeck.analysis.memory.inductor import inductor_step_memory

            model = inductor_step_memory(engine, run_id)  # NOTE: [Inductor buffer model]
        m = measure(snap, code, device=device)
    except GraphdeckError as exc:
        _fail(exc)
    mib = 2 ** 20
    click.echo(f"device {m.device}: measured peak {m.peak_bytes / mib:,.1f} MiB ({m.baseline_bytes / mib:,.1f} MiB "
               f"allocated before the history); {m.attributed} of {m.allocations} allocations on graph nodes")
    click.echo("at the peak: " + ", ".join(f"{k} {v / mib:,.1f} MiB" for k, v in
                                           sorted(m.by_category_bytes.items(), key=lambda kv: -kv[1])))
    for size, where in m.at_peak[:top]:
        label = (f"graph {where[1]}: {', '.join(where[2][:6]) or '(no source nodes)'}" if where[0] == "graph"
                 else where[0])
        click.echo(f"  {size / mib:10,.1f} MiB  {label}")
    if model is not None:  # the graph-derived step from the Inductor code, beside the measured peak
        rest = max(m.baseline_bytes - model.parameter_bytes, 0)
        click.echo(f"graph-derived (Inductor code): step peak {model.peak_bytes / mib:,.1f} MiB with "
                   f"{model.parameter_bytes / mib:,.1f} MiB parameters; + the {rest / mib:,.1f} MiB other than "
                   f"parameters allocated before the history (optimizer state, anything eager) = "
                   f"{(model.peak_bytes + rest) / mib:,.1f} MiB, {(model.peak_bytes + rest) / m.peak_bytes - 1:+.1%} "
                   "vs measured")


COMMANDS = (memory_cmd, memory_snapshot_cmd)
