"""The capture agent: runs inside every training rank and records what torch.compile produced.

Usage (the same code on every rank; rank and world size come from torch.distributed)::

    agent = Agent(store="runs.db", run="gpt2-ddp")
    model = agent.watch(model)                       # parameter names, shapes, tied weights
    compiled = torch.compile(ddp_model, backend=agent.backend("inductor"))
    with agent.profile(active_steps=2) as prof:      # optional Kineto trace, stored per rank
        for step in range(4):
            ...; prof.step()
    agent.close()

``torch.compile(model, backend="graphdeck")`` uses a process-wide agent configured from
``GRAPHDECK_STORE`` (default ``graphdeck.db``), ``GRAPHDECK_RUN`` and ``GRAPHDECK_INNER``
(default ``inductor``).

Per Dynamo graph the backend stores: the graph (``dynamo``; with DDP, the unsplit graph plus one
``ddp_partition`` graph per bucket and a ``partitions`` row with the bucket's parameters and
bytes), the AOTAutograd forward and backward graphs (see ``aot.py``), parameter bindings
(placeholder → fully-qualified parameter name; backward output → gradient of which parameter),
compile time and graph-break reason. Capture runs at compile time only: the function returned
to Dynamo is the inner backend's, so steady-state steps pay nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from typing import Any

import torch
import torch.fx

from graphdeck.capture.aot import Handover, recording_backend, shadow_trace
from graphdeck.capture.callwrap import BindingPlan, OutputGradNote, bind_at_run_time, child_rows, watch_output_grads
from graphdeck.capture.compile_context import MODEL_FRAMES, compile_context, is_ddp, model_frames, parallel_info
from graphdeck.capture.compile_log import (  # noqa: F401 - KEPT_COMPILE_EVENTS, UNCUT_PAYLOADS: names of this module before
    KEPT_COMPILE_EVENTS,
    PAYLOAD_LIMIT_CHARS,
    UNCUT_PAYLOADS,
    _CompileEventHandler,
    listen,
    stop_listening,
)
from graphdeck.capture.compile_record import finish, graph_arg_is_param, record_dynamo
from graphdeck.capture.flight import FlightDumps
from graphdeck.capture.fxrecord import output_args
from graphdeck.capture.guards import no_new_guards, shape_env_of
from graphdeck.capture.param_names import ParamNames
from graphdeck.capture.writer import IOBinding, StoreWriter
from graphdeck.capture.agent_exit import _compiling, _dist_ready, _flush_at_exit
from graphdeck.capture.writer_thread import BackgroundWriter, Pending
from graphdeck.store.db import main_thread_section

log = logging.getLogger("graphdeck.capture")

def _dist_info() -> tuple[int, int, str | None]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), None


class Agent(ParamNames):
    """One rank's capture. ``store``: SQLite path or SQLAlchemy URL; ``run``: the run's name,
    the same on every rank (default: ``GRAPHDECK_RUN``, else torchrun's run id, else a timestamp);
    a name another launch holds gives this launch ``NAME-2`` and a notice, unless ``append``
    (NOTE: [One run per launch] in capture/launch.py).
    """

    def __new__(cls, store: str | os.PathLike | None = None, run: str | None = None, **_kw):
        """NOTE: [One agent per process and run]: an agent that records this store and run in
        this process already (and is not closed) is returned instead of a second one, which
        would hear every compile again (each compile record twice: restarts, recompiles and
        compile times double). ``__init__`` then leaves it as it is."""
        from graphdeck.capture.backend import live_agent

        same = live_agent(store, run)
        return same if same is not None and isinstance(same, cls) else super().__new__(cls)

    def __init__(self, store: str | os.PathLike | None = None, run: str | None = None, *,
                 grad_prints: str | None = None, append: bool | None = None):
        if "_handler" in self.__dict__:  # joined (NOTE: [One agent per process and run])
            return
        #: Gradient fingerprint cadence (NOTE: [Gradient fingerprints]): "FIRST,EVERY", "all" or
        #: "off"; None: ``GRAPHDECK_GRAD_PRINTS``, else "5,100".
        self.grad_prints = grad_prints
        self.store = store or os.environ.get("GRAPHDECK_STORE", "graphdeck.db")
        from graphdeck.capture.backend import default_run_name

        self.run = run or default_run_name() or time.strftime("run-%Y%m%d-%H%M%S")
        #: the name asked for (``run`` becomes ``NAME-2`` when NAME is another launch's: NOTE: [One
        #: run per launch]); ``append``: add to NAME anyway (None: ``GRAPHDECK_RUN_APPEND``)
        self.requested_run, self.append = self.run, append
        self._writer: BackgroundWriter | None = None
        self._store_failed: str | None = None  # why the store could not be opened: capture is off
        self._fqn_by_tensor: dict[int, str] = {}
        self._live_fqn: dict[int, str] = {}  # id -> fqn of the watched models' tensors right now
        self._live_names: set[str] = set()
        self._grads_observed = False
        self._models: list[torch.nn.Module] = []
        self._prefixes: dict[int, str] = {}  # id(model) -> name prefix (NOTE: [Several watched models])
        self._auto_params: dict[str, torch.Tensor] = {}  # parameters found in graphs, model not watched
        self._ddp_parents: dict[int, int] = {}  # id(unsplit gm) -> graphs.id
        self._events: list[dict] = []
        self._handler = _CompileEventHandler(self._events, self._write_records_now)
        from graphdeck.capture.comm_groups import CommGroupWatch

        self._comm = CommGroupWatch()  # DDP buckets / FSDP2 groups (NOTE: [Communication groups])
        self._comm_written: str | None = None
        from graphdeck.capture.layout import LayoutWatch

        self._layout = LayoutWatch()  # meshes, placements, pipeline (NOTE: [Capturing the parallel layout])
        listen(self._handler)  # NOTE: [Only the kept records are built]
        import atexit
        import weakref

        atexit.register(_flush_at_exit, weakref.ref(self))  # a job without close() loses nothing
        self._graph_refs: list[Pending | int] = []  # graphs written or queued (NOTE: [Writes off the compiling thread])
        #: Seconds (wall) the capture took on the compiling thread, compile by compile summed.
        self.capture_time_s = 0.0
        #: CPU seconds of the same (``time.thread_time`` of the compiling thread).
        self.capture_cpu_s = 0.0
        self._watch_info: dict = {}
        self._evidence = None  # GradEvidence, made by watch() (NOTE: [Gradient evidence])
        self._reach: dict[int, tuple] = {}  # id(unsplit gm) -> (reach map, output names)
        self._flight = FlightDumps.start(self)  # Flight Recorder on; dumped on raise/SIGTERM/exit/close
        from graphdeck.capture.heartbeat import Heartbeat

        self._heartbeat = Heartbeat.start(self)  # NOTE: [Live watch]: progress in the store, hangs caught live
        self.closed = False
        self._parity = None  # NOTE: [Parity evidence] (parity.py): only under GRAPHDECK_PARITY
        try:
            from graphdeck.capture.parity import ParityCapture

            self._parity = ParityCapture.from_env(self)
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: no parity evidence: {type(exc).__name__}: {exc}")
        from graphdeck.capture.backend import register

        register(self)

    # ----------------------------------------------------------------------------- store access
    @property
    def writer(self) -> BackgroundWriter:
        """This rank's writer (a :class:`~graphdeck.capture.writer_thread.BackgroundWriter`:
        the store is opened and written on the calling thread, or on the ``graphdeck-writer``
        thread with ``GRAPHDECK_WRITER_THREAD=1``, NOTE: [Writes off the compiling thread]), made
        on first use. A store that cannot be opened turns capture
        off for the process with one warning (NOTE: [Capture never ends a job]); every later use
        raises :class:`~graphdeck.errors.StoreError` at once, which the callers (all guarded)
        swallow."""
        if self._writer is None or self._store_failed is not None:
            from graphdeck.errors import StoreError

            if self._store_failed is not None:
                raise StoreError(self._store_failed)
            rank, world, backend = _dist_info()
            store, run, append = self.store, self.run, self.append

            def failed(why: str) -> None:  # where the store is opened (the writer thread when on)
                self._store_failed = f"cannot open store {store}: {why}"
                warnings.warn(f"graphdeck: capture is off for this process: {self._store_failed}; training "
                              "goes on without it", stacklevel=2)

            def open_writer() -> StoreWriter:  # where the store is opened (the writer thread when on)
                from graphdeck.capture.launch import append_wanted, launch_id, notify

                w = StoreWriter(store, run, rank, world, backend=backend, launch=launch_id(),
                                append=append_wanted(append))
                self.run = w.run_name  # NOTE: [One run per launch]: NAME-2 when NAME is another launch's
                notify(w.notice, rank)
                return w

            self._writer = BackgroundWriter(open_writer, rank=rank, world_size=world, on_open_error=failed)
            if not _compiling():  # outside a compile the run is claimed (its name final) when this returns
                try:
                    self._writer.wait_open()
                except Exception:  # noqa: BLE001 - warned once by failed()
                    pass
            if self._models:
                self._write_params()
        return self._writer

    @property
    def graph_ids(self) -> list[int]:
        """``graphs.id`` of every graph this agent stored, in capture order (waits for the
        queued writes; a graph whose write failed is left out)."""
        out = []
        for ref in list(self._graph_refs):
            try:
                out.append(int(ref))
            except Exception:  # noqa: BLE001 - its failure was warned about when it happened
                pass
        return out

    def flush(self) -> None:
        """Wait until every store write queued so far is made (NOTE: [Writes off the compiling
        thread]). Never raises."""
        if self._writer is not None:
            self._writer.flush()

    # ----------------------------------------------------------------------------- parameters
    def watch(self, model: torch.nn.Module) -> torch.nn.Module:
        """Record ``model``'s parameters and buffers (names as ``model.named_parameters()`` gives
        them; tied weights keep every name) and return ``model`` unchanged."""
        inner = getattr(model, "module", model) if is_ddp(model) else model
        if inner is not model:
            self._comm.note_ddp(model)
            self._layout.note_ddp(model)
        if not any(m is inner for m in self._models):  # watching a model again (e.g. wrapped) adds no names
            taken = {name for m in self._models for name, _ in self.named_tensors(m)}
            if any(name in taken for name, _ in self.named_tensors(inner)):
                # NOTE: [Several watched models]: two watched models that both hold a ``w`` would
                # share one name, so one's gradients would read as the other's. A later model whose
                # names collide with an earlier one's is named ``<Class>[k].<name>`` (k: its watch order).
                self._prefixes[id(inner)] = f"{type(inner).__name__}[{len(self._models)}]."
            self._models.append(inner)
        self._watch_info.update(parallel_info(model))
        try:
            # Under FSDP2 the evidence reads .grad at each optimizer step (NOTE: [FSDP2 evidence]).
            if os.environ.get("GRAPHDECK_GRAD_EVIDENCE", "1") == "0":
                self._watch_info["evidence_off"] = "switched off (GRAPHDECK_GRAD_EVIDENCE=0)"
            elif self._evidence is None:
                from graphdeck.capture.grad_evidence import GradEvidence

                self._evidence = GradEvidence(self)
            if self._evidence is not None:
                self._evidence.add_model(inner)
                if inner is not model:
                    self._evidence.note_ddp(model)
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: no gradient evidence: {type(exc).__name__}: {exc}")
        for fqn, t in self.named_tensors(inner, buffers=True):
            self._fqn_by_tensor.setdefault(id(t), fqn)
        if self._writer is not None or _dist_ready():
            try:
                self._write_params()
                if not _compiling():  # the store open and the parameters in it when watch() returns
                    self._writer.flush()
            except Exception as exc:  # noqa: BLE001 - capture never ends a job
                if self._store_failed is None:  # (a store that cannot be opened has warned once)
                    warnings.warn(f"graphdeck: could not record the parameters: {type(exc).__name__}: {exc}")
        self.record_layout()
        return model

    def watch_pipeline(self, obj: Any) -> Any:
        """Record a ``torch.distributed.pipelining`` schedule or stage (or a ``DeviceMesh``) in
        this rank's parallel layout now, and return it unchanged. Needed only for stages whose
        module is not compiled through this agent's backend (NOTE: [Capturing the parallel layout])."""
        try:
            self._layout.note(obj)
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: could not note {type(obj).__name__}: {type(exc).__name__}: {exc}")
        self.record_layout()
        if self._writer is not None and not _compiling():  # in the store when this returns, as documented
            self._writer.flush()
        return obj

    def record_layout(self) -> bool:
        """Write this rank's parallel layout and communication groups when they changed since
        the last write (once torch.distributed is up or the store is open). Never raises."""
        wrote = False
        if self._writer is not None or _dist_ready():
            wrote = self._layout.write(lambda: self.writer, self._models)
        self.record_comm_groups()  # FSDP2 groups as soon as known: a job that dies keeps them
        return wrote

    # ----------------------------------------------------------------------------- the backend
    def backend(self, inner: str | Any = "inductor"):
        """A ``torch.compile`` backend that records each graph, then compiles it with ``inner``
        (a registered backend name such as ``"inductor"`` or ``"aot_eager"``, or a callable)."""

        def graphdeck_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs):
            return self._compile(gm, example_inputs, inner, **kwargs)

        if inner == "inductor":  # kernel -> FX node links for traces (NOTE: [Kernel to node mapping])
            from graphdeck.capture.provenance import enable_provenance

            enable_provenance()
            from graphdeck.capture.profile import enable_cpu_kernel_profile

            enable_cpu_kernel_profile()  # C++ kernels in CPU traces (NOTE: [CPU trace mapping])

        graphdeck_backend.__name__ = f"graphdeck_{inner if isinstance(inner, str) else 'custom'}"
        return graphdeck_backend

    def _compile(self, gm, example_inputs, inner, **kwargs):
        hb = self._heartbeat  # a compile in the training forward ends the time outside the step
        if hb is not None and hb.step_open and torch.is_grad_enabled():
            hb.entered(self)  # NOTE: [Time outside the compiled step]
        inner_name = inner if isinstance(inner, str) else getattr(inner, "__name__", "custom")
        inner_fn = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner
        pending, handover, recording = None, Handover(), None
        try:  # NOTE: [Graphs from the inner compile]
            # before the capture's clock starts: its first call imports Inductor's compile_fx
            # (~1 CPU s), which a plain compile imports too, inside its compile
            recording = recording_backend(inner, inner_fn, handover) if isinstance(inner, str) else None
        except Exception:  # noqa: BLE001 - an unknown torch layout: the shadow trace instead
            recording = None
        t0, c0 = time.perf_counter(), time.thread_time()
        from graphdeck.capture.comm_groups import active_ddp
        from graphdeck.capture.grad_sites import note_compiled_autograd_config

        note_compiled_autograd_config()  # NOTE: [Evidence under compiled autograd]
        self._comm.note_ddp(active_ddp())
        self._layout.note_ddp(active_ddp())
        try:  # a pipeline stage/schedule on the stack, FSDP2/TP applied after watch()
            self._layout.note_stack()
            from torch._guards import CompileContext

            self._layout.note_autocast(compile_context(), str(CompileContext.current_compile_id() or "") or None)
            self.record_layout()
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: could not record the parallel layout: {type(exc).__name__}: {exc}")
        shape_env = shape_env_of(example_inputs)  # NOTE: [The capture adds no guard]
        try:
            with no_new_guards(shape_env):
                pending = self._record_dynamo(gm, example_inputs, inner_name, shadow=recording is None)
            pending["shape_env"] = shape_env
        except Exception as exc:  # capture never breaks training
            warnings.warn(f"graphdeck: could not record a graph: {type(exc).__name__}: {exc}")
        self.capture_time_s += time.perf_counter() - t0
        self.capture_cpu_s += time.thread_time() - c0
        t1 = time.perf_counter()
        compiled = (recording or inner_fn)(gm, example_inputs, **kwargs)
        compile_time_s = time.perf_counter() - t1
        if pending is not None and recording is not None:
            t2, c2 = time.perf_counter(), time.thread_time()
            if handover.wants_shadow():  # a cache hit: no compiler ran
                with no_new_guards(shape_env):
                    pending["aot"], pending["aot_source"] = shadow_trace(gm, example_inputs, inner=inner_name), "shadow"
            else:
                pending["aot"], pending["aot_source"], pending["handover"] = handover.graphs, "inner", handover
            self.capture_time_s += time.perf_counter() - t2
            self.capture_cpu_s += time.thread_time() - c2
        if pending is not None:
            t3, c3 = time.perf_counter(), time.thread_time()
            try:
                with no_new_guards(shape_env):
                    gid = self._finish(pending, compile_time_s)
                plan = pending.get("plan") if self._models else None
                if self._evidence is not None:  # binds and notes outputs too: one wrapper for all
                    compiled = self._observe(compiled, pending, plan, OutputGradNote(pending["gm"], gid, self))
                else:
                    compiled = watch_output_grads(compiled, pending["gm"], gid, self)
                    if plan is not None and plan.positions:
                        compiled = bind_at_run_time(compiled, plan, self)
            except Exception as exc:
                warnings.warn(f"graphdeck: could not record AOT graphs: {type(exc).__name__}: {exc}")
            self.capture_time_s += time.perf_counter() - t3
            self.capture_cpu_s += time.thread_time() - c3
        return compiled

    def _observe(self, compiled, p: dict, plan: BindingPlan | None = None, note: OutputGradNote | None = None):
        """Wrap ``compiled`` for the gradient evidence (NOTE: [Gradient evidence]) and, with
        ``plan``, the run-time parameter binding, with ``note``, the output-gradient note."""
        from graphdeck.capture.callwrap import observe_calls
        from graphdeck.capture.grad_evidence import GraphInfo, reach_of

        full = p.get("full_gm") or p["gm"]
        if id(full) not in self._reach:
            self._reach[id(full)] = reach_of(full)
        reach, full_outs = self._reach[id(full)]
        placeholders = p["placeholders"]
        positions = [i for i, n in enumerate(placeholders) if graph_arg_is_param(n) or n.name in p["param_by_node"]]
        names = [placeholders[i].name for i in positions]
        outs = [v.name if isinstance(v, torch.fx.Node) and v.name in full_outs else None for v in output_args(p["gm"])]
        info = GraphInfo(id(full), positions, names, outs, reach,
                         tuple(p["param_by_node"].get(n) for n in names))
        return observe_calls(compiled, info, self._evidence, plan, self, note)

    def _record_dynamo(self, gm, example_inputs, inner_name, shadow: bool = True) -> dict:
        return record_dynamo(self, gm, example_inputs, inner_name, shadow)

    def _finish(self, p: dict, compile_time_s: float) -> int:
        return finish(self, p, compile_time_s)

    def _observe_grads_after_backward(self) -> None:
        """Once per agent, from inside the first backward: at its end, note which watched
        parameters hold a gradient (``compile_events`` row ``graphdeck_grads_observed``, payload
        ``{"with_grad": [...], "without_grad": [...]}``).

        # NOTE: [Gradients observed at the end of the first backward]
        # Graph-mode facts cannot see a parameter that only eager code reads, e.g. under FSDP2
        # Dynamo gives up on the root forward (FSDP's pre-forward is ``disable``d) and runs it
        # eagerly. The gradient report uses this observation only for parameters no graph
        # reads on a rank where frames fell back to eager. The callback is queued on the
        # autograd engine, so it runs after callbacks queued earlier in the same backward
        # (FSDP2's final post-backward, which assigns the sharded gradients). It reads
        # ``.grad`` only: nothing is synchronised or copied.
        """
        if self._grads_observed or not self._models:
            return
        self._grads_observed = True

        def at_end() -> None:
            try:
                with_grad, without_grad = [], []
                for model in self._models:
                    for fqn, p in self.named_tensors(model):
                        if p.requires_grad:
                            (with_grad if p.grad is not None else without_grad).append(fqn)
                self.writer.write_compile_events([{
                    "name": "graphdeck_grads_observed", "compile_id": None, "metadata": {},
                    "payload": json.dumps({"with_grad": with_grad, "without_grad": without_grad})}])
            except Exception as exc:  # capture never breaks training
                warnings.warn(f"graphdeck: could not observe gradients: {type(exc).__name__}: {exc}")

        try:
            torch.autograd.Variable._execution_engine.queue_callback(at_end)
        except Exception as exc:
            warnings.warn(f"graphdeck: could not observe gradients: {type(exc).__name__}: {exc}")

    def _bind(self, plan: "BindingPlan", tensors: list) -> None:
        """Record what a compiled graph's parameter inputs are on this call, when it differs from
        every binding recorded so far (NOTE: [Run-time parameter binding])."""
        names = tuple(self._live_name(t) for t in tensors)
        if names in plan.recorded or all(n is None for n in names):
            return
        plan.recorded.add(names)
        fqn_by_input = dict(zip(plan.positions, names))
        rows = {plan.dynamo_graph_id: [IOBinding("in", pos, node, fqn_by_input[pos])
                                       for pos, node in plan.dynamo_rows if fqn_by_input.get(pos)]}
        for gid, ins, grads in plan.children:
            rows[gid] = child_rows(ins, grads, fqn_by_input)
        self.writer.add_bindings(rows)

    # ----------------------------------------------------------------------------- events, profile
    def _write_records_now(self) -> None:
        """Queue compile records for the writer as they arrive; a failed compile's metrics (it
        raises into the job next, which may die by ``os._exit``) wait until written. Never
        raises into the compile."""
        try:
            last = self._events[-1] if self._events else None
            self.flush_events()
            fields = last["metadata"].get(last["name"]) if last and isinstance(last.get("metadata"), dict) else None
            if isinstance(fields, dict) and fields.get("fail_type") and self._writer is not None:
                self._writer.flush()
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: could not write a compile record: {type(exc).__name__}: {exc}")

    def flush_events(self) -> None:
        """Write the structured compile records received so far (taken and written in one span a
        SIGTERM defers to: NOTE: [A SIGTERM during a dump])."""
        with main_thread_section():
            events, self._events[:] = list(self._events), []
            if events:
                try:
                    self.writer.write_compile_events(events)
                except (KeyboardInterrupt, SystemExit):  # the job is stopping: its exit flush writes them
                    self._events[:0] = events
                    raise

    def record_comm_groups(self) -> bool:
        """Write which parameters each DDP bucket / FSDP2 group carries (a ``graphdeck_comm_groups``
        compile record; NOTE: [Communication groups]). Called when a profile's trace is stored and
        at :meth:`close`; DDP's buckets are known only after its first iteration. A record equal
        to the last one written is not written again. Returns whether a record was written; never
        raises."""
        import json

        from graphdeck.capture.comm_groups import EVENT_NAME

        record = self._comm.record(self._models, _dist_info()[1])
        payload = json.dumps(record) if record is not None else None
        if payload is None or payload == self._comm_written:
            return False
        try:
            self.writer.write_compile_events([{"name": EVENT_NAME, "compile_id": None, "metadata": {},
                                               "payload": payload}])
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: could not record communication groups: {type(exc).__name__}: {exc}")
            return False
        self._comm_written = payload
        return True

    def profile(self, *, wait_steps: int = 1, warmup_steps: int = 1, active_steps: int = 2, name: str | None = None,
                **options):
        """A ``torch.profiler.profile`` over the chosen steps whose Kineto trace is stored for this
        rank when the active window ends (call ``.step()`` once per training step); ``options``
        go to :func:`graphdeck.capture.profile.stored_profile` (``trace_dir``) and from there to
        ``torch.profiler.profile`` (``profile_memory=True``, ``with_stack``, ``record_shapes``, ...)."""
        from graphdeck.capture.profile import stored_profile

        return stored_profile(self, wait_steps=wait_steps, warmup_steps=warmup_steps,
                              active_steps=active_steps, name=name, **options)

    def training_step(self) -> int | None:
        """The training step this rank is in now: optimizer steps taken so far (0 before the first),
        as the gradient evidence counts them, else the live watch's optimizer-step hook
        (NOTE: [Live watch]); None with neither (``GRAPHDECK_HEARTBEAT_S=0`` and no ``watch()``).
        Reads two counters: nothing torch decides changes."""
        ev = self._evidence
        if ev is not None:
            return ev._opt_steps
        hb = getattr(self, "_heartbeat", None)
        if hb is not None and hb._step_hook:
            return hb._own_steps() or 0
        return None

    def _record_model_frames(self) -> None:
        """Dynamo's rule for the watched models' forward frames (NOTE: [No graph produced])."""
        if self._models and (rows := model_frames(self._models)):
            self.writer.write_compile_events([{"name": MODEL_FRAMES, "payload": json.dumps(rows)}])

    def close(self) -> None:
        """Flush pending compile records, write the layout, process groups, gradient evidence and
        a Flight Recorder dump, and stop listening to torch's structured log.

        NOTE: [Capture never ends a job] Never raises (but ``KeyboardInterrupt``/``SystemExit``):
        it runs after training finished, so a store that cannot be opened or written (gone,
        full, not a store, a database that stopped) is a warning naming what was lost, never a
        traceback and exit status that would fail the job. Each part is tried on its own."""
        from graphdeck.capture.process_groups import write_record

        parts = (("compile records", self.flush_events), ("model frames", self._record_model_frames),
                 ("parallel layout", self.record_layout),
                 ("process groups", lambda: write_record(self.writer)),
                 ("gradient evidence", lambda: self._evidence is not None and self._evidence.close()),
                 ("parity evidence", lambda: self._parity is not None and self._parity.close()),
                 ("Flight Recorder dump", lambda: self._flight is not None and self._flight.write("close")),
                 ("last heartbeat", lambda: self._heartbeat is not None and self._heartbeat.stop("close")),
                 ("queued writes", lambda: self._writer is not None and self._writer.close()))
        try:
            lost = []
            for what, part in parts:
                try:
                    part()
                except Exception as exc:  # noqa: BLE001 - capture never ends a job
                    lost.append(what if self._store_failed else f"{what} ({type(exc).__name__}: {exc})")
            if lost:
                why = f" ({self._store_failed})" if self._store_failed else ""
                warnings.warn(f"graphdeck: not stored at close{why}: {', '.join(lost)}; training is not affected",
                              stacklevel=2)
        finally:
            self.closed = True
            stop_listening(self._handler)
            if self._flight is not None:
                self._flight.stop()
