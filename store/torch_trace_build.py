"""One TORCH_TRACE log (one rank's process) → store rows: graphs, nodes, edges, parameter
bindings, DDP partitions, compile events and kernel → node links.

Used by :mod:`graphdeck.store.torch_trace` (the public entry); see its docstring for the whole
mapping. Rows go in through a :class:`~graphdeck.store.torch_trace_rows.RowWriter` (``sqlite3`` or
a SQLAlchemy connection) in transactions the caller commits in batches, so memory stays bounded
by one compile's graphs, not the file.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field

from graphdeck.store.fx_text import (
    TextGraph,
    fqn_from_placeholder,
    fqn_from_source,
    grad_of,
    input_ref,
    module_paths,
    parse_fx_text,
    placeholder_key,
)
from graphdeck.store.torch_trace_log import Record
from graphdeck.store.torch_trace_rows import RowWriter

#: Record kinds (envelope keys) whose payload is an FX graph, and the graph kind each becomes.
GRAPH_KINDS = {
    "dynamo_output_graph": "dynamo",
    "optimize_ddp_split_child": "ddp_partition",
    "aot_joint_graph": "aot_joint",
    "aot_forward_graph": "aot_forward",
    "aot_backward_graph": "aot_backward",
    "aot_inference_graph": "aot_inference",
    "inductor_pre_grad_graph": "inductor_pre_grad",
    "inductor_post_grad_graph": "inductor_post_grad",
    "compiled_autograd_graph": "compiled_autograd",
    "exported_program": "export",
}
#: Artifacts (``{"artifact": {"name": ...}}``) that are graphs too.
GRAPH_ARTIFACTS = {"after_pre_grad_graph": "inductor_pre_grad", "inductor_post_grad_graph": "inductor_post_grad",
                   "after_post_grad_graph": "inductor_post_grad"}
#: Every record kind this importer knows; artifacts are known by kind whatever their name.
KNOWN_KINDS = frozenset(GRAPH_KINDS) | {
    "artifact", "chromium_event", "describe_storage", "describe_tensor", "describe_source", "dynamo_start",
    "dynamo_guards", "dynamo_cpp_guards_str", "compilation_metrics", "bwd_compilation_metrics",
    "compilation_metrics_runtime", "inductor_output_code", "optimize_ddp_split_graph", "graph_dump",
    "exported_program", "guard_added", "guard_added_fast", "expression_created", "create_unbacked_symbol",
    "propagate_real_tensors_provenance", "symbolic_shape_specialization", "missing_fake_kernel",
    "mismatched_fake_kernel", "dump_file", "link", "unbacked_symbol_unwind", "str", "stack",
    "aot_autograd_backward_compilation_metrics", "compiled_autograd_graph_compile", "graph_break",
    "create_symbol", "dynamo_side_effects", "guard_on_data_dependent_error", "propagate_real_tensors",
    "inductor_input_graph", "export",
}
#: Kinds consumed while reading (not stored as events).
CONSUMED_KINDS = frozenset({"chromium_event", "describe_storage", "describe_tensor", "describe_source"})
PAYLOAD_LIMIT_CHARS = 1_000_000
_FLAT_INPUT_RE = re.compile(r"^(?:primals_(\d+)|arg(\d+)_1)$")
GRAPH_CACHE_ENTRIES = 64
GRAPH_CACHE_NODES = 100_000
FULL_COMPILES = 64
MAX_TENSOR_DESCS = 100_000
NODE_COLS = ("graph_id", "idx", "name", "op", "target_id", "args_json", "shape_json", "dtype", "stride_json", "device",
             "size_bytes", "module_path_id", "module_stack_json", "stack_trace_id", "seq_nr", "partitioner_tag", "desc",
             "param_fqn", "meta_json")
EDGE_COLS = ("graph_id", "src_idx", "dst_idx", "arg_pos", "size_bytes")
IO_COLS = ("graph_id", "direction", "position", "node_name", "param_fqn", "has_grad", "desc")
EVENT_COLS = ("run_id", "rank", "name", "compile_id", "metadata_json", "payload")
KERNEL_COLS = ("run_id", "rank", "compile_id", "graph_id", "kernel_name", "node_name", "pre_grad_node", "source",
               "call_index")


class GraphCache:
    """Parsed graphs and their ready node/edge rows, keyed by the payload's md5 (the envelope's
    ``has_payload``), shared by the files of one import. Ranks and recompiles repeat the same
    printed graphs; each is parsed and encoded once. Bounded: least recently used entries go
    once the cache holds more than ``GRAPH_CACHE_ENTRIES`` entries or ``GRAPH_CACHE_NODES`` nodes,
    so memory stays flat in the number and size of graphs."""

    def __init__(self) -> None:
        from collections import OrderedDict

        self._items: OrderedDict = OrderedDict()
        self._nodes = 0
        self.hits = 0

    def get(self, key):
        got = self._items.get(key)
        if got is not None:
            self._items.move_to_end(key)
            self.hits += 1
            return got[0]
        return None

    def put(self, key, value, nodes: int) -> None:
        if key in self._items:
            return
        self._items[key] = (value, nodes)
        self._nodes += nodes
        while self._items and (len(self._items) > GRAPH_CACHE_ENTRIES or self._nodes > GRAPH_CACHE_NODES):
            _, (_, n) = self._items.popitem(last=False)
            self._nodes -= n


def profiler_name(kernel: str) -> str:
    """A provenance kernel key (handle removed) as the profiler names the call, the convention of
    ``graphdeck.analysis.traces.mapping.trace_call_name``: ``extern_kernels.mm`` → ``aten::mm``,
    ``torch.ops.aten.X.default`` → ``aten::X``; Triton/C++ kernels keep their own name."""
    if kernel.startswith("extern_kernels."):
        return "aten::" + kernel[len("extern_kernels."):]
    if kernel.startswith("torch.ops.aten."):
        return "aten::" + kernel[len("torch.ops.aten."):].split(".", 1)[0]
    return kernel


def _cap(text: str | None) -> str | None:
    if text is None or len(text) <= PAYLOAD_LIMIT_CHARS:
        return text
    return text[:PAYLOAD_LIMIT_CHARS] + f"…[total_len={len(text)}]"


@dataclass
class _Stored:
    graph_id: int
    kind: str
    name: str
    text: TextGraph
    fqn_by_input: dict[int, str] = field(default_factory=dict)  # placeholder position -> parameter


@dataclass
class _AotGroup:
    parent: _Stored | None
    graphs: dict[str, _Stored] = field(default_factory=dict)
    post_grad: list[_Stored] = field(default_factory=list)


@dataclass
class _Compile:
    """What one compile id has produced so far on this rank."""

    frame_name: str | None = None
    dynamo: _Stored | None = None
    children: list[_Stored] = field(default_factory=list)
    groups: list[_AotGroup] = field(default_factory=list)
    last_graph: _Stored | None = None
    source_fqns: dict[str, tuple[str, str]] = field(default_factory=dict)  # placeholder key -> (fqn, kind)
    lowered: set[int] = field(default_factory=set)  # AOT graphs that already have a post-grad graph
    post_grad_md5: set[str] = field(default_factory=set)  # (newer torch logs it twice, under two names)
    output_code: str | None = None  # the latest Inductor compile's output code, until its stack traces
    linked: bool = False  # that compile's provenance mapping named its kernels
    by_dataflow: bool = False  # that compile's C++ wrapper named its kernels (NOTE: [C++ kernels by wrapper dataflow])


class FileBuilder:
    """Builds one rank's rows from the records of its log.

    ``params`` collects parameters (fqn → row fields) met in ``describe_*`` records and graph
    bindings; the caller writes them at the end. ``counts`` are this file's stored-row counters.
    """

    def __init__(self, writer: RowWriter, run_id: int, rank: int, ordinal: int = 0, cache: GraphCache | None = None):
        self.writer = writer
        self.cache = cache if cache is not None else GraphCache()
        self.run_id = run_id
        self.rank = rank
        self.ordinal = ordinal
        self.compiles: dict[str | None, _Compile] = {}
        self.tensors: dict[tuple, dict] = {}
        self.params: dict[str, dict] = {}
        self.break_reasons: dict[str, str] = {}  # "frame/compile" -> first graph-break reason
        self.counts: Counter = Counter()
        self.events: list[tuple] = []  # compile_events rows (EVENT_COLS) not written yet

    # ----------------------------------------------------------------------------------- dispatch
    def add(self, rec: Record, resolve_stack) -> None:
        ctx = self.compiles.get(rec.compile_id)
        if ctx is None:
            # a restarted attempt ("4/0_1") keeps the frame found by attempt 0's dynamo_start
            first = self.compiles.get((rec.compile_id or "").split("_")[0])
            ctx = self.compiles[rec.compile_id] = _Compile(frame_name=first.frame_name if first else None)
            self._shrink_old_compiles()
        kind, name = rec.kind, rec.name
        if kind == "describe_tensor" and isinstance(rec.body, dict):
            self.tensors[(rec.body.get("describer_id"), rec.body.get("id"))] = rec.body
            return
        if kind == "describe_source" and isinstance(rec.body, dict):
            self._source(ctx, rec.body)
            return
        if kind in CONSUMED_KINDS:
            self.counts["consumed_" + kind] += 1
            return
        graph_kind = GRAPH_KINDS.get(kind) or (GRAPH_ARTIFACTS.get(name) if kind == "artifact" else None)
        meta = {k: v for k, v in rec.envelope.items() if k not in ("has_payload",)}
        if "stack" in meta:
            meta["stack"] = resolve_stack(meta["stack"])
        if kind == "dynamo_start" and isinstance(rec.body, dict):
            stack = resolve_stack(rec.body.get("stack"))
            meta["dynamo_start"] = {**rec.body, "stack": stack}
            if stack:
                last = stack[-1]
                file = last.get("filename")  # an id left unresolved (its str record missing) is not a file name
                file = f"<file #{file}>" if isinstance(file, int) else os.path.basename(str(file))
                where = f"{file}:{last.get('line')}"
                ctx.frame_name = f"{last.get('name')} ({where})"
        graph_id = None
        if graph_kind is not None and rec.payload:
            stored = self._graph(ctx, rec, graph_kind)
            graph_id = stored.graph_id if stored else None
        meta["line"] = rec.line_no
        meta["glog_time"] = rec.glog_time
        if not rec.verified:  # kept though its md5 failed (store.torch_trace_log.LogReader)
            meta["unverified"] = "md5_mismatch"
        payload = None if graph_kind is not None else rec.payload
        if name in ("inductor_output_code", "graph_dump") or kind == "inductor_output_code" or name in (
                "inductor_provenance_tracking_node_mappings", "inductor_triton_kernel_to_post_grad_nodes",
                "inductor_provenance_tracking_kernel_stack_traces"):
            target = self._code_target(ctx)
            graph_id = target.graph_id if target else None
            if name not in ("inductor_output_code", "graph_dump") and kind != "inductor_output_code" and rec.payload:
                self._provenance(ctx, rec, target)
            elif name == "inductor_output_code" or kind == "inductor_output_code":
                ctx.output_code, ctx.linked = rec.payload, False  # until this compile's stack traces
                ctx.by_dataflow = self._by_dataflow(ctx, rec, target)
                self.counts["output_codes"] += 1
        if name == "dynamo_graph_break_reason" and rec.payload and rec.compile_id:
            self.break_reasons.setdefault(rec.compile_id.split("_")[0], rec.payload.strip())
        if kind == "compilation_metrics" and isinstance(rec.body, dict):
            self._metrics(ctx, rec.body)
        if graph_id is not None:
            meta["graph_id"] = graph_id
        self.events.append((self.run_id, self.rank, str(name)[:100], rec.compile_id, json.dumps(meta, default=str),
                            _cap(payload)))
        self.counts["compile_events"] += 1

    def _shrink_old_compiles(self) -> None:
        """Keep whole graphs only for the ``FULL_COMPILES`` latest compile ids; older ones keep
        their graphs' placeholders (what a late post-grad graph or AOT group is matched on), so
        memory does not grow with the number of compiles in a log."""
        if len(self.compiles) <= FULL_COMPILES:
            return
        for ctx in list(self.compiles.values())[:-FULL_COMPILES]:
            for stored in [ctx.dynamo, ctx.last_graph, *ctx.children,
                           *(g for grp in ctx.groups for g in [*grp.graphs.values(), *grp.post_grad])]:
                if stored is not None and stored.text.edges:
                    t = stored.text
                    stored.text = TextGraph(nodes=t.placeholders(), edges=[], outputs=t.outputs,
                                            output_descs=t.output_descs, structural_hash=t.structural_hash)
        if len(self.tensors) > MAX_TENSOR_DESCS:
            self.tensors.clear()  # describe_tensor records are read by the describe_source right after

    # ----------------------------------------------------------------------------------- sources
    def _source(self, ctx: _Compile, body: dict) -> None:
        source = body.get("source")
        if not isinstance(source, str):
            return
        t = self.tensors.get((body.get("describer_id"), body.get("id")), {})
        got = fqn_from_source(source, bool(t.get("is_parameter")))
        if got is None:
            return
        fqn, kind = got
        ctx.source_fqns[placeholder_key(source)] = got
        shape = t.get("size") if isinstance(t.get("size"), list) else None
        dtype = str(t.get("dtype") or "").removeprefix("torch.") or None
        self._param(fqn, kind, shape, dtype, bool(t.get("requires_grad", kind == "parameter")))

    def _param(self, fqn: str, kind: str, shape, dtype, requires_grad: bool) -> None:
        if fqn in self.params and self.params[fqn].get("shape") is not None:
            return
        from graphdeck.store.fx_text import _size_bytes

        numel = 1
        for d in shape or []:
            numel = numel * d if isinstance(d, int) else numel
        self.params[fqn] = {"fqn": fqn, "kind": kind, "shape": shape, "dtype": dtype or "unknown",
                            "numel": numel if shape is not None else 0,
                            "size_bytes": _size_bytes(shape, dtype) or 0,
                            "requires_grad": requires_grad and kind == "parameter"}

    def _fqn_of(self, ctx: _Compile, node_name: str, target: str | None = None) -> tuple[str, str] | None:
        for key in (node_name, target):
            if key and (got := ctx.source_fqns.get(placeholder_key(key))):
                return got
        return fqn_from_placeholder(node_name) or (fqn_from_placeholder(target) if target else None)

    # ----------------------------------------------------------------------------------- graphs
    def _graph(self, ctx: _Compile, rec: Record, kind: str) -> _Stored | None:
        md5 = rec.envelope.get("has_payload")
        # a hostile envelope may hold any JSON there; an unverified payload is not the md5's text
        md5 = md5 if isinstance(md5, str) and rec.verified else None
        if kind == "inductor_post_grad" and md5:
            if md5 in ctx.post_grad_md5:
                self.counts["duplicate_post_grad"] += 1
                return None
            ctx.post_grad_md5.add(md5)
        text = self.cache.get(("text", md5)) if md5 else None
        if text is None:
            text = parse_fx_text(rec.payload)
            if md5:
                self.cache.put(("text", md5), text, len(text.nodes))
        self.counts["bad_statements"] += text.bad_statements
        if not text.nodes:
            self.counts["empty_graphs"] += 1
            return None
        cid = rec.compile_id
        parent, part_idx, bind, io = None, None, {}, []
        label = f"graph {cid}" if cid else "graph"
        if kind in ("dynamo", "ddp_partition"):
            for pos, n in enumerate(text.placeholders()):
                got = self._fqn_of(ctx, n.name, n.target)
                if got is None:
                    continue
                bind[n.name] = got[0]
                self._param(got[0], got[1], n.shape, n.dtype, got[1] == "parameter")
                io.append(("in", pos, n.name, got[0], None, None))
        if kind == "dynamo":
            if ctx.frame_name and "resume_in" in ctx.frame_name:
                label += " (after graph break)"
            name = label
            if cid and cid.startswith("!") and "/" in cid:  # Dynamo's trace of a compiled-autograd graph
                ca = self.compiles.get(cid.split("/")[0])
                parent = ca.last_graph if ca is not None else None
        elif kind == "ddp_partition":
            parent = ctx.dynamo
            body = rec.body if isinstance(rec.body, dict) else {}
            sub = str(body.get("name", f"submod_{len(ctx.children)}"))
            part_idx = int(sub.rsplit("_", 1)[-1]) if sub.rsplit("_", 1)[-1].isdigit() else len(ctx.children)
            name = f"{label} · DDP bucket {part_idx}"
        elif kind.startswith("aot_"):
            group = self._aot_group(ctx, kind, text)
            parent = group.parent
            base = parent.name if parent else label
            name = f"{base} · {kind.removeprefix('aot_')}"
            bind, io = self._aot_bindings(kind, text, parent)
        elif kind == "inductor_post_grad":
            parent = self._post_grad_parent(ctx, text)
            name = f"{parent.name if parent else label} · post-grad"
        else:  # pre-grad: of the DDP bucket with the same inputs, else of the Dynamo graph
            sig = [n.name for n in text.placeholders()]
            parent = next((c for c in ctx.children if [n.name for n in c.text.placeholders()] == sig), ctx.dynamo)
            name = f"{parent.name if parent else label} · {kind.replace('_', ' ')}"
        stored = self._write_graph(kind, name, cid, ctx.frame_name, parent, part_idx, text, bind, io, rec)
        if kind == "dynamo":
            ctx.dynamo = stored
        elif kind == "ddp_partition":
            ctx.children.append(stored)
            self._partition(ctx, stored, part_idx, bind)
        elif kind.startswith("aot_"):
            ctx.groups[-1].graphs[kind] = stored
        elif kind == "inductor_post_grad":
            for g in ctx.groups:
                if parent is not None and parent in g.graphs.values():
                    g.post_grad.append(stored)
        ctx.last_graph = stored
        stored.fqn_by_input = {pos: bind[n.name] for pos, n in enumerate(text.placeholders()) if n.name in bind}
        return stored

    def _write_graph(self, kind, name, cid, frame_name, parent, part_idx, text: TextGraph, bind, io, rec) -> _Stored:
        w = self.writer
        owner = {fqn: "/".join(fqn.split(".")[:-1]) or None for fqn in bind.values()}
        break_reason = self.break_reasons.get((cid or "").split("_")[0]) if kind == "dynamo" else None
        graph_id = w.insert("graphs", dict(
            run_id=self.run_id, rank=self.rank, ordinal=self.ordinal, kind=kind, name=name[:300], compile_id=cid,
            frame_name=(frame_name or "")[:300] or None, parent_id=parent.graph_id if parent else None,
            partition_index=part_idx, num_nodes=len(text.nodes), structural_hash=text.structural_hash,
            backend="torch_trace", break_reason=break_reason, code=rec.payload,
            meta_json=json.dumps({"source": "torch_trace", "record": rec.name, "line": rec.line_no,
                                  "bad_statements": text.bad_statements,
                                  **({} if rec.verified else {"unverified": "md5_mismatch"})}),
        ))
        self.ordinal += 1
        md5 = rec.envelope.get("has_payload")
        md5 = md5 if isinstance(md5, str) and rec.verified else None
        key = ("rows", md5, tuple(sorted(bind.items())), tuple(sorted((x[2] or "", x[3] or "") for x in io)))
        cached = self.cache.get(key) if md5 else None
        if cached is None:
            seeds = {name: owner[fqn] for name, fqn in bind.items() if owner.get(fqn)}
            for d, _, value, fqn, _, _ in io:  # a backward output is the gradient of its parameter
                if d == "grad" and value and fqn and "." in fqn:
                    seeds.setdefault(value, "/".join(fqn.split(".")[:-1]))
            paths = module_paths(text, seeds)
            w.intern_many(x for n in text.nodes for x in (n.target, paths.get(n.name), n.stack_trace))  # batched
            nodes = [(n.idx, n.name[:300], n.op, w.intern(n.target),
                      json.dumps({"args": n.args, "kwargs": n.kwargs}, default=str),
                      None if n.shape is None else json.dumps(n.shape), n.dtype,
                      None if n.stride is None else json.dumps(n.stride), n.device, n.size_bytes,
                      w.intern(paths.get(n.name)), None,
                      w.intern(n.stack_trace), None, None, n.desc, bind.get(n.name),
                      '{"module_path": "inferred"}' if n.name in paths and n.name not in bind else "{}")
                     for n in text.nodes]
            edges = [(e.src_idx, e.dst_idx, e.arg_pos, e.size_bytes) for e in text.edges]
            cached = (nodes, edges)
            if md5:
                self.cache.put(key, cached, len(text.nodes))
        w.insert_many("nodes", NODE_COLS, [(graph_id, *r) for r in cached[0]])
        w.insert_many("edges", EDGE_COLS, [(graph_id, *r) for r in cached[1]])
        w.insert_many("graph_io", IO_COLS, [(graph_id, *r) for r in io])
        self.counts["graphs"] += 1
        self.counts["graphs_" + kind] += 1
        self.counts["nodes"] += len(text.nodes)
        self.counts["edges"] += len(text.edges)
        self.counts["graph_io"] += len(io)
        return _Stored(graph_id=graph_id, kind=kind, name=name, text=text)

    def _partition(self, ctx: _Compile, stored: _Stored, idx: int | None, bind: dict[str, str]) -> None:
        params = list(dict.fromkeys(bind.values()))
        size = sum(self.params.get(p, {}).get("size_bytes", 0) for p in params)
        self.writer.insert("partitions", dict(
            run_id=self.run_id, rank=self.rank, kind="ddp_bucket",
            parent_graph_id=ctx.dynamo.graph_id if ctx.dynamo else None, graph_id=stored.graph_id,
            index=idx if idx is not None else len(ctx.children), size_bytes=size, params_json=json.dumps(params)))
        self.counts["partitions"] += 1

    # NOTE: [AOT graph to DDP bucket] With DDPOptimizer every bucket's sub-graph is compiled under
    # the same compile id, one after the other: joint, forward, backward of submod_0, then of
    # submod_1, ... (the backward's post-grad graph may come much later, when backward first runs).
    # A new group starts at each joint (or forward/inference without a joint before it); group k
    # belongs to the first bucket sub-graph not yet taken whose input count matches, else to the
    # Dynamo graph itself.
    def _aot_group(self, ctx: _Compile, kind: str, text: TextGraph) -> _AotGroup:
        current = ctx.groups[-1] if ctx.groups else None
        starts = (kind in ("aot_joint_graph", "aot_joint", "aot_inference")
                  or current is None or kind in current.graphs
                  or (kind == "aot_forward" and "aot_forward" in current.graphs))
        if not starts and current is not None:
            return current
        n_inputs = sum(1 for n in text.placeholders() if isinstance(input_ref(n.desc), int))
        taken = {id(g.parent) for g in ctx.groups}
        free = [c for c in ctx.children if id(c) not in taken]
        parent = next((c for c in free if len(c.text.placeholders()) == n_inputs), free[0] if free else ctx.dynamo)
        group = _AotGroup(parent=parent)
        ctx.groups.append(group)
        return group

    # NOTE: [AOT graphs without descriptors] Logs of torch before 2.8 print no descriptor comments.
    # AOTAutograd then names the flattened inputs ``primals_<k+1>`` (training) or ``arg<k>_1``
    # (inference) for the Dynamo graph's k-th input, and the backward returns one gradient per
    # primal, in order; bindings fall back to that convention when no descriptor is printed.
    def _aot_bindings(self, kind: str, text: TextGraph, parent: _Stored | None):
        fqn_by_input = parent.fqn_by_input if parent else {}
        bind, io = {}, []
        for pos, n in enumerate(text.placeholders()):
            ref = input_ref(n.desc)
            if ref is None and n.desc is None:
                m = _FLAT_INPUT_RE.match(n.name)
                ref = (int(m.group(1)) - 1 if m.group(1) else int(m.group(2))) if m else None
            fqn = ref if isinstance(ref, str) else fqn_by_input.get(ref) if ref is not None else None
            if fqn:
                bind[n.name] = fqn
                io.append(("in", pos, n.name, fqn, None, n.desc))
        if kind == "aot_backward":
            no_descs = parent is not None and not any(text.output_descs) and \
                len(text.outputs) == len(parent.text.placeholders())
            for pos, (value, desc) in enumerate(zip(text.outputs, text.output_descs)):
                of = grad_of(desc)
                if of is None and not no_descs:
                    continue
                ref = input_ref(of) if of is not None else pos
                fqn = ref if isinstance(ref, str) else fqn_by_input.get(ref) if ref is not None else None
                if of is None and fqn is None:
                    continue
                io.append(("grad", pos, value, fqn, value is not None, desc))
        return bind, io

    def _post_grad_parent(self, ctx: _Compile, text: TextGraph) -> _Stored | None:
        """The AOT graph a post-grad graph was lowered from: the latest one without a post-grad
        graph yet whose placeholders have the same names and shapes, else the latest AOT graph."""
        sig = [(n.name, n.shape) for n in text.placeholders()]
        candidates = [g for grp in ctx.groups for k, g in grp.graphs.items() if k != "aot_joint"]
        open_ = [g for g in candidates if g.graph_id not in ctx.lowered]
        match = [g for g in open_ if [(n.name, n.shape) for n in g.text.placeholders()] == sig]
        parent = match[-1] if match else open_[0] if open_ else candidates[-1] if candidates else ctx.dynamo
        if parent is not None:
            ctx.lowered.add(parent.graph_id)
        return parent

    def _code_target(self, ctx: _Compile) -> _Stored | None:
        """The graph Inductor's output code (and its provenance) belongs to: the latest post-grad
        graph of this compile, else its latest AOT graph, else the Dynamo graph."""
        return ctx.last_graph if ctx.last_graph is not None else ctx.dynamo

    # ----------------------------------------------------------------------------------- provenance
    # NOTE: [Inductor provenance formats] v1 (torch 2.7/2.8): artifacts
    # ``inductor_triton_kernel_to_post_grad_nodes`` ({kernel: [post-grad node]}) and
    # ``inductor_post_to_pre_grad_nodes``; v2: one ``inductor_provenance_tracking_node_mappings``
    # artifact {"preToPost", "postToPre", "cppCodeToPost" (kernel → post-grad nodes; in debug-handle
    # logs the key is "kernel:handle"), "postToCppCode", "version"}. Kernel names are as the
    # profiler shows them (``cpp_fused_mul_relu_0``, ``triton_poi_fused_add_0``).
    def _provenance(self, ctx: _Compile, rec: Record, target: _Stored | None) -> None:
        try:
            data = json.loads(rec.payload)
        except ValueError:
            self.counts["bad_provenance_json"] += 1
            return
        if not isinstance(data, dict):
            return
        if rec.name == "inductor_provenance_tracking_kernel_stack_traces":
            self._by_output_code(ctx, rec, target, data)
            return
        if ctx.by_dataflow:  # the wrapper's dataflow named this compile's kernels already
            return
        if rec.name == "inductor_provenance_tracking_node_mappings":
            kernels = data.get("cppCodeToPost") or data.get("tritonCodeToPost") or {}
            post_to_pre = data.get("postToPre") or {}
            source = "inductor_provenance_v2"
        elif rec.name == "inductor_triton_kernel_to_post_grad_nodes":
            kernels, post_to_pre, source = data, {}, "inductor_provenance_v1"
        else:
            return
        ctx.linked = ctx.linked or bool(kernels)
        self._kernel_rows(rec.compile_id, target, kernels, post_to_pre, source)

    def _by_dataflow(self, ctx: _Compile, rec: Record, target: _Stored | None) -> bool:
        """Link a C++ wrapper's kernel calls to the post-grad graph it was made from by the
        wrapper's dataflow (NOTE: [C++ kernels by wrapper dataflow] in
        analysis/traces/cpp_wrapper_links.py); works on plain logs (no provenance artifacts).
        True when it linked some call (the compile's provenance records are then not used)."""
        if not rec.payload or target is None or target.kind != "inductor_post_grad":
            return False
        from graphdeck.analysis.traces.cpp_wrapper_links import cpp_wrapper_links

        links = cpp_wrapper_links(rec.payload, target.text.nodes, target.text.outputs)
        if not links:
            return False
        ctx.output_code, ctx.linked = None, True
        self.counts["kernel_calls_by_dataflow"] += len(links)
        self._kernel_rows(rec.compile_id, target, dict(links), {}, "inductor_outcode_dataflow")
        return True

    def _by_output_code(self, ctx: _Compile, rec: Record, target: _Stored | None, stacks: dict) -> None:
        """A compile whose provenance mapping named no kernel (a lazily compiled backward: torch 2.13
        logs ``{"version": 2.0}``): its kernels from the output code's source-node comments and, for
        C++ kernels (no comment), their stack traces against the post-grad graph (NOTE: [C++ kernels
        by output code] in analysis/traces/kernel_source_nodes.py)."""
        code, ctx.output_code = ctx.output_code, None
        if ctx.linked or not code or target is None:
            return
        from graphdeck.analysis.traces.kernel_source_nodes import output_code_with_stacks, resolve_marked

        table = output_code_with_stacks(code, stacks)
        nodes = [(n.name, n.stack_trace, n.target) for n in target.text.nodes if n.op == "call_function"]
        fresh, _ = resolve_marked([(k, tuple(v)) for k, v in table.items()], nodes)
        self._kernel_rows(rec.compile_id, target, {k: list(v) for k, v in fresh}, {}, "inductor_provenance_v2_outcode")

    def _kernel_rows(self, compile_id, target: _Stored | None, kernels: dict, post_to_pre: dict, source: str) -> None:
        rows = []
        for kernel, nodes in kernels.items():
            base, _, handle = str(kernel).rpartition(":")
            if not base or not handle.isdigit():
                base, handle = str(kernel), ""
            kname = profiler_name(base)
            for node in nodes if isinstance(nodes, list) else []:
                pre = post_to_pre.get(node)
                pre_name = pre[0] if isinstance(pre, list) and pre and isinstance(pre[0], str) else None
                if pre_name is None and isinstance(pre, list) and pre and isinstance(pre[0], dict):
                    pre_name = pre[0].get("name")
                # call_index: the kernel call's debug handle (``cpp_fused_add_0:3`` -> 3)
                rows.append((self.run_id, self.rank, compile_id, target.graph_id if target else None, kname[:500],
                             str(node)[:300], pre_name, source, int(handle) if handle else None))
        if rows:
            self.writer.insert_many("kernel_nodes", KERNEL_COLS, rows)
            self.counts["kernel_nodes"] += len(rows)

    # ----------------------------------------------------------------------------------- metrics
    def _metrics(self, ctx: _Compile, body: dict) -> None:
        t = body.get("entire_frame_compile_time_s")
        if ctx.dynamo is not None and isinstance(t, (int, float)):
            self.writer.update("graphs", ctx.dynamo.graph_id, {"compile_time_s": float(t)})

    def flush_events(self) -> None:
        self.writer.insert_many("compile_events", EVENT_COLS, self.events)
        self.events = []
