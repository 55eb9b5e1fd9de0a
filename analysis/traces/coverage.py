"""Trace coverage: one number that says what it covers, and the time outside it named apart.

# NOTE: [Trace coverage]
A trace's *coverage* is the share of the work compiled graphs run that lands on FX nodes:

* CPU trace (no GPU kernel; NOTE: [CPU trace mapping]): the ops' own CPU time inside compiled
  regions — the summed duration of the units (ATen ops of an ``aot_eager`` range, C++ kernels and
  extern calls of an Inductor wrapper call, AOT's runtime-wrapper ops) — of which ``covered_ns`` is
  the units matched to a node. The wall time between and around the ops (Python dispatch, wrapper
  code, the profiler's own callbacks, and on a loaded host the thread's descheduling, which a trace
  cannot tell apart) is ``overhead_ns``, said apart and never in the fraction: a busy host stretches
  it by any amount, so a fraction over wall time moved with the load (a small unmatched op after a
  long preemption counted the preemption as unmapped). The matching itself is by structure (nesting on one
  thread, op names, call order, autograd sequence numbers), never by how far apart events are.
* GPU trace: the kernel time of compiled graphs — kernels launched inside an Inductor wrapper
  call, plus the share of communication kernels that carries graph parameters (NOTE:
  [Collectives to graph nodes]) — of which ``covered_ns`` is on FX nodes.

Time outside compiled graphs *by design* never counts against coverage; it is named apart in
``outside`` (kind → ns): ``eager optimizer step`` (kernels under ``Optimizer.step#…``, NOTE:
[Optimizer step kernels]; on CPU the step's range), ``communication and DDP hooks`` (collectives
no graph parameter explains, gloo/c10d ranges), ``data loading`` (``enumerate(DataLoader)…``),
``other eager code`` (kernels or top-level ops outside any compiled region). On a CPU trace these
are the top-level ranges of the profiled steps outside compiled regions, their compiled parts taken
out. ``coverage`` is ``None`` when there is nothing compiled to cover.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

#: What the fraction covers, per device (said in every headline that shows it).
COVERS = {"cpu": "the ops' own CPU time in compiled regions",
          "gpu": "the GPU kernel time of compiled graphs"}
OPTIMIZER, COMM, DATA, EAGER = ("eager optimizer step", "communication and DDP hooks", "data loading",
                                "other eager code")
_COMM_MARKS = ("gloo:", "nccl:", "c10d::", "record_param_comms", "DistributedDataParallel", "ddp.reducer", "FSDP::",
               "ncclDevKernel",
               "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "broadcast")


@dataclass
class Coverage:
    """``fraction`` = ``covered_ns`` / ``total_ns`` (None when ``total_ns`` is 0); ``covers``: what
    ``total_ns`` is (:data:`COVERS`); ``device`` ``cpu`` | ``gpu``; ``outside``: kind → ns of time
    outside compiled graphs by design (not in ``total_ns``); ``overhead_ns``: CPU wall time between
    and around the ops of compiled regions (not in ``total_ns``; 0 on GPU); ``unmapped``: name →
    ns of the uncovered part of ``total_ns``, largest first. All times int ns."""

    device: str
    covered_ns: int
    total_ns: int
    outside: dict[str, int] = field(default_factory=dict)
    overhead_ns: int = 0
    unmapped: dict[str, int] = field(default_factory=dict)

    @property
    def covers(self) -> str:
        return COVERS[self.device]

    @property
    def fraction(self) -> float | None:
        return self.covered_ns / self.total_ns if self.total_ns else None

    def as_dict(self) -> dict:
        return {"device": self.device, "covers": self.covers, "fraction": self.fraction,
                "covered_ns": self.covered_ns, "total_ns": self.total_ns, "outside_ns": dict(self.outside),
                "overhead_ns": self.overhead_ns}


def comm_kind(name: str) -> bool:
    low = name.lower()
    return any(m.lower() in low for m in _COMM_MARKS)


def outside_kind(name: str) -> str:
    """The kind of a kernel or top-level range outside compiled graphs, by its name."""
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return OPTIMIZER
    if "DataLoader" in name:
        return DATA
    if comm_kind(name):
        return COMM
    return EAGER


def coverage(mapping, events=None) -> Coverage:
    """The :class:`Coverage` of a :class:`graphdeck.analysis.traces.mapping.KernelMapping`
    (NOTE: [Trace coverage]). ``events``: the trace's events, for a CPU trace's time outside
    compiled regions (omitted: ``outside`` is empty on CPU)."""
    if mapping.device == "cpu":
        dirs = mapping.directions.values()
        total = sum(d.get("units_ns", 0) for d in dirs)
        covered = sum(d.get("mapped_units_ns", 0) for d in dirs)
        unmapped = dict(mapping.unmapped)
        return Coverage("cpu", covered, total, cpu_outside(events) if events is not None else {},
                        max(0, mapping.region_ns - total), unmapped)
    outside: Counter = Counter()
    for ns in mapping.optimizer_ns.values():
        outside[OPTIMIZER] += ns
    from graphdeck.analysis.traces.analyze import CommRule

    rule = CommRule()
    for name, ns in mapping.outside_unmapped.items():
        outside[COMM if rule.is_comm(name) else outside_kind(name)] += ns
    covered = sum(mapping.node_ns.values())
    unmapped = {n: ns - mapping.outside_unmapped.get(n, 0) for n, ns in mapping.unmapped.items()}
    unmapped = dict(sorted(((n, ns) for n, ns in unmapped.items() if ns > 0), key=lambda kv: -kv[1]))
    return Coverage("gpu", covered, covered + sum(unmapped.values()), dict(outside), 0, unmapped)


def cpu_outside(events) -> dict[str, int]:
    """Kind → ns of a CPU trace's host time outside compiled regions: each top-level range of a
    thread (directly under ``ProfilerStep#N`` when there is one) that is no compiled region, its
    exclusive time once the compiled regions nested in it are taken out, by :func:`outside_kind`."""
    from graphdeck.analysis.traces.cpu_mapping import BWD, FWD, HOST_CATS, _parents

    parent = _parents(events)
    compiled = (FWD, BWD)

    def is_compiled(e) -> bool:
        return e.name in compiled or e.name.startswith("Torch-Compiled Region")

    tops = []
    inner: Counter = Counter()
    for e in events:
        if e.cat not in HOST_CATS or e.name.startswith("ProfilerStep#"):
            continue
        chain = []
        p = parent.get(e.id)
        while p is not None:
            chain.append(p)
            p = parent.get(p.id)
        above = [a for a in chain if not a.name.startswith("ProfilerStep#")]
        if any(is_compiled(a) for a in above):
            continue
        if not above:
            if not is_compiled(e):
                tops.append(e)
        elif is_compiled(e):  # a compiled region inside a top-level range: not that range's own time
            inner[above[-1].id] += e.dur
    out: dict[str, int] = defaultdict(int)
    for e in tops:
        ns = max(0, e.dur - inner.get(e.id, 0))
        if ns:
            out[outside_kind(e.name)] += ns
    return dict(out)
