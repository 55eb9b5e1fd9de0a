"""Shadow AOTAutograd tracing: the forward/backward partition of a Dynamo graph, cache or not.

# NOTE: [Why a shadow trace]
# Inductor's and AOTAutograd's caches (FX graph cache, AOTAutogradCache) skip the fw/bw compile
# hooks on a warm second run, so a capture that listens to those hooks records nothing then.
# Instead, when the backend receives a Dynamo graph we trace it once more with
# ``aot_module_simplified`` and compilers that only keep the graphs they are handed. The
# compiled result of that trace is thrown away (it is never run); the inner backend compiles
# the same graph for real. The shadow uses the partitioner the inner backend uses (min-cut for
# Inductor and, on current torch, ``aot_eager``; the default one otherwise) and, for Inductor,
# Inductor's decompositions, so its forward/backward
# split, saved tensors and recompute tags match what runs. Cost: one extra AOT trace per graph,
# at compile time only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx


@dataclass
class AOTGraphs:
    """The graphs AOTAutograd produced for one Dynamo graph (any may be ``None``)."""

    forward: torch.fx.GraphModule | None = None
    backward: torch.fx.GraphModule | None = None
    inference: torch.fx.GraphModule | None = None
    errors: list[str] = field(default_factory=list)


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
    context = TracingContext(fake_mode) if fake_mode is not None else None
    current = TracingContext.try_get()
    if context is not None and current is not None:
        # Dynamo's fakification cache (NOTE: [Tensor Fakification and Symbol Caching] in torch):
        # without it, tracing tensor-subclass inputs (DTensor parameters under tensor
        # parallelism) recursed without end in proxy_tensor's lazy proxies.
        context.tensor_to_context = current.tensor_to_context
    try:
        with functorch_config.patch(force_non_lazy_backward_lowering=True), tracing(context):
            aot_module_simplified(
                gm, list(example_inputs), fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                inference_compiler=keep("inference"), partition_fn=partition_fn,
                decompositions=decompositions, keep_inference_input_mutations=True,
            )
    except Exception as exc:  # capture never breaks training
        out.errors.append(f"{type(exc).__name__}: {exc}")
    return out


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
