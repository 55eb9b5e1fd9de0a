"""Where a stored graph's nodes can run: device checks before a replay, and the CPU/GPU segments
of a mixed graph (``enable_heterogeneous_fusion``, NOTE: [Heterogeneous fusion] in
:mod:`graphdeck.replay.config`).

Torch is imported inside the functions that need it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from graphdeck.errors import BadInputError, UsageError

# NOTE: [Device-only ops]
# A graph captured on a GPU can call ops that have no kernel for the replay device
# (``aten._scaled_dot_product_efficient_attention`` and its backward have CUDA kernels only). Before
# anything runs, every ``torch.ops`` node is looked up in the dispatcher's computed table for the
# device's dispatch key (composite and fallback kernels count); the first node without one is named
# with its op and the device it was recorded on, instead of the ``NotImplementedError`` the
# dispatcher would raise mid-run.
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def check_device(stored, device: str, *, ports: bool = False) -> None:
    """Refuse to replay ``stored`` on ``device`` (``cpu``, ``cuda:N``; others are not checked)
    when CUDA is asked for and absent, or when a node calls an op with no kernel for that device
    (NOTE: [Device-only ops]); ported nodes (NOTE: [Device ports]) are skipped when ``ports``.

    Raises UsageError (no CUDA), BadInputError naming the first such node, its op, how many
    others, and the device the graph was recorded on."""
    import torch

    from graphdeck.replay.executor import _DEVICE_PORTS, _resolve_callable

    dev_type = torch.device(device).type
    if dev_type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device}: this machine has no CUDA device (torch.cuda.is_available() is False; "
                         f"torch {torch.__version__}); replay on the CPU (--device cpu)")
    key = _DISPATCH_KEYS.get(dev_type)
    if key is None:
        return
    missing: list = []
    for n in stored.nodes:
        if n.op != "call_function" or (ports and n.target in _DEVICE_PORTS):
            continue
        try:
            fn = _resolve_callable(n)
        except BadInputError:
            continue  # rebuild names it
        if isinstance(fn, torch._ops.OpOverload) and not torch._C._dispatch_has_computed_kernel_for_dispatch_key(
                fn.name(), key):
            missing.append((n, n.target))
    if not missing:
        return
    node, op = missing[0]
    recorded = sorted({n.device for n in stored.nodes if n.device})
    others = sorted({op for _, op in missing[1:]} - {op})
    more = (f"; {len(missing) - 1} more node(s) have the same problem" + (f" (also {', '.join(others)})" if others
                                                                          else "")) if len(missing) > 1 else ""
    raise BadInputError(f"graph {stored.id} cannot run on {device}: node {node.name!r} calls {op}, which has no "
                        f"{key} kernel (a {'CUDA' if key == 'CPU' else 'device'}-only op; the graph was recorded "
                        f"on {', '.join(recorded) or 'an unknown device'}){more}. Replay it on a machine with "
                        f"that device (--device {'cuda' if key == 'CPU' else 'cpu'})",
                        node=node.name, op=op)


def device_type(device: str | None) -> str | None:
    """``'cuda:0'`` → ``'cuda'``; None for a node without a recorded device (a non-tensor value)."""
    return device.split(":", 1)[0] if device else None


@dataclass
class Segment:
    """A maximal run of compute nodes, in graph order, recorded on one device type."""

    device_type: str
    first: str
    last: str
    nodes: int
    stages: list[int] | None = None  # the stages it runs in, once a plan is known


def segments(stored) -> list[Segment]:
    """The device segments of ``stored``'s compute (``call_*``) nodes; nodes with no recorded
    device (SymInt arithmetic, ``getitem`` of non-tensors) join the segment they sit in."""
    out: list[Segment] = []
    for n in stored.nodes:
        if not n.op.startswith("call_"):
            continue
        kind = device_type(n.device)
        if out and (kind is None or kind == out[-1].device_type):
            out[-1].last, out[-1].nodes = n.name, out[-1].nodes + 1
        elif kind is not None:
            out.append(Segment(kind, n.name, n.name, 1))
    return out


def heterogeneous_fusion(stored, enabled: bool | None, device: str, assignment: dict[str, int] | None = None
                         ) -> dict | None:
    """What ``enable_heterogeneous_fusion`` does for ``stored`` replayed on ``device`` (NOTE:
    [Heterogeneous fusion]): None when not set; else ``{"enabled", "device", "segments": [{device_type,
    first, last, nodes, stages}]}`` with each segment's stages from ``assignment`` (node → stage).

    Raises UsageError: ``true`` on a graph recorded on one device type (nothing to fuse), ``false``
    on a mixed graph (it cannot run here without fusing)."""
    if enabled is None:
        return None
    segs = segments(stored)
    kinds = sorted({s.device_type for s in segs})
    if enabled and len(kinds) < 2:
        raise UsageError(f"enable_heterogeneous_fusion: graph {stored.id} has no CPU- and GPU-placed segments to "
                         f"fuse: all its compute nodes were recorded on {kinds[0] if kinds else 'no device'}, so "
                         "every stage already runs on one device type (leave the key out or set it false)")
    if not enabled and len(kinds) > 1:
        first_change = next(s for s in segs if s.device_type != segs[0].device_type)
        raise UsageError(f"enable_heterogeneous_fusion false: graph {stored.id} mixes {' and '.join(kinds)}-placed "
                         f"segments ({len(segs)} segments; the first change is at node {first_change.first!r}); the "
                         f"executor runs each stage on one device ({device}) and does not place segments on their "
                         "recorded devices, so this graph replays only with its segments fused (set it true)")
    if assignment is not None:
        order = [n.name for n in stored.nodes]
        for s in segs:
            a, b = order.index(s.first), order.index(s.last)
            s.stages = sorted({assignment[name] for name in order[a:b + 1] if name in assignment})
    return {"enabled": enabled, "device": device, "segments": [asdict(s) for s in segs]}
