"""The capture's store writes on a background thread (NOTE: [Writes off the compiling thread]).

:class:`BackgroundWriter` has :class:`~graphdeck.capture.writer.StoreWriter`'s methods; it opens
the store and runs every write on one daemon thread named ``graphdeck-writer``, in the order the
calls were made. Used by :class:`graphdeck.capture.agent.Agent` (``Agent.writer``).
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
import time
import warnings
import weakref
from typing import Any, Callable

from graphdeck.capture.writer import IOBinding, StoreWriter

#: The writer thread's name (``threading.current_thread().name`` inside a write).
THREAD_NAME = "graphdeck-writer"
#: ``GRAPHDECK_WRITER_THREAD=1`` turns the thread on; unset or ``0``: no thread, every write is
#: made on the calling thread (the default: a job killed while the thread is behind loses its
#: queued writes, which the merged suite showed on dying jobs — tests/test_gradients_evidence.py,
#: tests/test_n5_fsdp2.py — so the thread stays opt-in until that is closed).
ENV = "GRAPHDECK_WRITER_THREAD"

# NOTE: [Writes off the compiling thread]
# The compiling thread (Dynamo's, inside the backend and inside torch's structured-log handler)
# takes only the snapshot it must take while the graph is as the compiler left it: a
# ``GraphRecord`` of plain values (fxrecord.record_graph), the bindings, the compile record's dict.
# Opening the store (engine, migrations, the run and rank rows), serialising (JSON), interning
# strings and the SQL inserts run on one ``graphdeck-writer`` thread, in call order (one FIFO
# queue, one thread: a graph's row is written before the rows that name it). A graph's id is
# known only once its row is written: ``write_graph`` returns a :class:`Pending`, which later
# writes take in place of the id (resolved on the writer thread, where the graph row is already
# written) and which ``int()``/``.value`` waits for.
# Nothing is lost: ``flush()`` waits for every write queued so far; it runs before anything in
# the process reads the store back through this writer (``engine``: the profile's trace ingest,
# the evidence's renumbering, the heartbeat's reads and the hang report), at ``Agent.close`` and
# at interpreter exit / SIGTERM (``_flush_at_exit``, and this module's own exit hook, after which
# writes run on the calling thread), and at the end of each optimizer step when anything is
# still queued (``flush_if_behind``; one comparison otherwise), so a job killed outright
# (SIGKILL, ``os._exit``) after a step keeps that step's rows, and after a compile that failed
# (its metrics record waits until written: the compile raises into the job next, which may die
# at once) keeps that compile's records; killed inside a step or a compile
# it loses what is still queued, as it loses the one write in flight without the thread.
# Errors are reported, not swallowed: a write that fails is rolled back (one transaction, as
# before), warned about (``graphdeck: could not write ...: <Type>: <message>``) and kept in
# ``failures``; a store that cannot be opened turns the capture off with the agent's warning.
# Row ids come back as :class:`Pending` (graphs, gradient steps, fingerprint records), so no
# write makes the training thread wait; a caller's own read-modify-write goes on the queue
# (``call``). The job is never changed: the thread reads only the snapshots handed to it (plain
# values: records, row dicts, JSON text), never a live graph or tensor.

_STOP = object()


class Pending:
    """A row id the writer thread assigns when it writes the row (a graph's ``graphs.id``).

    ``value`` (or ``int(p)``) waits for the write; raises :class:`~graphdeck.errors.StoreError`
    when the write failed or the store could not be opened."""

    __slots__ = ("_writer", "_value", "_error", "__weakref__")

    def __init__(self, writer: "BackgroundWriter"):
        self._writer, self._value, self._error = writer, None, None

    @property
    def done(self) -> bool:
        return self._value is not None or self._error is not None

    @property
    def value(self) -> int:
        if not self.done:
            self._writer.flush()
        if self._value is None:
            from graphdeck.errors import StoreError

            raise StoreError(self._error or "the write was never made")
        return self._value

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"Pending({self._value if self._value is not None else self._error or '...'})"


def resolve(value: Any) -> Any:
    """``value``, or the id a :class:`Pending` stands for (on the writer thread: already written)."""
    return value.value if isinstance(value, Pending) else value


class _Job:
    __slots__ = ("fn", "what", "pending", "done", "result", "error", "report", "ticket")

    def __init__(self, fn, what: str, pending: Pending | None = None, wait: bool = False):
        self.fn, self.what, self.pending = fn, what, pending
        self.done = threading.Event() if wait else None
        self.result = self.error = None
        self.report = not wait  # a waited-for write raises in its caller instead
        self.ticket = 0


class BackgroundWriter:
    """One rank's :class:`StoreWriter`, opened and written on the ``graphdeck-writer`` thread.

    ``open_writer()`` makes the StoreWriter (run on the thread); ``on_open_error(message)`` is
    called there when it raises (the agent turns the capture off). ``rank``/``world_size``: as
    the StoreWriter's. ``thread_cpu_s``: CPU seconds the writer thread spent (``time.thread_time``)."""

    def __init__(self, open_writer: Callable[[], StoreWriter], *, rank: int, world_size: int,
                 on_open_error: Callable[[str], None] | None = None):
        self.rank, self.world_size = rank, world_size
        self._open_writer, self._on_open_error = open_writer, on_open_error
        self._inner: StoreWriter | None = None
        self.open_error: str | None = None
        self.failures: list[str] = []
        self.thread_cpu_s = 0.0
        self._opened = threading.Event()
        self._inline = threading.RLock()  # writes on the caller's thread once the thread is stopped
        self._stopping = False
        self._pid = os.getpid()
        self._tickets = itertools.count(1)  # next() is atomic: callers on several threads
        self._last_ticket = self._done_ticket = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()  # put() is reentrant: safe in a signal handler
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        if os.environ.get(ENV, "0") != "1":  # off by default (NOTE below): every write on the caller's thread
            self._stopping = True
            return
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------------- the thread
    def _open(self) -> None:
        if self._inner is not None or self.open_error is not None:
            return
        try:
            self._inner = self._open_writer()
        except BaseException as exc:  # noqa: BLE001 - reported through on_open_error
            self.open_error = f"{type(exc).__name__}: {exc}"
            if self._on_open_error is not None:
                try:
                    self._on_open_error(self.open_error)
                except Exception:  # noqa: BLE001 - the warning itself failed
                    pass
        finally:
            self._opened.set()

    def _loop(self) -> None:
        t0 = time.thread_time()
        self._open()
        self.thread_cpu_s += time.thread_time() - t0
        while True:
            job = self._q.get()
            if job is _STOP:
                return
            t0 = time.thread_time()
            self._run(job)
            if job.ticket:
                self._done_ticket = job.ticket
            self.thread_cpu_s += time.thread_time() - t0

    def _run(self, job: _Job) -> None:
        try:
            if self.open_error is not None:
                raise _store_error(self.open_error)
            job.result = job.fn(self._inner)
            if isinstance(job.pending, list):
                for p, v in zip(job.pending, job.result):
                    p._value = v
            elif job.pending is not None:
                job.pending._value = job.result
        except BaseException as exc:  # noqa: BLE001 - reported below
            if not isinstance(exc, Exception) and threading.current_thread() is not self._thread:
                raise  # Ctrl-C / exit during a write made on the caller's thread: the caller's
            msg = f"{type(exc).__name__}: {exc}"
            job.error = exc
            for p in job.pending if isinstance(job.pending, list) else [job.pending] if job.pending else []:
                p._error = f"could not write {job.what}: {msg}"
            if job.report and self.open_error is None:
                self.failures.append(f"{job.what}: {msg}")
                try:
                    warnings.warn(f"graphdeck: could not write {job.what}: {msg}; training is not affected")
                except Exception:  # noqa: BLE001
                    pass
        finally:
            if job.done is not None:
                job.done.set()

    # ------------------------------------------------------------------------- the caller's side
    def _threaded(self) -> bool:
        """Whether writes go to the thread (else they run on the caller's thread: after
        :meth:`close`, at exit, or in a forked child, where the thread does not exist)."""
        if os.getpid() != self._pid:  # a forked child: the parent's queue is not ours to write
            self._pid, self._q, self._stopping = os.getpid(), queue.SimpleQueue(), True
            return False
        return not self._stopping and self._thread.is_alive()

    def _submit(self, fn, what: str, pending: Pending | None = None, wait: bool = False):
        if self.open_error is not None:
            raise _store_error(self.open_error)
        job = _Job(fn, what, pending, wait)
        if self._threaded():
            job.ticket = self._last_ticket = next(self._tickets)
            self._q.put(job)
            if not wait:
                return None
            job.done.wait()
        else:
            self._join()
            with self._inline:
                self._drain()
                self._open()
                self._run(job)
        if job.error is not None and wait:
            raise job.error
        return job.result

    def _join(self) -> None:
        """Wait for a stopping thread to end (it makes what was queued before its stop)."""
        if self._thread.is_alive() and os.getpid() == self._pid and threading.current_thread() is not self._thread:
            self._thread.join()

    def _drain(self) -> None:
        """Run what is left in the queue on this thread (the thread is stopped)."""
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                self._open()
                self._run(job)

    def flush(self) -> None:
        """Wait until every write queued so far is made (or failed, and warned about). Never raises."""
        if threading.current_thread() is self._thread:
            return
        if self._threaded():
            job = _Job(lambda _w: None, "flush", wait=True)
            job.report = False
            self._q.put(job)
            job.done.wait()
            return
        self._join()
        with self._inline:
            self._drain()

    def flush_if_behind(self) -> None:
        """:meth:`flush`, at the cost of one comparison when nothing is queued (the optimizer
        step's end: a step's rows are in the store when it returns, so even a job that then dies
        by ``os._exit`` keeps them)."""
        if self._done_ticket < self._last_ticket or not self._threaded():
            self.flush()

    def close(self) -> None:
        """Flush, then stop the thread; later writes run on the calling thread. Never raises."""
        if threading.current_thread() is self._thread:
            return
        if not self._stopping and os.getpid() == self._pid:
            self._stopping = True
            self._q.put(_STOP)
        self.flush()

    def wait_open(self) -> StoreWriter:
        """The StoreWriter once the store is open; :class:`StoreError` when it could not be."""
        if not self._opened.is_set():
            if self._threaded():
                self._opened.wait()
            else:
                with self._inline:
                    self._open()
        if self._inner is None:
            raise _store_error(self.open_error or "the store is not open")
        return self._inner

    @property
    def engine(self):
        """The store's engine, after every queued write is made (a reader sees what was written)."""
        self.flush()
        return self.wait_open().engine

    @property
    def run_id(self) -> int:
        return self.wait_open().run_id

    # ------------------------------------------------------------------------- StoreWriter's methods
    def write_params(self, rows: list[dict]) -> None:
        rows = list(rows)
        self._submit(lambda w: w.write_params(rows), "the parameters")

    def write_graph(self, record, **kw) -> Pending:
        """Queue :meth:`StoreWriter.write_graph` (``parent_id`` may be a :class:`Pending`);
        returns the graph's id as a :class:`Pending`."""
        pending = Pending(self)
        if kw.get("io"):
            kw["io"] = list(kw["io"])

        def do(w: StoreWriter) -> int:
            return w.write_graph(record, **{**kw, "parent_id": resolve(kw.get("parent_id"))})

        self._submit(do, f"{kw.get('kind')} graph {kw.get('name')!r}", pending)
        return pending

    def update_graph_meta(self, graph_id, updates: dict) -> None:
        updates = dict(updates)
        self._submit(lambda w: w.update_graph_meta(resolve(graph_id), updates), "a graph's metadata")

    def add_bindings(self, rows_by_graph: dict[Any, list[IOBinding]]) -> None:
        rows = [(gid, list(r)) for gid, r in rows_by_graph.items()]
        self._submit(lambda w: w.add_bindings({resolve(gid): r for gid, r in rows}), "parameter bindings")

    def write_partition(self, **kw) -> None:
        def do(w: StoreWriter) -> None:
            w.write_partition(**{**kw, "parent_graph_id": resolve(kw["parent_graph_id"]),
                                 "graph_id": resolve(kw.get("graph_id"))})

        self._submit(do, "a DDP partition")

    def write_compile_events(self, events: list[dict]) -> None:
        if not events:
            return
        events = list(events)
        self._submit(lambda w: w.write_compile_events(events),
                     "compile records " + ", ".join(sorted({str(e.get("name")) for e in events})))

    def write_grad_step(self, **kw) -> Pending:
        """Queue :meth:`StoreWriter.write_grad_step`; returns the row's id as a :class:`Pending`."""
        pending = Pending(self)
        self._submit(lambda w: w.write_grad_step(**kw), "a gradient step", pending)
        return pending

    def extend_grad_step(self, row_id, **kw) -> None:
        self._submit(lambda w: w.extend_grad_step(resolve(row_id), **kw), "a gradient step's extent")

    def write_records(self, name: str, payloads: list[str], updates: dict | None = None) -> list[Pending]:
        """Queue :meth:`StoreWriter.write_records` (``updates`` keyed by ids or :class:`Pending`);
        returns the new rows' ids as :class:`Pending`."""
        payloads, updates = list(payloads), list((updates or {}).items())
        pending = [Pending(self) for _ in payloads]
        self._submit(lambda w: w.write_records(name, payloads, {resolve(k): v for k, v in updates}),
                     f"{name} records", pending)
        return pending

    def call(self, fn: Callable[[StoreWriter], Any], what: str) -> None:
        """Queue ``fn(store_writer)`` (on the writer thread, after the writes queued before it):
        a write of the caller's own; its failure is warned about like any write's."""
        self._submit(fn, what)

    def __getattr__(self, name: str):  # anything else StoreWriter has: after the queued writes
        if name.startswith("_"):
            raise AttributeError(name)
        self.flush()
        return getattr(self.wait_open(), name)


def _store_error(message: str):
    from graphdeck.errors import StoreError

    return StoreError(message)


def _close_at_exit(ref) -> None:
    """At interpreter exit: make every queued write, then write on the exiting thread (the
    agent's exit flush, registered before, runs after this and writes directly)."""
    w = ref()
    if w is not None:
        try:
            w.close()
        except Exception:  # noqa: BLE001 - never fail the interpreter's exit
            pass
