"""Graph-derived memory of an Inductor run, from the buffers its generated code allocates and frees.

# NOTE: [Inductor buffer model]
The ATen-graph model (:mod:`graphdeck.analysis.memory.core`) gives every node output a storage, but
Inductor fuses most of them away and reuses buffers, so under Inductor it over-counts
(+17–33% on GPT-2). The wrapper Inductor writes (the ``inductor_output_code`` record; format read
from ``torch/_inductor/codegen/wrapper.py``, not copied) says exactly what the compiled graph holds:
in ``def call(...)``, the inputs are unpacked from ``args`` (their sizes in the
``assert_size_stride(name, size, stride)`` lines, their dtypes in ``get_args()``'s
``rand_strided(size, stride, device=..., dtype=...)``); ``bufN = empty_strided_<dev>(size,
stride, dtype)`` allocates; ``bufA = bufB; del bufB  # reuse`` hands a buffer on without a new
allocation; ``reinterpret_tensor(bufB, ...)`` is a view of ``bufB``'s storage; ``del X`` drops a
name (a storage is freed when no name holds it); ``return (...)`` keeps its buffers alive, every
other local dies. Bytes are storage extents (``1 + Σ (size_i − 1)·stride_i`` elements × itemsize);
symbolic sizes are not counted (``unknown`` says how many).

A step (:func:`inductor_step_memory`) runs the run's forward calls in the order their code was
recorded, then their backward calls (code with ``tangents_*`` inputs) in reverse. Live bytes start
at the parameters (forward inputs bound to a parameter, ``graph_io``) plus ``extra_bytes`` (e.g.
the optimizer's state, which no graph holds). A forward's inputs stay held by their owners (the
module, the caller); its returned buffers (outputs and saved activations) join the live total. A
backward frees, at its ``del``, each input not bound to a parameter (AOTAutograd clears the saved
tensors before calling it, so the ``del`` is the last reference); its returned buffers (the
gradients) stay live. The peak is the maximum of the running total over every call. Not modelled:
the allocator's rounding and caching, kernel workspaces, eager code between the calls (the
optimizer's own temporaries), graphs of several steps interleaved.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from graphdeck.analysis.memory.core import ITEMSIZE
from graphdeck.analysis.memory.measured import CODE_RECORDS

_INPUTS = re.compile(r"^\s*(.+?)\s*=\s*args\s*$")
_ASSERT = re.compile(r"^\s*assert_size_stride\((\w+),\s*\(([^()]*)\),\s*\(([^()]*)\)")
_RAND = re.compile(r"^\s*(\w+)\s*=\s*rand_strided\(\(([^()]*)\),\s*\(([^()]*)\),.*dtype=torch\.(\w+)")
_EMPTY = re.compile(r"^\s*(\w+)\s*=\s*empty_strided(?:_\w+)?\(\(([^()]*)\),\s*\(([^()]*)\),\s*torch\.(\w+)")
_ALIAS = re.compile(r"^\s*(\w+)\s*=\s*(\w+)\s*(?:;|$)")
_VIEW = re.compile(r"^\s*(\w+)\s*=\s*reinterpret_tensor\((\w+),")
_DEL = re.compile(r"^\s*del (\w+)")
_RETURN = re.compile(r"^\s*return \((.*)\)\s*$")


def _ints(text: str) -> list[int] | None:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return [int(p) for p in parts] if all(p.lstrip("-").isdigit() for p in parts) else None


def _top_level(text: str) -> list[str]:
    """``text`` split at its commas outside brackets, items stripped, empty ones dropped."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return [x for x in out if x]


def _base(item: str) -> str:
    """A returned item's buffer name: ``reinterpret_tensor(buf3, ...)`` → ``buf3``."""
    m = re.match(r"reinterpret_tensor\((\w+),", item)
    return m.group(1) if m else item


def _extent_bytes(size: str, stride: str, dtype: str) -> int | None:
    """Storage bytes of a strided tensor; ``None`` for symbolic sizes or an unknown dtype."""
    sz, st = _ints(size), _ints(stride)
    if sz is None or st is None or dtype not in ITEMSIZE:
        return None
    if any(s == 0 for s in sz):
        return 0
    return (1 + sum((s - 1) * t for s, t in zip(sz, st))) * ITEMSIZE[dtype]


@dataclass
class CallMemory:
    """One compiled graph's ``call()``: ``inputs`` (name → bytes), ``peak_bytes`` (the most its
    own allocations, net of the inputs it freed, add to what was live before it), ``returned_bytes``
    (buffers alive after it), ``freed`` (input names it ``del``s, in order), ``allocations``,
    ``reuses`` and ``unknown`` (allocations of symbolic size, not counted)."""

    inputs: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[str, str, int]] = field(default_factory=list)  # (op, name, bytes)
    returned_bytes: int = 0
    returns: list[tuple[str, int | None, int]] = field(default_factory=list)  # (name, storage id | None, bytes)
    allocations: int = 0
    reuses: int = 0
    unknown: int = 0
    backward: bool = False

    def run(self, owned: dict[str, tuple[object, int]]) -> tuple[int, int]:
        """(highest net bytes during the call, net bytes after it). ``owned``: input name →
        (storage key, bytes) of the inputs whose ``del`` releases memory; a storage several
        inputs share is released with the last of them."""
        left: dict[object, int] = {}
        for key, _ in owned.values():
            left[key] = left.get(key, 0) + 1
        net = peak = freed = 0
        for op, name, size in self.timeline:
            if op == "free_input":
                if name in owned:
                    key, size = owned[name]
                    left[key] -= 1
                    if left[key] == 0:
                        net -= size
                        freed += size
                continue
            net += size if op == "alloc" else -size
            peak = max(peak, net)
        return peak, self.returned_bytes - freed


def call_memory(code: str) -> CallMemory:
    """Parse one ``inductor_output_code`` payload (NOTE: [Inductor buffer model]); a code
    without ``def call(`` gives an empty :class:`CallMemory`. Never raises on odd text."""
    out = CallMemory()
    start = code.find("def call(")
    if start < 0:
        return out
    dtypes = {m.group(1): m.group(4) for ln in code.splitlines() if (m := _RAND.match(ln))}
    storage_of: dict[str, int] = {}  # name -> storage id
    size_of: dict[int, int] = {}  # storage id -> bytes
    holders: dict[int, int] = {}  # storage id -> names holding it
    input_of: dict[int, str] = {}  # storage id -> the input it came in as
    next_id = 0
    for line in code[start:].splitlines()[1:]:
        if line.startswith(("def ", "class ", "runner", "call =")) or line.strip().startswith("def "):
            break
        if (m := _INPUTS.match(line)) and not out.inputs:
            names = [_base(n) for n in _top_level(m.group(1))]
            out.inputs = {n: 0 for n in names}
            out.backward = any(n.startswith("tangents_") for n in names)
        elif (m := _ASSERT.match(line)) and m.group(1) in out.inputs:
            name = m.group(1)
            out.inputs[name] = _extent_bytes(m.group(2), m.group(3), dtypes.get(name, "")) or 0
            if name not in storage_of:  # an input's storage: a "# reuse" can hand it to a buffer
                storage_of[name], size_of[next_id], holders[next_id], input_of[next_id] = next_id, out.inputs[name], 1, name
                next_id += 1
        elif m := _EMPTY.match(line):
            size = _extent_bytes(m.group(2), m.group(3), m.group(4))
            out.allocations += 1
            if size is None:
                out.unknown += 1
                size = 0
            storage_of[m.group(1)], size_of[next_id], holders[next_id] = next_id, size, 1
            next_id += 1
            out.timeline.append(("alloc", m.group(1), size))
        elif (m := _VIEW.match(line)) or (m := _ALIAS.match(line)):
            new, old = m.group(1), m.group(2)
            if old in storage_of and new not in storage_of:
                sid = storage_of[new] = storage_of[old]
                holders[sid] += 1
                out.reuses += "# reuse" in line
        if line.strip().startswith("del ") or "; del " in line:
            for name in re.findall(r"\bdel (\w+)", line):
                if name in storage_of:
                    sid = storage_of.pop(name)
                    holders[sid] -= 1
                    if holders[sid] == 0 and sid in input_of:
                        out.timeline.append(("free_input", input_of[sid], size_of[sid]))
                    elif holders[sid] == 0:
                        out.timeline.append(("free", name, size_of[sid]))
                elif name in out.inputs:
                    out.timeline.append(("free_input", name, out.inputs[name]))
        elif m := _RETURN.match(line):
            names = [_base(n) for n in _top_level(m.group(1))]
            for n in names:
                sid = storage_of.get(n)
                if sid is not None and sid in input_of:  # an input handed back: held by its owner
                    out.returns.append((input_of[sid], None, size_of[sid]))
                else:
                    out.returns.append((n, sid, size_of[sid] if sid is not None else out.inputs.get(n, 0)))
            out.returned_bytes = sum(size_of[s] for s in {storage_of[n] for n in names if n in storage_of}
                                     if s not in input_of)
            break
    return out


@dataclass
class InductorStep:
    """:func:`inductor_step_memory`'s answer: ``peak_bytes`` (parameters and ``extra_bytes``
    included), ``peak_call`` (index into ``calls``), ``parameter_bytes``, ``extra_bytes``, and
    per call in run order ``{"graph_id", "compile_id", "backward", "peak_bytes", "after_bytes"}``."""

    peak_bytes: int
    peak_call: int | None
    parameter_bytes: int
    extra_bytes: int
    calls: list[dict]


def inductor_step_memory(engine, run_id: int, rank: int = 0, *, extra_bytes: int = 0) -> InductorStep | None:
    """One training step of run ``run_id`` (rank ``rank``) modelled from its Inductor output code
    (NOTE: [Inductor buffer model]); ``None`` when the run has no output code with a ``call()``."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.store.schema import CompileEvent, Graph, GraphIO

    with Session(engine) as s:
        codes = s.execute(select(CompileEvent.compile_id, CompileEvent.metadata_json, CompileEvent.payload)
                          .where(CompileEvent.run_id == run_id, CompileEvent.rank == rank,
                                 CompileEvent.name.in_(CODE_RECORDS)).order_by(CompileEvent.id)).all()
        params: dict[str | None, set[str]] = {}
        for cid, name in s.execute(select(Graph.compile_id, GraphIO.node_name).join(Graph, Graph.id == GraphIO.graph_id)
                                   .where(Graph.run_id == run_id, Graph.rank == rank, GraphIO.direction == "in",
                                          GraphIO.param_fqn.is_not(None))):
            params.setdefault(cid, set()).add(name)
    fwd, bwd = [], []
    for cid, meta, payload in codes:
        call = call_memory(payload or "")
        if not call.inputs:
            continue
        try:
            gid = json.loads(meta or "{}").get("graph_id")
        except ValueError:
            gid = None
        (bwd if call.backward else fwd).append((gid, cid, call))
    if not fwd and not bwd:
        return None
    held = {cid: params.get(cid, set()) for _, cid, _ in fwd + bwd}
    param_bytes = sum(size for _, cid, c in fwd for n, size in c.inputs.items() if n in held[cid])
    order = {cid: i for i, (_, cid, _) in enumerate(fwd)}
    fw_of = {cid: call for _, cid, call in fwd}
    bwd.sort(key=lambda b: -order.get(b[1], -1))  # backwards run in reverse of their forwards
    live = param_bytes + extra_bytes
    peak, peak_call, calls = live, None, []
    for i, (gid, cid, call) in enumerate(fwd + bwd):
        owned = _owned(call, fw_of.get(cid), held[cid]) if call.backward else {}
        during, after = call.run(owned)
        if live + during > peak:
            peak, peak_call = live + during, i
        calls.append({"graph_id": gid, "compile_id": cid, "backward": call.backward, "peak_bytes": live + during,
                      "after_bytes": live + after, "allocations": call.allocations, "reuses": call.reuses,
                      "unknown": call.unknown})
        live += after
    return InductorStep(peak, peak_call, param_bytes, extra_bytes, calls)


def _owned(bw: CallMemory, fw: CallMemory | None, params: set[str]) -> dict[str, tuple[object, int]]:
    """A backward's inputs whose ``del`` frees memory: its saved inputs match the forward's last
    returns in order (AOTAutograd: outputs, then saved tensors); one forward storage is one key.
    A saved forward input that is a parameter stays held; tangents and other inputs are owned."""
    names = list(bw.inputs)
    saved = [n for n in names if not n.startswith("tangents_")]
    tail = fw.returns[len(fw.returns) - len(saved):] if fw is not None and len(fw.returns) >= len(saved) else []
    out: dict[str, tuple[object, int]] = {}
    for j, n in enumerate(names):
        if n in params:
            continue
        if j < len(saved) and tail:
            ret_name, sid, size = tail[j]
            if sid is None and ret_name in params:
                continue  # a parameter the forward passed through
            out[n] = (("fw", sid) if sid is not None else ("in", ret_name), size if sid is not None else bw.inputs[n])
        else:
            out[n] = (("bw", n), bw.inputs[n])
    return out
