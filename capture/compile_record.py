"""One Dynamo graph recorded at compile time, for :class:`graphdeck.capture.agent.Agent`: what
the agent reads before the inner backend compiles (frame, graph-break reason, DDP bucket, the
parameter behind each placeholder, the shadow AOT trace when one is needed) and what it writes
after (the Dynamo graph, its DDP partition, the AOT forward/backward graphs, the binding plan).

Both run with the graph's ShapeEnv recording no guard (NOTE: [The capture adds no guard]).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.fx

from graphdeck.capture.aot import shadow_trace, write_aot_graph, write_late_backward
from graphdeck.capture.callwrap import BindingPlan
from graphdeck.capture.compile_context import (
    compile_context,
    compile_reason,
    ddp_compile_mode,
    ddp_context,
    under_ddp_optimizer,
)
from graphdeck.capture.fxrecord import record_graph
from graphdeck.capture.writer import IOBinding


def record_dynamo(agent, gm, example_inputs, inner_name, shadow: bool = True) -> dict:
    """Read ``gm`` before the inner compile: a dict the agent completes after it (``aot``,
    ``handover``, ``shape_env``) and hands to :func:`finish`."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    compile_id = str(cid) if cid is not None else None
    step = compile_step(agent)
    ddp = ddp_context()
    under_ddp = ddp is not None or under_ddp_optimizer()
    # A DDP bucket's sub-graph carries DDPOptimizer's own "intentional graph-break" reason;
    # the frame and the real reason are those of the unsplit Dynamo graph.
    frame_name, break_reason = compile_reason(ddp[1] if ddp is not None else gm)
    kind, parent_id, part_idx = "dynamo", None, None
    param_by_node: dict[str, str] = {}
    writer = agent.writer
    if ddp is not None:
        opt, full_gm, submod_name = ddp
        full_params = {n.name: f for n in full_gm.graph.nodes if n.op == "placeholder"
                       and (f := agent._fqn_of_placeholder(n))}
        parent_id = agent._ddp_parents.get(id(full_gm))
        if parent_id is None:
            rec = record_graph(full_gm)
            parent_id = writer.write_graph(
                rec, kind="dynamo", name=f"graph {compile_id} (split into {len(opt.buckets)} DDP buckets)",
                compile_id=compile_id, frame_name=frame_name, break_reason=break_reason,
                backend=f"graphdeck+{inner_name}", param_by_node=full_params,
                io=input_bindings(full_gm, full_params),
                meta={"ddp_buckets": len(opt.buckets), "bucket_bytes_cap": getattr(opt, "bucket_bytes_cap", None),
                      **({"step": step} if step is not None else {})})
            agent._ddp_parents[id(full_gm)] = parent_id
            agent._graph_refs.append(parent_id)
        kind = "ddp_partition"
        part_idx = int(submod_name.rsplit("_", 1)[-1]) if submod_name.rsplit("_", 1)[-1].isdigit() else None
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                fqn = agent._fqn_of_placeholder(n) or full_params.get(n.name)
                if fqn:
                    param_by_node[n.name] = fqn
        bucket = opt.buckets[part_idx] if part_idx is not None and part_idx < len(opt.buckets) else None
        # Bucket.params are the unsplit graph's placeholder targets.
        fqn_by_target = {str(n.target): full_params[n.name] for n in full_gm.graph.nodes
                         if n.name in full_params}
        pending_partition = (part_idx or 0, int(bucket.size) if bucket else 0,
                             [fqn_by_target.get(t, t) for t in (bucket.params if bucket else [])])
        name = f"graph {compile_id} · DDP bucket {part_idx}"
    else:
        pending_partition = None
        for n in gm.graph.nodes:
            if n.op == "placeholder" and (fqn := agent._fqn_of_placeholder(n)):
                param_by_node[n.name] = fqn
        name = f"graph {compile_id}" + (" (after graph break)" if frame_name and "resume_in" in frame_name else "")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    agent._learn_params(gm, param_by_node)
    aot = shadow_trace(gm, example_inputs, inner=inner_name) if shadow else None
    return {"gm": gm, "kind": kind, "name": name, "compile_id": compile_id, "frame_name": frame_name,
            "aot_source": "shadow" if shadow else None,
            "break_reason": None if ddp is not None else break_reason, "parent_id": parent_id,
            "partition_index": part_idx,
            "param_by_node": param_by_node, "placeholders": placeholders, "aot": aot,
            "inner": inner_name, "partition": pending_partition, "ddp": under_ddp,
            "full_gm": ddp[1] if ddp is not None else gm, "context": _context(), "step": step}


# NOTE: [Compile steps]
# Each Dynamo graph's ``meta_json`` holds ``"step"``: the training step the rank was in when Dynamo
# compiled the graph (:meth:`Agent.training_step`: optimizer steps taken, 0 before the first).
# Dynamo compiles a frame at the call that first needs the graph and runs it at once, so this is
# also the step the graph first ran in. A hang's predicted collective schedule picks, per rank, the
# graphs live at the step of the hang (NOTE: [Live compiles] in analysis/ranks/frame_compiles.py), not
# the latest ones: a rank that recompiled at step 3 ran its older graph at step 2. Absent when the
# rank counts no steps (no watch() and no live watch).


def compile_step(agent) -> int | None:
    """The rank's training step now (NOTE: [Compile steps]); None when it counts none or cannot tell."""
    try:
        return agent.training_step()
    except Exception:  # noqa: BLE001 - capture never breaks training
        return None


def _context() -> dict:
    """The graph's compile context (grad mode, autocast) and, inside a DDP forward, Dynamo's
    ``optimize_ddp`` mode (``optimize_ddp``; NOTE: [DDP overlap by construction])."""
    out = compile_context()
    mode = ddp_compile_mode()
    if mode is not None:
        out["optimize_ddp"] = mode
    return out


def finish(agent, p: dict, compile_time_s: float) -> int:
    """Write the graph ``p`` describes (and its AOT graphs, partition, binding plan); returns
    the Dynamo graph's ``graphs.id``."""
    writer = agent.writer
    rec = record_graph(p["gm"])
    io = input_bindings(p["gm"], p["param_by_node"])
    meta = {"aot_errors": p["aot"].errors} if p["aot"].errors else {}
    meta["aot_source"] = p["aot_source"]  # "inner": the inner compile's graphs; "shadow": a second trace
    if p.get("ddp"):
        meta["ddp"] = True  # compiled under DDPOptimizer (a single bucket is not split)
    meta.update(p.get("context") or {})
    if p.get("step") is not None:
        meta["step"] = p["step"]  # NOTE: [Compile steps]
    gid = writer.write_graph(
        rec, kind=p["kind"], name=p["name"], compile_id=p["compile_id"], frame_name=p["frame_name"],
        parent_id=p["parent_id"], partition_index=p["partition_index"], compile_time_s=compile_time_s,
        backend=f"graphdeck+{p['inner']}", break_reason=p["break_reason"], io=io,
        param_by_node=p["param_by_node"], meta=meta)
    agent._graph_refs.append(gid)
    if p["partition"] is not None:
        idx, size_bytes, params = p["partition"]
        writer.write_partition(parent_graph_id=p["parent_id"], graph_id=gid, index=idx,
                               size_bytes=size_bytes, params=params)
    fqn_by_input = {i: p["param_by_node"].get(n.name) for i, n in enumerate(p["placeholders"])}
    plan = BindingPlan(dynamo_graph_id=gid, dynamo_rows=[
        (i, n.name) for i, n in enumerate(p["placeholders"]) if graph_arg_is_param(n)])
    aot, handover = p["aot"], p.get("handover")
    for kind, g in (("aot_forward", aot.forward), ("aot_backward", aot.backward), ("aot_inference", aot.inference)):
        if g is not None and not (kind == "aot_backward" and handover is not None):
            write_aot_graph(agent, p, gid, plan, fqn_by_input, kind, g)
    plan.positions = [i for i, n in enumerate(p["placeholders"]) if graph_arg_is_param(n)]
    plan.recorded.add(tuple(fqn_by_input.get(i) for i in plan.positions))
    p["plan"] = plan
    if handover is not None:  # the backward now, or when the first backward compiles it
        handover.when_backward(lambda g: _timed(agent, write_late_backward, agent, p, gid, plan, fqn_by_input, g))
        handover.release()
    agent.flush_events()
    return gid


def _timed(agent, fn, *args):
    """``fn(*args)`` with its time added to the agent's capture time (the backward's graphs are
    written when the first backward compiles it, outside ``Agent._compile``)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        return fn(*args)
    finally:
        agent.capture_time_s += time.perf_counter() - t0
        agent.capture_cpu_s += time.thread_time() - c0


def graph_arg_is_param(node: torch.fx.Node) -> bool:
    """A Dynamo placeholder fed by a module's parameter or buffer (by its source, else its value)."""
    ga = node.meta.get("grapharg")
    if ga is None:
        return False
    source = getattr(ga, "source", None)
    attr = getattr(source, "name", None)
    name = attr() if callable(attr) else attr if isinstance(attr, str) else str(source)
    return "_parameters" in (name or "") or "_buffers" in (name or "") or isinstance(graph_arg_example(node), torch.nn.Parameter)



def input_bindings(gm: torch.fx.GraphModule, param_by_node: dict[str, str]) -> list[IOBinding]:
    """An ``in`` binding for every placeholder of ``gm`` that reads a parameter (position = its
    index among the placeholders)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [IOBinding("in", i, n.name, param_by_node[n.name]) for i, n in enumerate(placeholders)
            if n.name in param_by_node]



def graph_arg_example(node: torch.fx.Node) -> Any:
    """The real tensor behind a Dynamo placeholder (``GraphArg.example``), or ``None``."""
    ga = node.meta.get("grapharg")
    try:
        return ga.example if ga is not None else None
    except Exception:  # the weak reference is gone
        return None
