"""``graphdeck replay``: re-run a stored graph (one profiled worker or a pipeline of stages).
Registered on the ``graphdeck`` group by graphdeck/cli.py (:data:`COMMANDS`)."""

from __future__ import annotations

import json

import click

from graphdeck.cli_common import _fail, _find_run, _mib, store_and_run
from graphdeck.errors import GraphdeckError

#: A node faster than this (ns) in the replay or in the recorded trace gets no ratio in the text
#: report: its time is mostly timer resolution and range overhead (--json keeps every ratio).
RATIO_FLOOR_NS = 20_000


def _comparable(times: dict[str, int], ratios: dict[str, float]) -> dict[str, float]:
    """The ratios (replay / recorded) of nodes at or above :data:`RATIO_FLOOR_NS` in both runs."""
    return {k: r for k, r in ratios.items()
            if r and times.get(k, 0) >= RATIO_FLOOR_NS and times[k] / r >= RATIO_FLOOR_NS}


@click.command("replay")
@store_and_run(store_help="SQLite store (read, and the replay run written) [$GRAPHDECK_STORE; default graphdeck.db].")
@click.argument("graph_id", type=int)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help='Executor config JSON {"executor": {"num_workers", "graph_partition_strategy", '
                   '"pipeline_microbatch_size", "communication_backend", "enable_heterogeneous_fusion"}}; '
                   "a flag given on the command line overrides the file, the file overrides the defaults.")
@click.option("--workers", default=1, show_default=True, help="Pipeline stages, one worker process each.")
@click.option("--strategy", type=click.Choice(["layerwise", "memory_aware", "auto"]), default="layerwise",
              show_default=True, help="How the graph is cut into stages.")
@click.option("--microbatches", default=4, show_default=True, help="Microbatches streamed through the pipeline.")
@click.option("--microbatch-size", type=click.IntRange(min=1), default=None,
              help="Rows per microbatch (default: the captured batch); refused, naming the node, when a static "
                   "shape in the graph fixes the batch size.")
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default=None, help="Default: gloo on CPU, nccl on CUDA.")
@click.option("--heterogeneous-fusion/--no-heterogeneous-fusion", "heterogeneous_fusion", default=None,
              help="Run the CPU- and GPU-placed segments of a mixed graph fused on --device (refused, with the "
                   "reason, on a graph recorded on one device type).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True, help="Where nodes run.")
@click.option("--iters", default=3, show_default=True, help="Profiled iterations of a one-worker run.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole summary as JSON.")
@click.pass_context
def replay_cmd(ctx: click.Context, run_name: str, graph_id: int, store: str, config_path: str | None, workers: int,
               strategy: str, microbatches: int, microbatch_size: int | None, backend: str | None,
               heterogeneous_fusion: bool | None, device: str, iters: int, as_json: bool) -> None:
    """Re-run stored graph GRAPH_ID of RUN_NAME with synthetic inputs: one worker under the profiler
    (a trace mapped onto its nodes), or split into stages pipelined over --workers processes."""
    import os

    from sqlalchemy.orm import Session

    # Kineto prints "USDT: ... profiler_start/stop" per profiled run on CPU; its levels end at 5, so 6
    # quiets it (set before torch loads; the workers inherit it; a user's own KINETO_LOG_LEVEL wins).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from graphdeck.errors import NotFoundError
    from graphdeck.replay.config import load_config, merge
    from graphdeck.replay.pipeline import replay
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Graph

    try:
        settings = {"workers": workers, "strategy": strategy, "microbatch_size": microbatch_size, "backend": backend,
                    "heterogeneous_fusion": heterogeneous_fusion}
        if config_path:  # flags on the command line > the file > defaults
            given = {k for k in settings if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE}
            settings = merge(load_config(config_path), settings, given)
        engine = open_engine(store, create=False)
        with Session(engine) as s:
            run = _find_run(s, run_name, store)
            graph = s.get(Graph, graph_id)
            if graph is None or graph.run_id != run.id:
                raise NotFoundError(f"graph {graph_id} not found in run {run.name!r}")
        out = replay(engine, graph_id, microbatches=microbatches, device=device, iters=iters, **settings)
    except GraphdeckError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
        return
    ex = out.get("executor")
    if ex:
        times = ex["node_gpu_ns"] or ex["node_cpu_ns"]
        recorded = (f"compared with recorded trace {ex['recorded_trace_id']}" if ex.get("recorded_trace_id") is not None
                    else "no recorded trace of this run maps onto the graph: nothing to compare with")
        click.echo(f"executor: trace {ex['trace_id']}, {len(times)} nodes timed on {device} "
                   f"(mean of {ex['iters']} runs; {recorded})")
        shown = _comparable(times, ex["ratio"])
        if shown:
            import statistics

            median = statistics.median(shown.values())
            click.echo(f"  replay / recorded time per node, median x{median:.2f} over {len(shown)} nodes: a replay "
                       "runs one graph alone, on synthetic inputs, under the profiler, on this host as loaded now, "
                       "so compare nodes with the median, not with 1.0 (a run-to-run regression is diff-runs' job, "
                       f"with a noise floor); nodes under {RATIO_FLOOR_NS // 1000} us in either run are timer noise "
                       "and get no ratio")
        for name, ns in sorted(times.items(), key=lambda kv: -kv[1])[:10]:
            ratio = shown.get(name)
            click.echo(f"  {name:<40s} {ns / 1e3:>10.1f} us" + (f"  x{ratio:.2f} vs recorded" if ratio else ""))
    if "pipeline" in out:
        from graphdeck.analysis.units import ns_text

        p, plan = out["pipeline"], out["plan"]
        cost = {"layerwise": "compute nodes", "memory_aware": "input bytes", "auto": "measured node time"}.get(
            plan["strategy"], "cost")
        click.echo(f"plan {plan['strategy']}: {len(plan['stages'])} stages; balance {plan['balance']:.2f} = the "
                   f"largest stage's {cost} / the mean stage's (1.00 is even)"
                   + (f"; by estimated time {plan['time_balance']:.2f}" if plan.get("time_balance") else ""))
        for st, busy in zip(plan["stages"], p["busy_ns"]):
            click.echo(f"  stage {st['index']}: {st['compute_nodes']} nodes, params {_mib(st['param_bytes'])}, "
                       f"activations {_mib(st['activation_bytes'])}, sends {len(st['send'])}, busy {ns_text(busy)}")
        click.echo(f"pipeline ({p['backend']}, {p['microbatches']} microbatches of {out['batch']['replayed']} rows): "
                   f"makespan {ns_text(p['makespan_ns'])}, bubble {p['bubble_fraction']:.1%}, traces {p['trace_ids']}")
    for seg in (out.get("heterogeneous_fusion") or {}).get("segments", []):
        click.echo(f"  fused on {device}: {seg['device_type']} segment {seg['first']}..{seg['last']} "
                   f"({seg['nodes']} nodes) in stage(s) {seg['stages']}")


COMMANDS = (replay_cmd,)
