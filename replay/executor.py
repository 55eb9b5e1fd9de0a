"""The bundled executor: a stored graph rebuilt as a runnable ``torch.fx.GraphModule`` and run
under the profiler with every node inside a ``record_function`` range named by the node.

Works from the store alone (no user code): the ``nodes`` rows of a graph give op, target string
(``aten.mm.default``, ``torch._C._nn.linear``, ``_operator.getitem``, a method name), arguments
(``args_json`` = ``{"args", "kwargs"}`` with ``{"node": name}`` references and ``{"repr": text}``
for values that are not JSON) and output tensor metadata (shape, dtype, stride, device).

# NOTE: [Rebuilding a stored graph]
- ``aten.X.overload`` / ``prims.X.overload`` / ``<ns>.X.overload`` resolve to
  ``torch.ops.<ns>.X.overload``; a namespace or op that is not registered in this process is a
  *missing custom op*.
- Any other ``call_function`` target is a dotted Python path (``torch._C._nn.linear``,
  ``_operator.getitem``) resolved by importing the longest importable module prefix and walking
  attributes; ``<lambda>``, ``<locals>`` and ``__main__`` targets are *opaque callables*.
- ``call_method`` targets are method names; ``call_module`` is refused (the module object is not
  stored). ``get_attr`` becomes a random tensor of the recorded metadata.
- ``{"repr": ...}`` arguments are parsed back when they are a ``torch.dtype``, ``torch.layout``,
  ``torch.memory_format`` or a device (``cpu``, ``cuda:0``); device arguments are moved to the
  executor's device. Anything else, or a string cut at capture (``…[total_len=N]``), is refused.
Every refusal is a :class:`~graphdeck.errors.BadInputError` whose message names the node.

# NOTE: [Executor ranges]
Each node runs inside a ``record_function`` range: ``torch._C._profiler._RecordFunctionFast``
(the C++ range Inductor's generated code uses; ~1-2 µs a node here against ~50 µs for the
``torch.ops.profiler._record_function_enter_new`` / ``_exit`` ops that
``torch.profiler.record_function`` calls, which are the fallback), entered and exited by FX nodes
so the instrumented module is still generated Python code (no interpreter loop). The range is named
``graphdeck.node/<graph_id>/<node name>`` (:func:`range_name`), so a trace maps onto nodes by name
with no heuristics, even when a forward and a backward graph share node names.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.errors import BadInputError, NotFoundError
from graphdeck.replay.ports import _DEVICE_PORTS, restride_outputs  # noqa: F401 (placement imports them here)
from graphdeck.store.schema import Graph, InternedString, Node, Run, Trace

RANGE_PREFIX = "graphdeck.node/"
_DEVICE_RE = re.compile(r"^(cpu|cuda|meta|mps|xpu|hpu)(:\d+)?$")
_SLICE_RE = re.compile(r"^slice\(((?:\s*(?:None|-?\d+)\s*,){2}\s*(?:None|-?\d+)\s*)\)$")
_TRUNCATED = "…[total_len="


def range_name(graph_id: int, node_name: str) -> str:
    """The ``record_function`` name of node ``node_name`` of graph ``graph_id``.

    >>> range_name(2, "addmm_1")
    'graphdeck.node/2/addmm_1'
    """
    return f"{RANGE_PREFIX}{graph_id}/{node_name}"


def parse_range_name(name: str) -> tuple[int, str] | None:
    """``'graphdeck.node/2/addmm_1'`` → ``(2, 'addmm_1')``; None for any other name."""
    if not name.startswith(RANGE_PREFIX):
        return None
    gid, _, node = name[len(RANGE_PREFIX):].partition("/")
    return (int(gid), node) if gid.isdigit() and node else None


# ------------------------------------------------------------------------------ stored graph
@dataclass
class StoredNode:
    """One ``nodes`` row as the executor needs it. ``shape``/``stride`` are lists (lists of lists
    for tuple outputs); ``size_bytes`` the output bytes (None when symbolic)."""

    idx: int
    name: str
    op: str
    target: str
    args: list
    kwargs: dict
    shape: Any
    dtype: str | None
    stride: Any
    device: str | None
    size_bytes: int | None
    module_path: str | None
    param_fqn: str | None
    value: str | None = None  # a non-tensor output as recorded (``meta_json["value"]``: a SymInt's int)

    def inputs(self) -> list[str]:
        """Names of the nodes this node reads, in argument order (repeats kept)."""
        out: list[str] = []
        _walk_refs([self.args, self.kwargs], out)
        return out


def _walk_refs(value: Any, out: list[str]) -> None:
    if isinstance(value, dict):
        if set(value) == {"node"}:
            out.append(value["node"])
            return
        for v in value.values():
            _walk_refs(v, out)
    elif isinstance(value, list):
        for v in value:
            _walk_refs(v, out)


@dataclass
class StoredGraph:
    id: int
    run_id: int
    run_name: str
    rank: int
    kind: str
    name: str
    nodes: list[StoredNode]

    def by_name(self) -> dict[str, StoredNode]:
        return {n.name: n for n in self.nodes}


def _meta_value(meta_json: str | None) -> str | None:
    try:
        value = json.loads(meta_json or "{}").get("value")
    except (ValueError, AttributeError):
        return None
    return None if value is None else str(value)


def load_stored_graph(session: Session, graph_id: int) -> StoredGraph:
    """Graph ``graph_id`` with its nodes in graph order. Raises NotFoundError."""
    g = session.get(Graph, graph_id)
    if g is None:
        raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
    run = session.get(Run, g.run_id)
    target = InternedString.__table__.alias("t")
    module = InternedString.__table__.alias("m")
    rows = session.execute(
        select(Node.idx, Node.name, Node.op, target.c.value, Node.args_json, Node.shape_json, Node.dtype,
               Node.stride_json, Node.device, Node.size_bytes, module.c.value, Node.param_fqn, Node.meta_json)
        .join(target, target.c.id == Node.target_id)
        .outerjoin(module, module.c.id == Node.module_path_id)
        .where(Node.graph_id == graph_id).order_by(Node.idx)).all()
    nodes = []
    for r in rows:
        try:
            payload = json.loads(r[4] or "{}")
        except ValueError as exc:
            raise BadInputError(f"graph {graph_id} node {r[1]!r}: args_json is not JSON ({exc})") from exc
        if isinstance(payload, list):  # older rows: bare args list
            payload = {"args": payload, "kwargs": {}}
        nodes.append(StoredNode(r[0], r[1], r[2], r[3], payload.get("args", []), payload.get("kwargs", {}),
                                json.loads(r[5]) if r[5] else None, r[6], json.loads(r[7]) if r[7] else None,
                                r[8], r[9], r[10], r[11], _meta_value(r[12])))
    return StoredGraph(g.id, g.run_id, run.name, g.rank, g.kind, g.name, nodes)


# ---------------------------------------------------------------------------------- rebuild
def _resolve_callable(node: StoredNode):

    t = node.target
    if "<lambda>" in t or "<locals>" in t or t.startswith("__main__."):
        raise BadInputError(f"node {node.name!r}: target {t!r} is an opaque Python callable that the store "
                            "cannot rebuild")
    parts = t.split(".")
    if len(parts) >= 2 and (parts[0] in _OP_NAMESPACES or importlib.util.find_spec(parts[0]) is None):
        return _torch_op(node, parts)
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        if callable(obj):
            return obj
    if len(parts) == 1:
        import builtins

        if callable(getattr(builtins, t, None)):
            return getattr(builtins, t)
    if len(parts) >= 2:
        return _torch_op(node, parts)
    raise BadInputError(f"node {node.name!r}: target {t!r} does not resolve to a callable in this process")


_OP_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional", "_dtensor", "quantized",
                            "higher_order", "inductor", "profiler"})


def _torch_op(node: StoredNode, parts: list[str]):
    import torch

    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        return getattr(packet, parts[2]) if len(parts) > 2 else packet
    except (AttributeError, RuntimeError) as exc:
        raise BadInputError(f"node {node.name!r}: op {'.'.join(parts)!r} is not registered in this process "
                            "(a missing custom op: import the library that defines it first)") from exc


def _parse_repr(node: StoredNode, text: str, device):
    import torch

    if _DEVICE_RE.match(text):
        return device if device is not None else torch.device(text)
    if text.startswith("device(type="):  # repr(torch.device)
        return device if device is not None else torch.device(text.split("'")[1])
    m = _SLICE_RE.match(text)
    if m:
        return slice(*(None if p.strip() == "None" else int(p) for p in m.group(1).split(",")))
    if text in ("Ellipsis", "..."):
        return Ellipsis
    if text.startswith("torch."):
        value = getattr(torch, text[len("torch."):], None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
    raise BadInputError(f"node {node.name!r}: argument {text!r} was stored as a repr the executor cannot "
                        "rebuild")


def _rebuild_arg(node: StoredNode, value: Any, env: dict, device):
    if isinstance(value, dict):
        if set(value) == {"node"}:
            ref = value["node"]
            if ref not in env:
                raise BadInputError(f"node {node.name!r}: argument refers to unknown node {ref!r}")
            return env[ref]
        if set(value) == {"repr"}:
            return _parse_repr(node, str(value["repr"]), device)
        return {k: _rebuild_arg(node, v, env, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebuild_arg(node, v, env, device) for v in value]
    if isinstance(value, str) and _TRUNCATED in value:
        raise BadInputError(f"node {node.name!r}: a string argument was cut at capture ({value[:40]!r}…)")
    return value


def _attr_name(target: str) -> str:
    return re.sub(r"\W", "_", target)


@dataclass
class Rebuilt:
    """A rebuilt graph: ``gm`` takes the graph's placeholders in order; ``get_attr`` tensors are
    buffers of ``gm`` (random, from the recorded metadata)."""

    graph: StoredGraph
    gm: Any  # torch.fx.GraphModule
    placeholders: list[StoredNode]
    device: str = "cpu"


def rebuild(stored: StoredGraph, *, device: str = "cpu", seed: int = 0, ports: bool | None = None) -> Rebuilt:
    """A runnable ``torch.fx.GraphModule`` of ``stored`` on ``device``. ``ports`` (default: when
    ``device`` is not the CPU) swaps CPU-only kernels for portable equivalents (NOTE: [Device
    ports] in replay/ports.py).

    Raises:
        BadInputError: naming the node that cannot be rebuilt (NOTE: [Rebuilding a stored graph]),
            or the first node whose op has no kernel for ``device`` (NOTE: [Device-only ops] in
            :mod:`graphdeck.replay.placement`).
        UsageError: ``device`` is CUDA and this machine has none.
    """
    import torch
    import torch.fx

    from graphdeck.replay.synth import tensor_from_meta

    dev = torch.device(device)
    use_ports = dev.type != "cpu" if ports is None else ports
    from graphdeck.replay.placement import check_device

    check_device(stored, str(dev), ports=use_ports)  # NOTE: [Device-only ops]
    graph = torch.fx.Graph()
    env: dict[str, Any] = {}
    attrs: dict[str, Any] = {}
    placeholders = []
    gen = torch.Generator().manual_seed(seed + 7919)
    for n in stored.nodes:
        if n.op == "placeholder":
            env[n.name] = graph.placeholder(n.name)
            placeholders.append(n)
        elif n.op == "get_attr":
            name = _attr_name(n.target)
            if n.shape is None or n.dtype is None:
                raise BadInputError(f"node {n.name!r}: get_attr {n.target!r} has no tensor metadata to rebuild")
            attrs[name] = tensor_from_meta(n, gen, dev)
            env[n.name] = graph.get_attr(name)
        elif n.op in ("call_function", "call_method"):
            args = _rebuild_arg(n, n.args, env, dev)
            kwargs = _rebuild_arg(n, n.kwargs, env, dev)
            if n.op == "call_function":
                port = _DEVICE_PORTS.get(n.target) if use_ports else None
                fn = port or _resolve_callable(n)
                if n.target == "_operator.getitem" and len(args) == 2 and isinstance(args[1], list):
                    args[1] = tuple(args[1])  # JSON stored the index tuple as a list
                env[n.name] = graph.call_function(fn, tuple(args), kwargs)
                if port is not None:
                    env[n.name].name = n.name + "_port"
                    env[n.name] = graph.call_function(restride_outputs, (env[n.name], n.stride))
            else:
                env[n.name] = graph.call_method(n.target, tuple(args), kwargs)
            env[n.name].name = n.name
        elif n.op == "call_module":
            raise BadInputError(f"node {n.name!r}: call_module {n.target!r} needs the module object, which the "
                                "store does not hold")
        elif n.op == "output":
            args = _rebuild_arg(n, n.args, env, dev)
            out = args[0] if len(args) == 1 else args
            graph.output(tuple(out) if isinstance(out, list) else out)
        else:
            raise BadInputError(f"node {n.name!r}: unknown op kind {n.op!r}")
    root = torch.nn.Module()
    for name, value in attrs.items():
        root.register_buffer(name, value)
    gm = torch.fx.GraphModule(root, graph, class_name=f"Graph{stored.id}")
    return Rebuilt(stored, gm, placeholders, str(dev))


_FAST_RANGE = None


def range_open(name: str):
    """Enter a ``_RecordFunctionFast`` range named ``name``; returns it for :func:`range_close`."""
    global _FAST_RANGE
    if _FAST_RANGE is None:
        from torch._C._profiler import _RecordFunctionFast

        _FAST_RANGE = _RecordFunctionFast
    rf = _FAST_RANGE(name)
    rf.__enter__()
    return rf


def range_close(rf) -> None:
    rf.__exit__(None, None, None)


def instrument(gm, graph_id: int):
    """A copy of ``gm`` whose every ``call_*`` node runs inside a ``record_function`` range named
    :func:`range_name` (NOTE: [Executor ranges]). Same inputs, same outputs."""
    import torch
    import torch.fx

    fast = getattr(torch._C._profiler, "_RecordFunctionFast", None)

    def enter(name):
        if fast is None:
            return graph.call_function(torch.ops.profiler._record_function_enter_new.default, (name, None))
        return graph.call_function(range_open, (name,))

    def leave(rf):
        if fast is None:
            graph.call_function(torch.ops.profiler._record_function_exit._RecordFunction, (rf,))
        else:
            graph.call_function(range_close, (rf,))

    ports = set(_DEVICE_PORTS.values())
    graph = torch.fx.Graph()
    env: dict = {}
    handle = None
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in ports:  # one range over the port and its restride
            handle = enter(range_name(graph_id, n.name.removesuffix("_port")))
            env[n] = graph.node_copy(n, lambda a: env[a])
        elif n.op == "call_function" and n.target is restride_outputs and handle is not None:
            env[n] = graph.node_copy(n, lambda a: env[a])
            leave(handle)
            handle = None
        elif n.op in ("call_function", "call_method", "call_module"):
            h = enter(range_name(graph_id, n.name))
            env[n] = graph.node_copy(n, lambda a: env[a])
            leave(h)
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    return torch.fx.GraphModule(gm, graph, class_name=f"Instrumented{graph_id}")


# --------------------------------------------------------------------------------- profiling
@dataclass
class ExecutorResult:
    """One profiled executor run of a graph: ``outputs`` of the last iteration, the stored
    ``trace_id``, per-node mean CPU (and GPU) time in ns per iteration, and the ratio to the
    recorded trace's time for nodes where the run has one (``executor / recorded``)."""

    graph_id: int
    device: str
    iters: int
    outputs: Any
    trace_id: int | None
    node_cpu_ns: dict[str, int] = field(default_factory=dict)
    node_gpu_ns: dict[str, int] = field(default_factory=dict)
    recorded_trace_id: int | None = None
    ratio: dict[str, float] = field(default_factory=dict)
    run_name: str | None = None  # the replay run holding the trace

    def to_dict(self) -> dict:
        return {"graph_id": self.graph_id, "device": self.device, "iters": self.iters, "trace_id": self.trace_id,
                "run": self.run_name,
                "node_cpu_ns": self.node_cpu_ns, "node_gpu_ns": self.node_gpu_ns,
                "recorded_trace_id": self.recorded_trace_id, "ratio": self.ratio}


def profile_module(fn, inputs, *, iters: int, warmup: int, cuda: bool, path: str):
    """Run ``fn(*inputs)`` ``warmup`` times, then ``iters`` times under ``torch.profiler``; write
    the Chrome trace to ``path``; return the last outputs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = None
    with torch.no_grad():
        for _ in range(warmup):
            out = fn(*inputs)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(iters):
                out = fn(*inputs)
            if cuda:
                torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return out


def set_trace_rank(path: str, rank: int) -> None:
    """Rewrite ``distributedInfo.rank`` of a Chrome trace file (a worker of a process group
    writes its worker rank; the store files it under the recorded graph's rank)."""
    with open(path) as fh:
        data = json.load(fh)
    info = data.get("distributedInfo")
    if isinstance(info, dict):
        info["worker_rank"] = info.get("rank")
        info["rank"] = rank
    with open(path, "w") as fh:
        json.dump(data, fh)


def node_times_from_trace(session: Session, trace_id: int, graph_id: int) -> tuple[dict[str, int], dict[str, int]]:
    """Per-node total CPU and GPU time (ns) of graph ``graph_id`` in trace ``trace_id``, from the
    executor's ranges (NOTE: [Executor ranges]): CPU = the range's duration; GPU = the kernels,
    memcpys and memsets whose launch lies inside the range (correlation links,
    :mod:`graphdeck.analysis.traces.links`). Mean per range of the node (one range per iteration)."""
    from graphdeck.analysis.traces.data import load_events
    from graphdeck.analysis.traces.links import link_gpu_events

    events = load_events(session, trace_id, with_args=False)
    cpu: dict[str, int] = {}
    gpu: dict[str, int] = {}
    count: dict[str, int] = {}
    has_gpu = False
    for e in events:
        key = parse_range_name(e.name)
        if key and key[0] == graph_id and e.cat in ("user_annotation", "cpu_op", "Operator", ""):
            cpu[key[1]] = cpu.get(key[1], 0) + e.dur
            count[key[1]] = count.get(key[1], 0) + 1
        elif e.cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            has_gpu = True
    if has_gpu:
        for link in link_gpu_events(events).values():
            for rng in reversed(link.chain):
                key = parse_range_name(rng.name)
                if key and key[0] == graph_id:
                    gpu[key[1]] = gpu.get(key[1], 0) + link.gpu.dur
                    break
    return ({k: v // count[k] for k, v in sorted(cpu.items())},
            {k: v // count.get(k, 1) for k, v in sorted(gpu.items())})


def recorded_node_ns(session: Session, graph_id: int, exclude: set[int]) -> tuple[int | None, dict[str, int]]:
    """Per-node time of graph ``graph_id`` in the newest earlier trace that maps onto it: an
    executor trace of the graph in a replay run of its run (named ``executor graph <id>``: its
    ranges; pipeline workers' traces hold one stage each and are skipped; NOTE: [Replay runs] in
    :mod:`graphdeck.store.replay_runs`), else the newest trace of its run and rank through a compiled
    run's kernel mapping (:func:`graphdeck.analysis.traces.mapping.node_time_ns`).
    Only trace names are scanned, so a store with many large traces is not read event by event.
    ``(None, {})`` when none maps."""
    from graphdeck.analysis.traces.mapping import node_time_ns
    from graphdeck.store.replay_runs import executor_traces

    g = session.get(Graph, graph_id)
    for tid, _name in reversed(executor_traces(session, g, single_only=True)):
        if tid not in exclude:
            cpu, gpu = node_times_from_trace(session, tid, graph_id)
            if cpu:
                return tid, gpu or cpu
    rows = session.execute(select(Trace.id, Trace.name).where(
        Trace.run_id == g.run_id, Trace.rank == g.rank, Trace.status.in_(("ok", "truncated")))
        .order_by(Trace.id.desc())).all()
    for tid, name in rows:
        if tid not in exclude and not name.startswith("executor graph "):
            mapped = node_time_ns(session, graph_id, tid)
            return (tid, mapped) if mapped else (None, {})
    return None, {}


def execute_graph(engine, graph_id: int, *, device: str = "cpu", iters: int = 3, warmup: int = 1,
                  seed: int = 0, ingest: bool = True, trace_dir: str | None = None,
                  microbatch_size: int | None = None, run_name: str | None = None) -> ExecutorResult:
    """Rebuild graph ``graph_id``, run it ``iters`` times on ``device`` under the profiler with
    node ranges, ingest the trace as trace ``executor graph <id>`` (the graph's rank) of replay run
    ``run_name`` (default: a new replay run of the graph's run; never the graph's own run: NOTE:
    [Replay runs] in :mod:`graphdeck.store.replay_runs`), and compare per-node times with the recorded
    trace where one maps onto the graph.
    ``microbatch_size`` other than the captured batch runs the graph rebatched
    (:func:`graphdeck.replay.rebatch.rebatch`); its trace is ``executor graph <id> batch <b>``
    and has no ratio (the recorded times are of another batch size).

    Returns :class:`ExecutorResult` (times are means per iteration, ns). Raises BadInputError
    (a node cannot be rebuilt or has no kernel on ``device``), UsageError (the graph cannot take
    ``microbatch_size``), NotFoundError (no such graph).
    """
    import torch

    from graphdeck.replay.rebatch import rebatch
    from graphdeck.replay.synth import synth_inputs
    from graphdeck.store.traces import ingest_trace

    with Session(engine) as session:
        stored = load_stored_graph(session, graph_id)
    full = stored
    if microbatch_size is not None:
        stored = rebatch(stored, microbatch_size)
    name = f"executor graph {graph_id}" + ("" if stored is full else f" batch {microbatch_size}")
    rebuilt = rebuild(stored, device=device, seed=seed)
    inputs = synth_inputs(stored, device=device, seed=seed)
    timed = instrument(rebuilt.gm, graph_id)
    cuda = torch.device(device).type == "cuda"
    with tempfile.TemporaryDirectory(dir=trace_dir) as tmp:
        path = os.path.join(tmp, f"executor-graph-{graph_id}.json")
        outputs = profile_module(timed, inputs, iters=iters, warmup=warmup, cuda=cuda, path=path)
        result = ExecutorResult(graph_id, device, iters, outputs, None)
        if not ingest:
            return result
        set_trace_rank(path, stored.rank)
        if run_name is None:
            from graphdeck.store.replay_runs import create_replay_run

            run_name = create_replay_run(engine, graph_id)
        ing = ingest_trace(engine, path, run_name=run_name, rank=stored.rank, name=name)
    result.trace_id, result.run_name = ing.trace_id, run_name
    with Session(engine) as session:
        cpu, gpu = node_times_from_trace(session, ing.trace_id, graph_id)
        result.node_cpu_ns, result.node_gpu_ns = cpu, gpu
        mine = result.node_gpu_ns or result.node_cpu_ns
        rec_id, rec = recorded_node_ns(session, graph_id, exclude={ing.trace_id}) if stored is full else (None, {})
    result.recorded_trace_id = rec_id
    result.ratio = {k: round(mine[k] / v, 4) for k, v in rec.items() if v and k in mine}
    return result
