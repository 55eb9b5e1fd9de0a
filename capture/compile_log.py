"""torch's structured compile records (what TORCH_TRACE writes), kept by the capture agent as
they are logged: which records, how long a payload may be, and the logging handler that keeps them
(used by :class:`graphdeck.capture.agent.Agent`)."""

from __future__ import annotations

import logging
from typing import Any

#: Structured compile records (torch's TORCH_TRACE records) kept in ``compile_events``.
KEPT_COMPILE_EVENTS = {"compilation_metrics", "bwd_compilation_metrics", "compilation_metrics_runtime",
                       "bwd_compilation_metrics_runtime", "dynamo_graph_break_reason", "recompile_reasons",
                       "dynamo_start", "optimize_ddp_split_graph",
                       "inductor_provenance_tracking_node_mappings",
                       "inductor_provenance_tracking_kernel_stack_traces",
                       # the wrapper code, kept as OUTPUT_CODE_RECORD (below)
                       "inductor_output_code"}
#: Inductor's wrapper code as the live agent keeps it: read by the memory models (a snapshot
#: attributed to nodes, NOTE: [Inductor buffer model]) but not by the kernel mapping, which has
#: the live table snapshots instead; the output-code table (NOTE: [Kernels by output code]) is
#: for imported logs, and it has no C++ kernels (their calls carry no source-node comment).
OUTPUT_CODE_RECORD = "graphdeck_output_code"
PAYLOAD_LIMIT_CHARS = 200_000
#: Records kept whole: kernel -> node links are read from them (graphdeck.analysis.traces.trace_map).
UNCUT_PAYLOADS = ("inductor_provenance_tracking_node_mappings",
                  # a warm FX-graph cache's backward maps by them (NOTE: [Kernels by stack trace]); cumulative
                  # per process, 309k chars by the demo's third bucket, so a cut one was unreadable JSON
                  "inductor_provenance_tracking_kernel_stack_traces",
                  "inductor_output_code")  # cut code parses as a different program


class _CompileEventHandler(logging.Handler):
    """Keeps torch's structured compile records (the ones TORCH_TRACE writes) for the store."""

    def __init__(self, sink: list[dict], on_record=None):
        super().__init__(level=logging.DEBUG)
        self.sink = sink
        self.on_record = on_record  # called after each kept record (the agent writes it at once)

    def emit(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "metadata", None)
        if not isinstance(meta, dict):
            return
        name = next((k for k in meta if k in KEPT_COMPILE_EVENTS), None)
        if name is None and isinstance(meta.get("artifact"), dict):
            name = meta["artifact"].get("name")
            if name not in KEPT_COMPILE_EVENTS:
                return
        if name is None:
            return
        if isinstance(meta.get("dynamo_start"), dict):  # frames name their file by an interned id
            meta = {**meta, "dynamo_start": {**meta["dynamo_start"],
                                             "stack": _resolve_filenames(meta["dynamo_start"].get("stack"))}}
        cid = None
        if "frame_id" in meta:
            cid = f"{meta.get('frame_id')}/{meta.get('frame_compile_id')}"
        payload = getattr(record, "payload", None)
        if name == "inductor_provenance_tracking_kernel_stack_traces":  # + the kernel -> node table
            from graphdeck.capture.provenance import kernel_post_grad_nodes

            extra = kernel_post_grad_nodes()
            if extra is not None:
                self.sink.append({"name": "graphdeck_kernel_post_grad_nodes", "compile_id": cid, "metadata": meta,
                                  "payload": extra})
        if isinstance(payload, str) and len(payload) > PAYLOAD_LIMIT_CHARS and name not in UNCUT_PAYLOADS:
            payload = payload[:PAYLOAD_LIMIT_CHARS] + f"…[total_len={len(payload)}]"
        if name == "inductor_output_code":
            name = OUTPUT_CODE_RECORD
        self.sink.append({"name": name, "compile_id": cid, "metadata": meta, "payload": payload})
        if self.on_record is not None:
            self.on_record()


def _resolve_filenames(stack: Any) -> Any:
    """Stack frames with ``"filename": <id>`` replaced by the path: torch interns file names
    (``torch._logging.structured.intern_string``) and logs each once as a ``str`` record, which
    this handler does not keep (and never sees when the name was interned before it listened)."""
    if not isinstance(stack, list):
        return stack
    from torch._logging.structured import INTERN_TABLE

    names = {i: s for s, i in INTERN_TABLE.items()}
    return [{**f, "filename": names.get(f["filename"], f["filename"])}
            if isinstance(f, dict) and isinstance(f.get("filename"), int) else f for f in stack]
