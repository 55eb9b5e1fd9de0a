"""Algorithm and bus bandwidth of each collective in a trace, by NCCL's own formulas (issue 42 item 2).

# NOTE: [Bus bandwidth]
For each communication kernel of a Kineto trace (the :class:`~graphdeck.analysis.traces.analyze.
CommRule`'s kernels, in start order), read from the kernel's args as PyTorch's profiler writes
them for NCCL (``record_param_comms`` copies them onto the kernel): ``Collective name``, ``In msg
nelems`` / ``Out msg nelems``, ``dtype``, ``Group size``, ``Process Group Name``. Then, as
nccl-tests define them (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

* ``bytes`` S = the larger of the input and output element counts × the dtype's size — the
  buffer nccl-tests calls the size: the whole buffer for all_reduce, broadcast, reduce and
  all_to_all (input = output), the gathered output for all_gather, the scattered input for
  reduce_scatter;
* ``algbw`` = S / t, t the kernel's duration (GB/s, 1 GB = 1e9 bytes as nccl-tests);
* ``busbw`` = algbw × factor, the factor per collective type with n ranks in the group:
  all_reduce 2(n−1)/n; all_gather, reduce_scatter and all_to_all (n−1)/n; broadcast, reduce,
  send, recv (and SendRecv) 1. busbw is comparable with the link's peak whatever the collective.

A kernel without its size (an older profiler, a non-NCCL library) or whose group size is unknown
(no ``Group size`` and no ``distributedInfo.pg_config`` entry for its group) has ``algbw`` /
``busbw`` None and a ``reason``; a collective type with no formula (barrier, gather, scatter,
an unknown name) has ``busbw`` None. ``link_share`` = busbw / the link peak given by the caller
(``?link_gbps=``, or the ``GRAPHDECK_LINK_GBPS`` setting), None without one: graphdeck assumes no
peak for any device. Per (group, step) the **slowest** collective is the longest kernel (the
time the step spent in it; ``slowest: true`` on its row), shown with its busbw; ``lowest_busbw``
names the one furthest from the hardware, which is often a tiny, latency-bound message.

Pure: reads the trace, returns data.
"""

from __future__ import annotations

import re

from graphdeck.analysis.traces.analyze import CommRule, TraceData

#: dtype names in the profiler's args → bytes per element.
DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
               "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "char": 1, "int8": 1,
               "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
               "float8_e5m2fnuz": 1, "complexfloat": 8, "complexdouble": 16, "uint16": 2, "uint32": 4, "uint64": 8}

_RING1, _ONE = "(n-1)/n", "1"
#: Collective type → (canonical name, formula). Keys are the lowercase name without ``_``.
_TYPES = {
    "allreduce": ("all_reduce", "2(n-1)/n"), "allreducecoalesced": ("all_reduce", "2(n-1)/n"),
    "allgather": ("all_gather", _RING1), "allgatherbase": ("all_gather", _RING1),
    "allgatherintotensorcoalesced": ("all_gather", _RING1), "allgathercoalesced": ("all_gather", _RING1),
    "reducescatter": ("reduce_scatter", _RING1), "reducescatterbase": ("reduce_scatter", _RING1),
    "reducescattertensorcoalesced": ("reduce_scatter", _RING1),
    "alltoall": ("all_to_all", _RING1), "alltoallbase": ("all_to_all", _RING1),
    "broadcast": ("broadcast", _ONE), "reduce": ("reduce", _ONE), "send": ("send", _ONE), "recv": ("recv", _ONE),
    "sendrecv": ("send_recv", _ONE),
}
_KERNEL = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)


def collective_type(name: str | None, kernel: str = "") -> tuple[str, str | None]:
    """``(canonical type, busbw formula)`` of a collective named ``name`` (the profiler's
    ``Collective name``: ``allreduce``, ``_allgather_base``, ``all_to_all`` …), else of the NCCL
    kernel name (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``). The formula is None for a type
    nccl-tests gives none (barrier, gather, scatter, unknown)."""
    for text in (name, (_KERNEL.search(kernel or "") or [None, None])[1]):
        if isinstance(text, str) and text:
            key = text.lower().replace("_", "").replace(" ", "")
            if key in _TYPES:
                return _TYPES[key]
            return key, None
    return "?", None


def bus_factor(formula: str | None, n: int | None) -> float | None:
    """The busbw / algbw factor of ``formula`` for a group of ``n`` ranks (None when unknown)."""
    if formula is None or not n or n < 1:
        return None
    return {"2(n-1)/n": 2 * (n - 1) / n, _RING1: (n - 1) / n, _ONE: 1.0}[formula]


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def dtype_bytes(dtype) -> int | None:
    """Bytes per element of a profiler dtype name (``Float``, ``BFloat16``, ``c10::Half``,
    ``float``); None when unknown."""
    if not isinstance(dtype, str):
        return None
    return DTYPE_BYTES.get(dtype.lower().replace("torch.", "").replace("c10::", "").replace(" ", ""))


def message_bytes(args: dict) -> int | None:
    """The bytes a collective moves, as nccl-tests size it (NOTE: [Bus bandwidth]): the larger of
    ``In msg nelems`` / ``Out msg nelems`` × the ``dtype``'s size; for a CPU-side op (gloo) without
    them, its first input's element count (``Input Dims``) × its ``Input type``. None when unknown."""
    elems = [x for x in (_int(args.get("In msg nelems")), _int(args.get("Out msg nelems"))) if x is not None]
    width = dtype_bytes(args.get("dtype"))
    if elems and width:
        return max(elems) * width
    dims, types = args.get("Input Dims"), args.get("Input type")
    first = dims[0] if isinstance(dims, list) and dims and isinstance(dims[0], list) else None
    if first and all(_int(d) is not None for d in first) and isinstance(types, list) and types:
        width = dtype_bytes(types[0])
        if width:
            n = 1
            for d in first:
                n *= d
            return n * width
    return None


def collective_bandwidth(data: TraceData, meta: dict | None = None, *, rule: CommRule | None = None,
                         link_gbps: float | None = None) -> dict:
    """Per communication kernel of ``data`` its bandwidth (NOTE: [Bus bandwidth]).

    ``meta``: the trace's meta (``distributedInfo`` for group sizes, ``deviceProperties`` for the
    device's name). ``link_gbps``: the link's peak in GB/s, or None.
    Returns ``{"collectives": [{"index", "step", "group", "type", "name", "kernel", "group_size",
    "dtype", "bytes", "dur_ns", "algbw_gbps", "busbw_gbps", "formula", "link_share", "reason",
    "slowest"}], "by_group_step": [{"group", "step", "count", "bytes", "dur_ns", "slowest": index,
    "slowest_type", "slowest_dur_ns", "slowest_bytes", "slowest_busbw_gbps", "lowest_busbw": index,
    "min_busbw_gbps", "max_busbw_gbps"}], "device", "link_gbps", "formulas", "reason"}``;
    ``reason`` (top level) says why the list is empty."""
    from graphdeck.analysis.traces.collectives import _step_spans, process_groups

    rule = rule or CommRule()
    meta = meta or {}
    sizes = {g["name"]: (g.get("size") or (len(g["ranks"]) if g.get("ranks") else None))
             for g in process_groups(meta)["groups"] if g.get("name") is not None}
    props = meta.get("deviceProperties") if isinstance(meta.get("deviceProperties"), list) else []
    device = next((p.get("name") for p in props if isinstance(p, dict) and p.get("name")), None)
    steps = _step_spans(data)
    rows: list[dict] = []
    for k in sorted((k for k in data.kernels if rule.is_comm(k.name)), key=lambda e: (e.ts, e.id)):
        args = k.args_dict()
        ctype, formula = collective_type(args.get("Collective name"), k.name)
        group = args.get("Process Group Name")
        group = str(group) if group is not None else "?"
        n = _int(args.get("Group size")) or sizes.get(group)
        dtype = args.get("dtype")
        elems = [x for x in (_int(args.get("In msg nelems")), _int(args.get("Out msg nelems"))) if x is not None]
        nbytes = max(elems) * dtype_bytes(dtype) if elems and dtype_bytes(dtype) else None
        launch = data.launch_ts(k)
        row = {"index": len(rows), "step": next((num for s, e, num in steps if s <= launch < e), None),
               "group": group, "type": ctype, "name": args.get("Collective name"), "kernel": k.name,
               "start_ns": k.ts, "group_size": n, "dtype": dtype, "bytes": nbytes, "dur_ns": k.dur,
               "algbw_gbps": None, "busbw_gbps": None, "formula": formula, "link_share": None, "reason": None,
               "slowest": False}
        if nbytes is None:
            row["reason"] = ("no message size on the kernel (In/Out msg nelems)" if not elems
                             else f"unknown dtype {dtype!r}")
        elif not k.dur or k.dur <= 0:
            row["reason"] = "zero-length kernel"
        else:
            row["algbw_gbps"] = nbytes / k.dur  # bytes per ns = GB/s
            factor = bus_factor(formula, n)
            if factor is not None:
                row["busbw_gbps"] = row["algbw_gbps"] * factor
                if link_gbps:
                    row["link_share"] = row["busbw_gbps"] / link_gbps
            else:
                row["reason"] = (f"no bus-bandwidth formula for {ctype!r}" if formula is None
                                 else "group size unknown (no Group size arg and no pg_config entry)")
        rows.append(row)
    per: dict[tuple, list[dict]] = {}
    for r in rows:
        per.setdefault((r["group"], r["step"]), []).append(r)
    groups = []
    for (group, step), rs in sorted(per.items(), key=lambda kv: (kv[0][0], kv[0][1] is None, kv[0][1] or 0)):
        rated = [r for r in rs if r["busbw_gbps"] is not None]
        slow = max(rs, key=lambda r: (r["dur_ns"], -r["index"]))
        slow["slowest"] = True
        low = min(rated, key=lambda r: r["busbw_gbps"], default=None)
        bus = [r["busbw_gbps"] for r in rs if r["busbw_gbps"] is not None]
        groups.append({"group": group, "step": step, "count": len(rs), "bytes": sum(r["bytes"] or 0 for r in rs),
                       "dur_ns": sum(r["dur_ns"] for r in rs), "slowest": slow["index"],
                       "slowest_type": slow["type"], "slowest_dur_ns": slow["dur_ns"], "slowest_bytes": slow["bytes"],
                       "slowest_busbw_gbps": slow["busbw_gbps"], "lowest_busbw": low["index"] if low else None,
                       "min_busbw_gbps": min(bus) if bus else None, "max_busbw_gbps": max(bus) if bus else None})
    return {"collectives": rows, "by_group_step": groups, "device": device, "link_gbps": link_gbps,
            "formulas": {"all_reduce": "2(n-1)/n", "all_gather": _RING1, "reduce_scatter": _RING1,
                         "all_to_all": _RING1, "broadcast": _ONE, "reduce": _ONE, "send": _ONE, "recv": _ONE},
            "reason": None if rows else "no communication kernel in this trace (bus bandwidth is read from "
                                        "NCCL kernels' args; CPU-side gloo collectives carry no transfer time)"}
