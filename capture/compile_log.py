"""torch's structured compile records (what TORCH_TRACE writes), kept by the capture agent as
they are logged: which records, how long a payload may be, and the logging handler that keeps them
(used by :class:`graphdeck.capture.agent.Agent`)."""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
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
#: Records kept whole: kernel -> node links are read from them (graphdeck.analysis.traces.mapping).
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
        #: CPU seconds spent in :meth:`emit` (on the logging thread: the compiling thread).
        self.cpu_s = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        t0 = time.thread_time()
        try:
            self._emit(record)
        finally:
            self.cpu_s += time.thread_time() - t0

    def _emit(self, record: logging.LogRecord) -> None:
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

            extra = kernel_post_grad_nodes()  # a snapshot now; its JSON made by the store writer
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


# NOTE: [Only the kept records are built]
# torch builds a structured record (its payload: graph prints, guard dumps, repro scripts) as soon
# as *any* handler listens to its trace log (``trace_structured`` tests ``if trace_log.handlers``),
# so listening for eleven kinds made torch format all of them: on GPT-2 24 layers (H100) 2.4–3.8 s
# of every first compile, more than the agent's own work. While only graphdeck's handlers listen,
# the trace log's handler list answers that truth test with "is this one of the kept records?"
# (the record's name, and an artifact's name from its metadata) when ``trace_structured`` asks,
# and "yes" to every other caller. Nothing torch decides changes: only records nobody keeps are
# not built. A user's own listener (``TORCH_TRACE``, a test handler) makes the list plainly true,
# so such a user gets every record as before.


class _GatedHandlers(list):
    """``trace_log.handlers`` while graphdeck listens (NOTE: [Only the kept records are built])."""

    def __bool__(self) -> bool:
        if not len(self):
            return False
        if any(_listens(h) for h in self):
            return True  # someone else listens: torch logs everything, as without graphdeck
        try:
            frame = sys._getframe(1)
            if frame.f_code is not _trace_structured_code():
                return True
            names = frame.f_locals
            name = names.get("name")
            if name in KEPT_COMPILE_EVENTS:
                return True
            if name != "artifact":
                return False
            meta = names.get("metadata_fn")
            meta = meta() if callable(meta) else None  # an artifact's metadata: a small dict
            return isinstance(meta, dict) and meta.get("name") in KEPT_COMPILE_EVENTS
        except Exception:  # noqa: BLE001 - unsure: let torch build the record, as it would
            return True


def _listens(h: logging.Handler) -> bool:
    """Whether a handler other than graphdeck's takes trace records. torch's own
    ``LazyTraceHandler`` without a trace folder, outside Meta's cluster jobs, takes none: at
    its first record it removes itself (torch/_logging/_internal.py), so it is not a listener."""
    if isinstance(h, _CompileEventHandler):
        return False
    if type(h).__name__ == "LazyTraceHandler" and getattr(h, "root_dir", 0) is None \
            and getattr(h, "stream", 0) is None and not os.environ.get("MAST_HPC_JOB_NAME"):
        return False
    return True


@functools.cache
def _trace_structured_code():
    """The code object of torch's ``trace_structured`` (the frame that asks the truth test)."""
    from torch._logging import _internal

    return getattr(getattr(_internal, "trace_structured", None), "__code__", None)


def listen(handler: _CompileEventHandler) -> None:
    """Attach ``handler`` to torch's trace log, gated (NOTE: [Only the kept records are built])."""
    from torch._logging._internal import trace_log

    with _logging_lock():
        # first in the list: torch's lazy handler removes itself from the list while the list is
        # walked for its first record, which skips the handler after it (that record was lost)
        trace_log.handlers = _GatedHandlers([handler] + [h for h in trace_log.handlers if h is not handler])


def stop_listening(handler: _CompileEventHandler) -> None:
    """Detach ``handler``; the trace log gets a plain handler list back once none of ours is left."""
    from torch._logging._internal import trace_log

    trace_log.removeHandler(handler)
    with _logging_lock():
        if isinstance(trace_log.handlers, _GatedHandlers) and not any(
                isinstance(h, _CompileEventHandler) for h in trace_log.handlers):
            trace_log.handlers = list(trace_log.handlers)


def _logging_lock():
    """The module lock ``addHandler``/``removeHandler`` take (an RLock), so no handler added by
    another thread meanwhile is lost when the list is swapped."""
    import contextlib

    lock = getattr(logging, "_lock", None)
    return lock if lock is not None else contextlib.nullcontext()
