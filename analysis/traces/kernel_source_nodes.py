"""Kernel → node tables read from Inductor's output code, and the low-coverage warning.

# NOTE: [Kernels by output code]
Some torch versions (2.11 seen on an H200) write an empty provenance mapping
(``inductor_provenance_tracking_node_mappings`` = ``{"version": 2.0}``) for a lazily compiled
backward graph, while its ``inductor_output_code`` still carries, before every kernel call in
the wrapper's ``call()``, a comment ``# Topologically Sorted Source Nodes: [n1, n2, ...],
Original ATen: [...]`` (the post-grad nodes the call computes; ``""`` where a node has no name,
e.g. a matmul a post-grad pattern made) and, in recent versions, ``# [Provenance debug handles]
<kernel>:<handle>``. :func:`output_code_table` turns those comments into the same
``"<kernel>:<handle>" → [post-grad node, ...]`` table as the provenance artifact's
``cppCodeToPost``, so :func:`graphdeck.analysis.traces.mapping.link_kernels` maps such graphs'
kernels by node name (rows tagged ``inductor_provenance_v2_outcode``) instead of by the
coarser kernel stack traces. The comment names a node by its origin: a backward's nodes have the
AOT backward graph's names (> 95% found there on the H200 log), a forward's mostly the Dynamo
graph's (``position_ids``), which is why the table is used only where the mapping is empty. Format source: the generated wrapper code Inductor writes
(``torch/_inductor/codegen/wrapper.py`` emits the comments; read, not copied).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

_SOURCE = re.compile(r"^\s*# Topologically Sorted Source Nodes: \[(.*?)\](?:, Original ATen:|\s*$)")
_HANDLE = re.compile(r"^\s*# \[Provenance debug handles\] (\S+:\d+)\s*$")
# A kernel call in the wrapper: a Triton launch, an extern kernel, an ATen fallback, or a C++
# kernel (``cpp_fused_relu_0(buf0, ...)``, a name the module defines with ``async_compile.cpp*``).
_CALL = re.compile(r"^\s*(?:\w+ = )?(?:(\w+)\.run\(|(extern_kernels\.\w+)\(|(torch\.ops\.aten\.\w+\.\w+)\(|(\w+)\()")
_CPP_DEF = re.compile(r"^(\w+) = async_compile\.cpp(?:_pybinding)?\(", re.M)
#: A kernel definition's ``# Source node to ATen node mapping:`` entry (``#   add => add_3, add_4``),
#: and the line that defines the kernel after it (``triton_poi_fused_mm_0 = async_compile.triton(``).
_MAPPING = re.compile(r"^#\s+(.*?)\s*=>\s*(\S.*?)\s*$")
_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(")
#: A generated kernel's name: ``cpp_fused_div_expand_sum_0``, ``triton_poi_fused_add_0`` → the fused ops.
_FUSED = re.compile(r"^(?:cpp|triton_\w+?)_fused_(\w+?)_\d+$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
#: Marks a table value that is a kernel's stack traces, not node names (NOTE: [C++ kernels by output code]).
STACK_MARK = "\x00stack:"
UNNAMED = "(unnamed)"
MATMUL_CALLS = ("extern_kernels.mm", "extern_kernels.addmm", "extern_kernels.bmm")


def output_code_table(code: str) -> dict[str, list[str]]:
    """``"<kernel>:<handle>" → [post-grad node names]`` for each kernel call in the wrapper's
    ``call()`` of one ``inductor_output_code`` payload (Python wrapper text), in call order.

    Handles come from ``# [Provenance debug handles]`` comments where present, else count the
    calls from 1 (the order Inductor numbers them). A call's nodes are those of the nearest
    ``Topologically Sorted Source Nodes`` comment above it since the previous call; unnamed
    entries become ``"(unnamed)"`` (listed first for an extern matmul call, so the matmul
    fallback of ``link_kernels`` resolves it), or the post-grad nodes the kernel's definition
    names under no source node where it names some (NOTE: [Nodes a post-grad pass made]). Calls with no comment are left out. Returns ``{}``
    for code without a ``def call(`` or without such comments; never raises on odd text."""
    return {k: v for k, v in _calls(code) if v is not None}


def _calls(code: str) -> list[tuple[str, list[str] | None]]:
    """``("<kernel>:<handle>", nodes or None)`` for each kernel call of the wrapper's ``call()``."""
    start = code.find("def call(")
    if start < 0:
        return []
    cpp = set(_CPP_DEF.findall(code, 0, start))
    made = _pass_made_nodes(code[:start])
    table: list[tuple[str, list[str] | None]] = []
    nodes: list[str] | None = None
    handle: str | None = None
    counter = 0
    for line in code[start:].splitlines()[1:]:
        if line.startswith(("def ", "class ", "if __name__")):
            break
        m = _SOURCE.match(line)
        if m:
            nodes = [n.strip() or UNNAMED for n in m.group(1).split(",")] if m.group(1).strip() else [UNNAMED]
            continue
        m = _HANDLE.match(line)
        if m:
            handle = m.group(1)
            continue
        m = _CALL.match(line)
        if not m:
            continue
        name = m.group(1) or m.group(2) or m.group(3) or m.group(4)
        if name == "get_raw_stream" or (m.group(4) and name not in cpp):
            continue
        counter += 1
        key = handle if handle and handle.rpartition(":")[0] == name else f"{name}:{counter}"
        if nodes is not None and name in MATMUL_CALLS and UNNAMED in nodes:
            nodes = [UNNAMED] + [n for n in nodes if n != UNNAMED]
        elif nodes is not None and UNNAMED in nodes and made.get(name):  # NOTE: [Nodes a post-grad pass made]
            nodes = [n for n in nodes if n != UNNAMED] + [n for n in made[name] if n not in nodes]
        table.append((key, nodes))
        nodes, handle = None, None
    return table


def _pass_made_nodes(defs: str) -> dict[str, list[str]]:
    """Kernel name → the post-grad nodes its definition's ``# Source node to ATen node mapping:``
    lists under no source node (``#    => constant_pad_nd_default_1``), for the module text
    before ``def call(``.

    # NOTE: [Nodes a post-grad pass made]
    A node a post-grad pattern made (``pad_mm``'s ``constant_pad_nd_default_1`` padding an mm's
    operand) has no source node: the call's comment says ``Source Nodes: []``, which named no
    node (``(unnamed)``, a name no graph has, so the kernel went unmapped while the live capture,
    whose provenance mapping names the post-grad node, maps it). The kernel's definition names
    the post-grad node it computes; :func:`_calls` takes it, and ``link_kernels`` keeps such a
    name where the compile's post-grad graph has that node."""
    out: dict[str, list[str]] = {}
    made: list[str] = []
    for line in defs.splitlines():
        m = _MAPPING.match(line)
        if m:
            if not m.group(1):
                made += [n.strip() for n in m.group(2).split(",") if n.strip()]
            continue
        m = _DEF.match(line)
        if m:
            if made:
                out[m.group(1)] = made
            made = []
        elif line.startswith("# kernel path:"):
            made = []
    return out


def output_code_with_stacks(code: str, stacks: dict) -> dict[str, list[str]]:
    """:func:`output_code_table` plus, for each kernel call with no source-node comment (Inductor
    writes none before a C++ kernel's call), the call's entry of the compile's
    ``inductor_provenance_tracking_kernel_stack_traces`` (``stacks``: ``"<kernel>:<handle>" →
    [stack trace, ...]``) as ``STACK_MARK + trace`` values, for :func:`nodes_by_stacks` to resolve
    against the graph the table goes to.

    # NOTE: [C++ kernels by output code]
    A C++ (CPU Inductor) wrapper calls ``cpp_fused_div_expand_sum_0(tangents_1, buf0, ...)`` with
    only a ``# [Provenance debug handles]`` comment above it; the ops it fuses are in its name and
    the post-grad nodes' source lines in the stack-traces artifact. A lazily compiled backward's
    provenance mapping is empty (torch 2.13 CPU), so these two are what names its nodes."""
    table = {}
    for key, nodes in _calls(code):
        if nodes is not None:
            table[key] = nodes
        elif isinstance(stacks.get(key), list) and stacks[key]:
            table[key] = [STACK_MARK + str(t) for t in stacks[key]]
    return table


def _frames(trace: str) -> tuple:
    """``((file, line), ...)`` of a stack trace: carets and code text left out (a printed graph's
    ``# File:`` comments have no carets, the kernel stack-traces artifact has)."""
    return tuple(_FRAME.findall(trace))


def _op_of(target: str) -> str:
    """``aten.sum.dim_IntList`` → ``sum``; ``torch.ops.aten.relu.default`` → ``relu``."""
    parts = target.removeprefix("torch.ops.").split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims", "quantized_decomposed") else parts[-1]


#: Ops a generated kernel does not compute (views, and matmuls: extern calls on CPU and GPU alike).
_NOT_FUSED = {"view", "reshape", "permute", "t", "transpose", "unsqueeze", "squeeze", "mm", "addmm", "bmm",
              "_unsafe_view", "alias"}


def nodes_by_stacks(kernel: str, traces: list[str], nodes: list[tuple[str, str | None, str]],
                    taken: set[str]) -> tuple[list[str], bool]:
    """The nodes (``(name, stack_trace, target)``, graph order) a generated kernel computes, from
    its stack traces, and whether its name confirmed them: call_function nodes whose frames are
    among ``traces``' and whose op is one the kernel's name fuses (``cpp_fused_div_expand_sum_0``:
    div, expand, sum), else (a post-grad decomposition renamed the op: ``threshold_backward`` is a
    ``where``) the nodes of those lines that are no view or matmul. Nodes in ``taken`` (claimed by
    another call) only when nothing else is left. ``([], False)`` when no frame matches."""
    want = {_frames(t) for t in traces} - {()}
    same = [(n, _op_of(t or "")) for n, st, t in nodes if st and _frames(st) in want]
    m = _FUSED.match(kernel)
    fused = f"_{m.group(1)}_" if m else ""
    ops = [n for n, op in same if f"_{op}_" in fused]
    picked = ops or [n for n, op in same if op not in _NOT_FUSED]
    return [n for n in picked if n not in taken] or picked, bool(ops)


def resolve_marked(fresh: list[tuple[str, tuple[str, ...]]], nodes: list[tuple[str, str | None, str]]):
    """``(entries, score)``: ``fresh`` (``[(key, node names)]`` of one table) with each
    ``STACK_MARK`` entry resolved by :func:`nodes_by_stacks` against ``nodes`` (one graph's
    ``(name, stack_trace, target)``) — first the calls whose name confirms their nodes, then the
    others, nodes named by other entries counted as taken; entries that resolve to nothing are
    left out. ``score``: 2 per call confirmed by its name, 1 per other call resolved (which graph
    of a compile id a table is for)."""
    taken = {n for _, ns in fresh for n in ns if not n.startswith(STACK_MARK)}
    got: dict[str, tuple[str, ...]] = {}
    score = 0
    for confirmed in (True, False):
        for key, ns in fresh:
            if key in got or not ns or not ns[0].startswith(STACK_MARK):
                continue
            names, exact = nodes_by_stacks(key.rpartition(":")[0] or key, [x[len(STACK_MARK):] for x in ns],
                                           nodes, taken)
            if names and exact == confirmed:
                got[key] = tuple(names)
                taken.update(names)
                score += 2 if exact else 1
    out = [(k, got[k] if ns and ns[0].startswith(STACK_MARK) else ns) for k, ns in fresh
           if not (ns and ns[0].startswith(STACK_MARK)) or k in got]
    return out, score


#: The provenance records a kernel table is read from (``compile_events.name``).
TABLE_EVENTS = ("graphdeck_kernel_post_grad_nodes", "inductor_provenance_tracking_node_mappings")
STACKS_EVENT = "inductor_provenance_tracking_kernel_stack_traces"
OUTPUT_CODE_EVENT = "inductor_output_code"


#: The order in which one Inductor compile's records arrive (NOTE: [One table per compile]).
_RECORD_ORDER = {OUTPUT_CODE_EVENT: 0, TABLE_EVENTS[1]: 1, TABLE_EVENTS[0]: 2, STACKS_EVENT: 3}


def compile_tables(parsed: list, stats: Counter) -> tuple[dict, dict]:
    """``(rank, compile_id)`` → ``[(table, kind)]`` in compile order, one table per Inductor compile,
    and ``(rank, compile_id)`` → post-grad → pre-grad node names.

    # NOTE: [One table per compile]
    One compile_id can hold several Inductor compiles: DDPOptimizer compiles each bucket's forward
    and (lazily) backward under the frame's compile_id. Each compile logs, in order, its output code
    (imported logs), its provenance mapping, the agent's live-table snapshot and its kernel stack
    traces; a record whose kind is not after the previous one's starts the next compile. Per
    compile: the live-table snapshot when non-empty, else the mapping's ``cppCodeToPost``, else the
    output code's source-node comments (NOTE: [Kernels by output code]; a C++ kernel's call by
    its stack traces: NOTE: [C++ kernels by output code]), else the stack traces
    (NOTE: [Kernels by stack trace]). Chosen per compile_id instead, one bucket's snapshot hid
    the stack traces of another bucket compiled from a warm FX graph cache (empty snapshot and
    mapping): with the cache warm for some buckets only — the other rank or another job on the host
    wrote them moments before, which a busy host makes likely — their kernels mapped to nothing
    (the demo's loss bucket: 77.5% on rank 1)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    post_to_pre: dict[tuple[int, str | None], dict[str, list[str]]] = defaultdict(dict)
    for key, name, data in parsed:
        order = _RECORD_ORDER.get(name)
        if order is None:
            continue
        if name == TABLE_EVENTS[1]:
            post_to_pre[key].update(data.get("postToPre") or {})
        mine = groups[key]
        if not mine or order <= mine[-1]["_last"]:
            mine.append({})
        mine[-1][name] = data
        mine[-1]["_last"] = order
    by_key: dict[tuple[int, str | None], list[tuple[dict, str]]] = defaultdict(list)
    for key, compiles in groups.items():
        for c in compiles:
            snapshot, mapping = c.get(TABLE_EVENTS[0]) or {}, c.get(TABLE_EVENTS[1]) or {}
            if snapshot:
                by_key[key].append((snapshot, "table"))
            elif mapping.get("cppCodeToPost"):
                by_key[key].append((mapping["cppCodeToPost"], "table"))
            elif table := output_code_with_stacks((c.get(OUTPUT_CODE_EVENT) or {}).get("code") or "",
                                                  c.get(STACKS_EVENT) or {}):
                by_key[key].append((table, "output_code"))
                stats["tables_by_output_code"] += 1
            elif c.get(STACKS_EVENT):
                by_key[key].append((c[STACKS_EVENT], "stacks"))
    return by_key, post_to_pre


def coverage_warning(mapping, *, threshold: float = 0.90, top: int = 5) -> str | None:
    """A one-paragraph warning when ``mapping`` (a
    :class:`graphdeck.analysis.traces.mapping.KernelMapping`) maps less than ``threshold`` of
    what its coverage covers (NOTE: [Trace coverage]: GPU kernel time of compiled graphs, or the
    ops' own CPU time in compiled regions) to graph nodes, naming the ``top`` largest unmapped
    kernels with their share of that time; ``None`` when coverage is at or above it or there is
    nothing compiled to cover."""
    cov = mapping.coverage
    frac = cov.fraction
    if frac is None or frac >= threshold:
        return None
    grouped: dict[str, int] = {}
    for name, ns in cov.unmapped.items():
        grouped[_short(name)] = grouped.get(_short(name), 0) + ns
    worst = sorted(grouped.items(), key=lambda kv: -kv[1])[:top]
    items = "; ".join(f"{name} {ns / cov.total_ns:.1%}" for name, ns in worst)
    return (f"only {frac:.1%} of {cov.covers} maps to graph nodes (below {threshold:.0%}); "
            f"largest unmapped: {items}")


def _short(name: str, limit: int = 80) -> str:
    """A C++ template kernel name cut to its function name (namespaces dropped) and functor,
    then to ``limit`` characters."""
    if name.startswith("void "):
        name = name[5:]
    cut = name.find("<")
    if cut > 0:
        functor = re.search(r"(\w+Functor)\b", name)
        name = name[:cut].rsplit("::", 1)[-1] + (f"<{functor.group(1)}>" if functor else "")
    return name if len(name) <= limit else name[: limit - 1] + "…"
