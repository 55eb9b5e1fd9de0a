"""Running a partitioned stored graph as a pipeline on K workers (torch.distributed).

Worker ``s`` runs stage ``s`` of a :class:`~graphdeck.replay.partition.Plan`: a GraphModule cut
from the rebuilt graph (:func:`stage_module`) whose inputs are the graph inputs the stage reads
plus the values it receives, and whose outputs are the values it sends (the last stage also
returns the graph's outputs). Every worker makes the graph inputs itself from the same seed
(:func:`graphdeck.replay.synth.synth_inputs`, seed ``seed + m`` for microbatch ``m``), so only
stage boundaries travel: point-to-point ``isend``/``irecv`` batched per microbatch with
``batch_isend_irecv`` (gloo on CPU, nccl on GPU), sender and receiver walking each pair's
boundaries in name order.

# NOTE: [Microbatches of a static graph]
A microbatch is one execution of the whole graph with its own synthetic inputs, at the recorded
batch size, or at ``microbatch_size`` rows when given: the graph is then rebatched (its batch
inputs resized, every shape re-propagated; NOTE: [Rebatching a static graph] in
:mod:`graphdeck.replay.rebatch`), and refused, naming the node, when a shape baked into it
(``view(x, [2, 16, 96])``) fixes the batch size. The pipeline streams ``microbatches`` of them
(GPipe-style fill and drain: stage ``s`` starts microbatch ``m`` as soon as its inputs from
earlier stages arrive, while sends are in flight). The stage cut is planned on the recorded
graph; its boundaries carry the rebatched shapes.

Timing: each worker records, per microbatch, the wall interval (``time.time_ns``, comparable
across processes of one host) of its stage's compute. Busy time per stage is their sum; the
bubble fraction is ``1 - Σ busy / (K × makespan)`` with the makespan from the first start to the
last end over all workers (the definition of GPipe's bubble, measured rather than modelled).
Each worker profiles its run with node ranges (:func:`graphdeck.replay.executor.instrument`);
the traces are ingested as ``executor graph <id> worker <s>/<K>`` of the graph's run and rank.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from graphdeck.errors import UsageError


@dataclass
class PipelineResult:
    """A pipeline run: ``outputs[m]`` the graph outputs of microbatch ``m`` (a tuple of tensors or
    None), per-stage busy ns, makespan ns, bubble fraction and the stored trace ids by worker."""

    graph_id: int
    workers: int
    strategy: str
    backend: str | None
    microbatches: int
    outputs: list
    busy_ns: list[int]
    makespan_ns: int
    bubble_fraction: float
    trace_ids: list[int] = field(default_factory=list)
    plan: Any = None
    run_name: str | None = None  # the replay run holding the worker traces

    def summary(self) -> dict:
        return {"graph_id": self.graph_id, "workers": self.workers, "strategy": self.strategy,
                "backend": self.backend, "microbatches": self.microbatches, "busy_ns": self.busy_ns,
                "makespan_ns": self.makespan_ns, "bubble_fraction": self.bubble_fraction,
                "trace_ids": self.trace_ids, "run": self.run_name}


def stage_module(gm, stored, plan, stage: int):
    """The GraphModule of ``stage``: ``(graph inputs it reads..., received values...)`` →
    ``((sent values...), (graph outputs it makes...))``. Returns ``(module, input_names, recv,
    send, positions)`` with ``recv``/``send`` the stage's boundaries in wire order and
    ``positions`` the graph-output positions it returns (the last stage also returns outputs that
    are inputs or constants). Raises UsageError when a boundary is not a single tensor."""
    import torch.fx

    by_name = {f.name: f for f in gm.graph.nodes}
    by_stored = {s.name: by_name[s.name] for s in stored.nodes}
    st = plan.stages[stage]
    recv = sorted(st.recv, key=lambda b: (b.src, b.name))
    send = sorted(st.send, key=lambda b: (b.dst, b.name))
    for b in recv + send:
        if not isinstance(b.shape, list) or (b.shape and isinstance(b.shape[0], list)):
            raise UsageError(f"node {b.name!r} crosses from stage {b.src} to {b.dst} but is not one tensor")
    members = [s for s in stored.nodes if plan.assignment[s.name] == stage and s.op not in ("placeholder", "get_attr")]
    needed_inputs: list[str] = []
    for s in members:
        for ref in s.inputs():
            f = by_stored[ref]
            if f.op == "placeholder" and ref not in needed_inputs:
                needed_inputs.append(ref)
    out_node = next(f for f in gm.graph.nodes if f.op == "output")
    flat_out = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    last = len(plan.stages) - 1

    def owner(v) -> int:  # the stage that returns output position holding v
        if isinstance(v, torch.fx.Node) and v.op not in ("placeholder", "get_attr"):
            return plan.assignment[v.name]
        return last  # an input, a constant or None: the last stage returns it
    positions = [i for i, v in enumerate(flat_out) if owner(v) == stage]
    for i in positions:
        v = flat_out[i]
        if isinstance(v, torch.fx.Node) and v.op == "placeholder" and v.name not in needed_inputs:
            needed_inputs.append(v.name)
    order = {s.name: i for i, s in enumerate(stored.nodes)}
    needed_inputs.sort(key=order.__getitem__)
    graph = torch.fx.Graph()
    env: dict = {}
    for name in needed_inputs:
        env[by_stored[name]] = graph.placeholder(name)
    for b in recv:
        env[by_stored[b.name]] = graph.placeholder(b.name)
    for s in members:
        f = by_stored[s.name]
        if f.op == "output":
            continue
        for a in f.all_input_nodes:
            if a not in env and a.op == "get_attr":
                env[a] = graph.node_copy(a)
            elif a not in env and a.name == s.name + "_port":  # a device port before its restride
                env[a] = graph.node_copy(a, lambda x: env[x])
        env[f] = graph.node_copy(f, lambda a: env[a])
    for i in positions:  # get_attr tensors the last stage returns
        v = flat_out[i]
        if isinstance(v, torch.fx.Node) and v not in env:
            env[v] = graph.node_copy(v)
    outs = tuple(env[by_stored[b.name]] for b in send)
    final = tuple(env[v] if isinstance(v, torch.fx.Node) else v for v in (flat_out[i] for i in positions))
    graph.output((outs, final))
    return torch.fx.GraphModule(gm, graph, class_name=f"Stage{stage}"), needed_inputs, recv, send, positions


_TAG_STRIDE = 100_000


def _pair_index(bounds, peer: str) -> list[int]:
    """Position of each boundary among those exchanged with the same peer (wire order)."""
    seen: dict[int, int] = {}
    out = []
    for b in bounds:
        p = getattr(b, peer)
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


def _receive(recv, m: int, device, strides) -> list:
    """Microbatch ``m``'s boundary values from earlier stages: one batched group of ``irecv``
    (``batch_isend_irecv``: one NCCL group instead of one launch per tensor), restrided."""
    import torch.distributed as dist

    if not recv:
        return []
    bufs = [_recv_buffer(b, device) for b in recv]
    ops = [dist.P2POp(dist.irecv, buf, b.src, tag=m * _TAG_STRIDE + k)
           for b, k, buf in zip(recv, _pair_index(recv, "src"), bufs)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return [_restride(buf, strides.get(b.name)) for b, buf in zip(recv, bufs)]


def _send(send, values, m: int) -> list:
    """Start sending microbatch ``m``'s boundary values (one batched group); returns the requests."""
    import torch.distributed as dist

    if not send:
        return []
    ops = [dist.P2POp(dist.isend, v.contiguous(), b.dst, tag=m * _TAG_STRIDE + k)
           for b, k, v in zip(send, _pair_index(send, "dst"), values)]
    return dist.batch_isend_irecv(ops)


def _recv_buffer(b, device):
    import torch

    from graphdeck.replay.synth import _dtype

    return torch.empty(b.shape, dtype=_dtype(b.dtype), device=device)


def _restride(buf, stride):
    """``buf`` (contiguous, as received) laid out with the recorded ``stride``: a later ``view``
    of the stage may only be valid on that layout. Overlapping or unknown strides stay as is."""
    import torch

    if (not isinstance(stride, list) or len(stride) != buf.dim() or list(buf.stride()) == stride
            or not all(isinstance(x, int) and x > 0 for x in stride) or buf.numel() == 0):
        return buf
    out = torch.empty_strided(buf.shape, stride, dtype=buf.dtype, device=buf.device)
    out.copy_(buf)
    return out


def _worker(rank: int, world: int, payload: dict) -> None:
    """One pipeline worker (also called in-process for one worker, without a process group)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from graphdeck.replay.executor import instrument, rebuild
    from graphdeck.replay.synth import synth_inputs

    stored, plan, out_dir = payload["stored"], payload["plan"], payload["out_dir"]
    backend, m_count, seed = payload["backend"], payload["microbatches"], payload["seed"]
    device = payload["device"]
    if device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    if world > 1:
        dist.init_process_group(backend, init_method=payload["init_method"], rank=rank, world_size=world)
    try:
        rebuilt = rebuild(stored, device=device, seed=seed)
        mod, input_names, recv, send, positions = stage_module(rebuilt.gm, stored, plan, rank)
        if payload["profile"]:
            mod = instrument(mod, stored.id)
        ph_index = {p.name: i for i, p in enumerate(rebuilt.placeholders)}
        strides = {n.name: n.stride for n in stored.nodes}
        feeds = []
        for m in range(m_count):
            ins = synth_inputs(stored, device=device, seed=seed + m)
            feeds.append([ins[ph_index[n]] for n in input_names])
        cuda = device.startswith("cuda")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        spans, outputs, pending = [], [], []
        with torch.no_grad():
            # Warm-up: one untimed microbatch through the whole pipeline, communication included
            # (NCCL creates its point-to-point communicators lazily, on the first send).
            if world > 1:
                dist.barrier()
            sent, _ = mod(*feeds[0], *_receive(recv, m_count, device, strides))
            for req in _send(send, sent, m_count):
                req.wait()
            if world > 1:
                dist.barrier()
            prof = profile(activities=activities) if payload["profile"] else None
            if prof:
                prof.__enter__()
            for m in range(m_count):
                vals = _receive(recv, m, device, strides)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.time_ns()
                with record_function(f"graphdeck.stage/{rank}/mb{m}"):
                    sent, final = mod(*feeds[m], *vals)
                if cuda:
                    torch.cuda.synchronize()
                spans.append((t0, time.time_ns()))
                pending.extend(_send(send, sent, m))
                outputs.append(dict(zip(positions, final)))  # to the CPU after the timed loop
            for req in pending:
                req.wait()
            if prof:
                prof.__exit__(None, None, None)
                prof.export_chrome_trace(os.path.join(out_dir, f"worker-{rank}.json"))
        outputs = [{i: o.detach().cpu() if isinstance(o, torch.Tensor) else o for i, o in part.items()}
                   for part in outputs]
        torch.save(outputs, os.path.join(out_dir, f"outputs-{rank}.pt"))
        with open(os.path.join(out_dir, f"spans-{rank}.json"), "w") as fh:
            json.dump(spans, fh)
        if world > 1:
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_pipeline(engine, graph_id: int, *, workers: int = 2, strategy: str = "layerwise", microbatches: int = 4,
                 microbatch_size: int | None = None, backend: str | None = None, device: str = "cpu",
                 seed: int = 0, profile: bool = True, ingest: bool = True, plan=None,
                 run_name: str | None = None) -> PipelineResult:
    """Partition graph ``graph_id`` into ``workers`` stages with ``strategy`` and run
    ``microbatches`` through them (NOTE: [Microbatches of a static graph]); one worker runs
    in-process without a process group, more are spawned processes joined by ``backend``
    (default ``gloo`` on CPU, ``nccl`` on CUDA). Worker ``r``'s trace is rank ``r`` of replay run
    ``run_name`` (default: a new replay run of the graph's run; NOTE: [Replay runs] in
    :mod:`graphdeck.store.replay_runs`).

    Raises UsageError (bad flags, a microbatch size the static graph cannot take), BadInputError
    (a node cannot be rebuilt), NotFoundError (no such graph).
    """
    from graphdeck.replay.executor import load_stored_graph, set_trace_rank
    from graphdeck.replay.partition import plan_for_graph
    from graphdeck.replay.rebatch import rebatch
    from graphdeck.store.traces import ingest_trace

    if microbatches < 1:
        raise UsageError(f"need at least one microbatch, got {microbatches}")
    backend = check_backend(backend, device, workers)
    with Session(engine) as session:
        stored = load_stored_graph(session, graph_id)
        if plan is None:
            plan = plan_for_graph(session, graph_id, workers, strategy)
    if microbatch_size is not None:
        stored = rebatch(stored, microbatch_size)
        by_name = stored.by_name()
        for st in plan.stages:  # a boundary is one object in its sender's and its receiver's lists
            for b in st.send:
                b.shape, b.size_bytes = by_name[b.name].shape, by_name[b.name].size_bytes or 0
    workers = len(plan.stages)
    with tempfile.TemporaryDirectory() as out_dir:
        payload = {"stored": stored, "plan": plan, "out_dir": out_dir, "backend": backend, "microbatches": microbatches,
                   "seed": seed, "device": device, "profile": profile,
                   "init_method": f"file://{os.path.join(out_dir, 'rendezvous')}"}  # no port to race for
        if workers == 1:
            _worker(0, 1, payload)
        else:
            import torch.multiprocessing as mp

            mp.start_processes(_worker, args=(workers, payload), nprocs=workers, start_method="spawn")
        import torch

        parts = [torch.load(os.path.join(out_dir, f"outputs-{r}.pt")) for r in range(workers)]
        outputs = []
        for m in range(microbatches):  # each stage returned the output positions it makes
            merged = {i: v for part in parts for i, v in part[m].items()}
            outputs.append(tuple(merged[i] for i in range(len(merged))))
        spans = []
        for r in range(workers):
            with open(os.path.join(out_dir, f"spans-{r}.json")) as fh:
                spans.append(json.load(fh))
        busy = [sum(b - a for a, b in s) for s in spans]
        t0 = min(s[0][0] for s in spans)
        t1 = max(s[-1][1] for s in spans)
        makespan = max(1, t1 - t0)
        bubble = round(1 - sum(busy) / (workers * makespan), 4)
        result = PipelineResult(graph_id, workers, plan.strategy, backend if workers > 1 else None, microbatches,
                                outputs, busy, makespan, bubble, plan=plan)
        if profile and ingest:
            if run_name is None:
                from graphdeck.store.replay_runs import create_replay_run

                run_name = create_replay_run(engine, graph_id, workers=workers)
            result.run_name = run_name
            for r in range(workers):
                path = os.path.join(out_dir, f"worker-{r}.json")
                set_trace_rank(path, r)
                ing = ingest_trace(engine, path, run_name=run_name, rank=r,
                                   name=f"executor graph {graph_id} worker {r}/{workers}")
                result.trace_ids.append(ing.trace_id)
    return result


def check_backend(backend: str | None, device: str, workers: int) -> str:
    """The backend a run of ``workers`` on ``device`` uses (default gloo on CPU, nccl on CUDA).
    Raises UsageError: an unknown backend, nccl without CUDA on this machine or without
    ``--device cuda``, more CUDA workers than devices."""
    import torch

    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise UsageError(f"backend {backend!r}: one of gloo, nccl")
    cuda = torch.cuda.is_available()
    if backend == "nccl" and not cuda:
        raise UsageError("communication backend nccl needs CUDA devices and this machine has none "
                         f"(torch.cuda.is_available() is False; torch {torch.__version__}): use gloo")
    if backend == "nccl" and device != "cuda":
        raise UsageError("communication backend nccl moves CUDA tensors: it needs --device cuda (or use gloo)")
    if device == "cuda" and not cuda:
        raise UsageError(f"--device cuda: this machine has no CUDA device (torch {torch.__version__}); use --device cpu")
    if device == "cuda" and workers > torch.cuda.device_count():
        raise UsageError(f"{workers} workers on --device cuda need {workers} GPUs (one each); this machine has "
                         f"{torch.cuda.device_count()}")
    return backend


def replay(engine, graph_id: int, *, workers: int = 1, strategy: str = "layerwise", microbatches: int = 4,
           microbatch_size: int | None = None, backend: str | None = None, device: str = "cpu", seed: int = 0,
           iters: int = 3, heterogeneous_fusion: bool | None = None) -> dict:
    """What ``graphdeck replay`` does: one worker → a profiled executor run of the graph (trace
    ``executor graph <id>``, per-node times, ratio to a recorded trace); K workers → the stage
    plan and a pipeline run (per-worker traces, busy time per stage, bubble fraction). ``auto``
    without a trace that maps onto the graph first runs the one-worker executor to measure (at the
    recorded batch). ``microbatch_size``: NOTE: [Microbatches of a static graph];
    ``heterogeneous_fusion``: NOTE: [Heterogeneous fusion] in :mod:`graphdeck.replay.config`.
    Everything that can be refused (backend, device, microbatch size, fusion, device-only ops) is
    checked before anything runs.

    Returns a JSON-able summary (``batch``: captured and replayed batch size; ``recorded_devices``;
    ``heterogeneous_fusion`` when set; ``run``: the replay run holding its traces, NOTE: [Replay
    runs] in :mod:`graphdeck.store.replay_runs` — never the graph's own run). Raises as :func:`run_pipeline` / :func:`execute_graph`."""
    from graphdeck.replay.executor import execute_graph, load_stored_graph, recorded_node_ns
    from graphdeck.replay.partition import plan_for_graph
    from graphdeck.replay.placement import check_device
    from graphdeck.replay.placement import heterogeneous_fusion as fusion
    from graphdeck.replay.rebatch import captured_batch, rebatch

    if workers < 1:
        raise UsageError(f"need at least one worker, got {workers}")
    if workers > 1:
        backend = check_backend(backend, device, workers)
    elif backend == "nccl" or device == "cuda":
        check_backend(backend, device, 1)
    out: dict = {"graph_id": graph_id, "workers": workers, "device": device}
    with Session(engine) as session:
        stored = load_stored_graph(session, graph_id)
    check_device(stored, device, ports=device != "cpu")
    fusion(stored, heterogeneous_fusion, device)  # refusals first; segments with stages below
    captured = captured_batch(stored)
    if microbatch_size is not None:
        rebatch(stored, microbatch_size)
    out["batch"] = {"captured": captured, "replayed": microbatch_size or captured}
    out["recorded_devices"] = sorted({n.device for n in stored.nodes if n.device})  # device args map to `device`
    plan = None
    run_name = None  # one replay run per replay, made when the first trace is stored
    if workers == 1 or strategy == "auto":
        with Session(engine) as session:
            has_times = recorded_node_ns(session, graph_id, exclude=set())[0] is not None
        if workers == 1 or not has_times:
            res = execute_graph(engine, graph_id, device=device, iters=iters, seed=seed,
                                microbatch_size=microbatch_size if workers == 1 else None)
            out["executor"] = res.to_dict()
            run_name = res.run_name
    if workers > 1:
        with Session(engine) as session:
            plan = plan_for_graph(session, graph_id, workers, strategy)
        result = run_pipeline(engine, graph_id, workers=workers, strategy=strategy, microbatches=microbatches,
                              microbatch_size=microbatch_size, backend=backend, device=device, seed=seed, plan=plan,
                              run_name=run_name)
        out["plan"] = plan.to_dict()
        out["pipeline"] = result.summary()
        run_name = result.run_name or run_name
    out["run"] = run_name
    if heterogeneous_fusion is not None:
        out["heterogeneous_fusion"] = fusion(stored, heterogeneous_fusion, device,
                                             plan.assignment if plan else {n.name: 0 for n in stored.nodes})
    return out
