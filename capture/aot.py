"""The AOTAutograd forward/backward partition of a Dynamo graph, cache or not: taken from the
inner backend's own compile (:class:`Handover`), else from a shadow trace.

# NOTE: [Why a shadow trace]
# Inductor's and AOTAutograd's caches (FX graph cache, AOTAutogradCache) skip the fw/bw compile
# hooks on a warm second run, so a capture that listens to those hooks records nothing then.
# When the inner compile handed no graph over (a cache hit; a backend whose compilers are not
# known), we trace the Dynamo graph once more with ``aot_module_simplified`` and compilers that
# only keep the graphs they are handed. The compiled result of that trace is thrown away (it is
# never run). The shadow uses the partitioner the inner backend uses (Inductor's own partition
# function, joint-graph passes included; min-cut for ``aot_eager`` on current torch; the default
# one otherwise) and, for Inductor, Inductor's decompositions, so its forward/backward split,
# saved tensors and recompute tags match what runs. Cost: one extra AOT trace per graph, at
# compile time only (NOTE: [Graphs from the inner compile] for the cold compile, which pays none).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx


@dataclass
class AOTGraphs:
    """The graphs AOTAutograd produced for one Dynamo graph (any may be ``None``)."""

    forward: torch.fx.GraphModule | None = None
    backward: torch.fx.GraphModule | None = None
    inference: torch.fx.GraphModule | None = None
    errors: list[str] = field(default_factory=list)


class Handover:
    """The AOT graphs the inner backend's own compile hands to its compilers, for one Dynamo graph.

    # NOTE: [Graphs from the inner compile]
    # On a cold compile the inner backend's AOTAutograd calls its forward (or inference) compiler
    # inside the backend call, and its backward compiler lazily, at the first backward (at once
    # only when symbolic sizes are saved for it; never under compiled autograd). Wrapping the
    # compilers and the partition function hands the agent the graphs that really run — the
    # inner backend's decompositions, joint-graph passes, partition, saved tensors and recompute
    # tags — at no extra trace: the backward is the partitioner's, copied when the forward
    # compiles (AOTAutograd has finished with it then, and no compiler has rewritten it yet). Each
    # graph is copied when handed over, before the real compiler runs (Inductor's post-grad passes
    # rewrite the original in place). A cache hit (AOTAutogradCache) calls no compiler and no
    # partitioner: the agent then runs the shadow trace (NOTE: [Why a shadow trace]), which for
    # Inductor runs Inductor's partition function, so a warm run records the graphs a cold one
    # does. Should the partitioner's backward not be seen, the backward compiler's is written
    # when it arrives (from the thread that runs the backward).
    """

    def __init__(self) -> None:
        self.graphs = AOTGraphs()
        #: The backward graph the partitioner returned; copied when the forward compiles (after
        #: AOTAutograd's last edits to it, before the backward compiler can rewrite it).
        self.partitioned: torch.fx.GraphModule | None = None
        self._on_backward: Callable[[torch.fx.GraphModule], None] | None = None
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def when_backward(self, fn: Callable[[torch.fx.GraphModule], None]) -> None:
        """Call ``fn(backward graph)`` once: now if it is here, else when it is handed over."""
        with self._lock:
            g = self.graphs.backward
            if g is None:
                self._on_backward = fn
        if g is not None:
            fn(g)

    def keep(self, slot: str, gm: torch.fx.GraphModule) -> None:
        """Store a copy of ``gm`` as ``slot`` (forward, backward, inference); the first one stays."""
        if slot in self._seen:
            return
        try:
            copy = copy_graph(gm)
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            self.graphs.errors.append(f"copying the {slot} graph: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            if slot in self._seen:
                return
            self._seen.add(slot)
            setattr(self.graphs, slot, copy)
            late, self._on_backward = (self._on_backward, None) if slot == "backward" else (None, self._on_backward)
        if late is not None:
            late(copy)

    def release(self) -> None:
        """Drop the graphs held (they are written); a slot handed over again is still ignored."""
        with self._lock:
            self.graphs, self.partitioned = AOTGraphs(), None

    def wants_shadow(self) -> bool:
        """No graph was handed over (a cache hit, or a compile that bypassed the compilers)."""
        return self.graphs.forward is None and self.graphs.inference is None


class GraphCopy:
    """A kept AOT graph: ``graph`` is a node-by-node copy of the handed-over module's graph (names
    and shallow-copied meta kept), other attributes (a higher-order op's body, a constant) are
    read from that module, and ``code`` is generated when first read. Not a GraphModule: building
    one compiles and executes the generated Python (most of a copy's cost on a large graph, at
    compile time, for code nothing runs)."""

    def __init__(self, root: torch.fx.GraphModule, graph: torch.fx.Graph):
        self.graph = graph
        self._root = root
        self._code: str | None = None

    @property
    def code(self) -> str:
        """The graph's Python source as ``GraphModule.code`` spells it."""
        if self._code is None:
            self._code = self.graph.python_code(root_module="self").src
        return self._code

    def __getattr__(self, name: str) -> Any:
        root = self.__dict__.get("_root")
        if root is None:
            raise AttributeError(name)
        return getattr(root, name)


def copy_graph(gm: torch.fx.GraphModule) -> GraphCopy:
    """A :class:`GraphCopy` of ``gm`` (its graph copied node by node; attributes shared with ``gm``)."""
    graph = torch.fx.Graph()
    env: dict = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    return GraphCopy(gm, graph)


def recording_backend(inner: str, inner_fn: Callable, handover: Handover) -> Callable | None:
    """``inner_fn`` with its AOT compilers handing their graphs to ``handover``
    (NOTE: [Graphs from the inner compile]); ``None`` for a backend whose compilers are not
    known (the agent then runs the shadow trace)."""
    if inner == "inductor":
        from torch._inductor import compile_fx as cfx

        real_partition = cfx.partition_fn

        def partition(gm, joint_inputs, **kwargs):
            fw, bw = real_partition(gm, joint_inputs, **kwargs)
            handover.partitioned = bw  # the outermost partition returns last
            return fw, bw

        def inner_compile(gm, example_inputs, **kwargs):
            slot = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
            handover.keep(slot, gm)
            if slot == "forward" and handover.partitioned is not None:
                handover.keep("backward", handover.partitioned)
            return cfx.compile_fx_inner(gm, example_inputs, **kwargs)

        def inductor(gm, example_inputs, **kwargs):
            from torch._inductor.async_compile import maybe_warm_pool

            maybe_warm_pool()  # as the registered backend does (torch/_dynamo/backends/inductor.py)
            # compile_fx names its partition function at call time; Dynamo compiles one graph
            # at a time, and the name is restored before this returns.
            cfx.partition_fn = partition
            try:
                return cfx.compile_fx(gm, example_inputs, inner_compile=inner_compile, **kwargs)
            finally:
                cfx.partition_fn = real_partition

        return inductor
    if inner == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

        real_partition = min_cut_rematerialization_partition if _uses_min_cut(inner) else default_partition

        def partition(gm, joint_inputs, **kwargs):
            fw, bw = real_partition(gm, joint_inputs, **kwargs)
            handover.partitioned = bw
            return fw, bw

        def keep(slot):
            def compiler(gm, example_inputs):
                handover.keep(slot, gm)
                if slot == "forward" and handover.partitioned is not None:
                    handover.keep("backward", handover.partitioned)
                return boxed_nop(gm, example_inputs)

            return compiler

        # The registered aot_eager's settings (torch/_dynamo/backends/debugging.py), its
        # compilers recording.
        return aot_autograd(
            fw_compiler=keep("forward"), bw_compiler=keep("backward"), inference_compiler=keep("inference"),
            partition_fn=partition, keep_inference_input_mutations=True)
    return None


def shadow_trace(gm: torch.fx.GraphModule, example_inputs: list[Any], *, inner: str) -> AOTGraphs:
    """Trace ``gm`` with AOTAutograd and return its forward/backward (or inference) graphs.

    ``example_inputs`` are the (fake) inputs Dynamo passed to the backend. Never raises: a
    failure is returned in ``errors`` so that capture cannot break a training job.
    """
    from functorch.compile import make_boxed_func
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    from torch._guards import TracingContext, detect_fake_mode, tracing

    out = AOTGraphs()

    def keep(slot):
        def compiler(graph: torch.fx.GraphModule, _inputs):
            setattr(out, slot, graph)
            return make_boxed_func(graph.forward)

        return compiler

    decompositions = None
    partition_fn = min_cut_rematerialization_partition if _uses_min_cut(inner) else default_partition
    if inner in ("inductor", "aot_eager_decomp_partition"):
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    fake_mode = detect_fake_mode(example_inputs)
    inference = keep("inference")
    patches: dict = {"force_non_lazy_backward_lowering": True}
    if inner == "inductor":
        # Inductor's own partition function runs its joint-graph passes first, and its inference
        # compiler runs them on the inference graph: the shadow's graphs are then those of a cold
        # compile (NOTE: [Graphs from the inner compile]), so a warm run records the same graphs.
        from torch._inductor import compile_fx as inductor_compile_fx
        from torch._inductor.virtualized import V

        partition_fn = inductor_compile_fx.partition_fn
        patches["unlift_effect_tokens"] = True

        def inference(graph: torch.fx.GraphModule, _inputs):
            with V.set_fake_mode(fake_mode):
                inductor_compile_fx._recursive_joint_graph_passes(graph)
            out.inference = graph
            return make_boxed_func(graph.forward)

    context = TracingContext(fake_mode) if fake_mode is not None else None
    current = TracingContext.try_get()
    if context is not None and current is not None:
        # Dynamo's fakification cache (NOTE: [Tensor Fakification and Symbol Caching] in torch):
        # without it, tracing tensor-subclass inputs (DTensor parameters under tensor
        # parallelism) recursed without end in proxy_tensor's lazy proxies.
        context.tensor_to_context = current.tensor_to_context
    try:
        with functorch_config.patch(**patches), tracing(context), _fake_mode_for_passes(inner, fake_mode):
            aot_module_simplified(
                gm, list(example_inputs), fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                inference_compiler=inference, partition_fn=partition_fn,
                decompositions=decompositions, keep_inference_input_mutations=True,
            )
    except Exception as exc:  # capture never breaks training
        out.errors.append(f"{type(exc).__name__}: {exc}")
    return out


def _fake_mode_for_passes(inner: str, fake_mode):
    """Inductor's joint-graph passes read the fake mode from ``V`` (set as compile_fx does)."""
    import contextlib

    if inner != "inductor" or fake_mode is None:
        return contextlib.nullcontext()
    from torch._inductor.virtualized import V

    return V.set_fake_mode(fake_mode)


def _uses_min_cut(inner: str) -> bool:
    """Whether the registered backend ``inner`` partitions with the min-cut rematerialization
    partitioner (Inductor and ``aot_eager_decomp_partition`` always; ``aot_eager`` does from
    torch 2.6 on, the default partitioner before, so its function's code is asked)."""
    if inner in ("inductor", "aot_eager_decomp_partition"):
        return True
    if inner == "aot_eager":
        try:
            from torch._dynamo.backends import debugging

            return "min_cut_rematerialization_partition" in debugging.aot_eager.__code__.co_names
        except Exception:  # noqa: BLE001 - an unknown layout: keep the default partitioner
            return False
    return False


#: The inner tensor of a tensor-subclass input that stands for it (DTensor's local shard).
SUBCLASS_DATA_ATTRS = ("_local_tensor",)


def input_index(desc: Any) -> int | None:
    """``PlainAOTInput(idx=3)`` → 3 (the Dynamo graph's 4th placeholder); a DTensor input's local
    tensor (``SubclassGetAttrAOTInput(base=PlainAOTInput(idx=3), attr='_local_tensor')``) → 3
    too; others → ``None``."""
    if type(desc).__name__ == "SubclassGetAttrAOTInput" and getattr(desc, "attr", None) in SUBCLASS_DATA_ATTRS:
        desc = getattr(desc, "base", None)
    idx = getattr(desc, "idx", None)
    return idx if isinstance(idx, int) and type(desc).__name__ == "PlainAOTInput" else None


def grad_of(desc: Any) -> Any:
    """``GradAOTOutput(grad_of=X)`` → ``X`` (also under a DTensor gradient's local tensor,
    ``SubclassGetAttrAOTOutput(base=GradAOTOutput(...), attr='_local_tensor')``); other
    descriptors → ``None``."""
    if type(desc).__name__ == "SubclassGetAttrAOTOutput" and getattr(desc, "attr", None) in SUBCLASS_DATA_ATTRS:
        desc = getattr(desc, "base", None)
    if type(desc).__name__ == "GradAOTOutput":
        return getattr(desc, "grad_of", None)
    return None


def write_aot_graph(agent, p: dict, gid: int, plan, fqn_by_input: dict, kind: str, g: torch.fx.GraphModule):
    """Store the AOT graph ``g`` (``kind`` aot_forward/aot_backward/aot_inference) of the Dynamo
    graph ``gid`` with its parameter and gradient bindings (``p``: the agent's pending record,
    ``fqn_by_input``: Dynamo placeholder index → parameter FQN); returns (graph id, ``in`` rows,
    ``grad`` rows) and adds them to ``plan`` (NOTE: [Run-time parameter binding])."""
    from graphdeck.capture.callwrap import child_rows
    from graphdeck.capture.fxrecord import output_args, output_descs, record_graph

    ins, grads = [], []
    for pos, n in enumerate(x for x in g.graph.nodes if x.op == "placeholder"):
        k = input_index(n.meta.get("desc"))
        if k is not None and k in fqn_by_input:
            ins.append((pos, n.name, k, str(n.meta.get("desc"))))
    if kind == "aot_backward":
        for pos, (val, desc) in enumerate(zip(output_args(g), output_descs(g))):
            k = input_index(grad_of(desc))
            if k is not None:
                grads.append((pos, val.name if isinstance(val, torch.fx.Node) else None, k,
                              isinstance(val, torch.fx.Node), str(desc)))
    bind = {name: fqn_by_input[k] for _pos, name, k, _d in ins if fqn_by_input.get(k)}
    gid2 = agent.writer.write_graph(
        record_graph(g), kind=kind, name=f"{p['name']} · {kind.removeprefix('aot_')}",
        compile_id=p["compile_id"], frame_name=p["frame_name"], parent_id=gid,
        backend=f"graphdeck+{p['inner']}", io=child_rows(ins, grads, fqn_by_input), param_by_node=bind)
    agent._graph_refs.append(gid2)
    plan.children.append((gid2, ins, grads))
    return gid2, ins, grads


def write_late_backward(agent, p: dict, gid: int, plan, fqn_by_input: dict, g: torch.fx.GraphModule) -> None:
    """Store a backward graph handed over after its forward was written, with the parameter
    bindings recorded at run time since (NOTE: [Graphs from the inner compile]). Never raises."""
    import warnings

    from graphdeck.capture.callwrap import child_rows

    try:
        from graphdeck.capture.guards import no_new_guards

        first = tuple(fqn_by_input.get(i) for i in plan.positions)
        with no_new_guards(p.get("shape_env")):  # compiled lazily, inside the first backward
            gid2, ins, grads = write_aot_graph(agent, p, gid, plan, fqn_by_input, "aot_backward", g)
        rows = [r for names in list(plan.recorded) if names != first
                for r in child_rows(ins, grads, dict(zip(plan.positions, names)))]
        if rows:
            agent.writer.add_bindings({gid2: rows})
    except Exception as exc:  # capture never breaks training
        warnings.warn(f"graphdeck: could not record a backward graph: {type(exc).__name__}: {exc}")
