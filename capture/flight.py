"""The capture agent's Flight Recorder: on in every rank, dumped into the store when it matters.

:func:`enable` sets ``TORCH_FR_BUFFER_SIZE`` (default :data:`DEFAULT_BUFFER` entries) only when
the user has not set it; torch reads it at the first collective recorded, so an agent made after
``init_process_group`` but before the first collective still turns the recorder on (one made
later finds the buffer already sized, possibly at 0: nothing is recorded, nothing fails).

:class:`FlightDumps` writes the rank's dump (``_dump_fr_trace()``, normalised by
:func:`graphdeck.store.fr_import.normalise`) as a ``flight_recorder`` compile record when the
job raises (``sys.excepthook``, chained), is stopped by ``SIGTERM`` (torchrun stops the other
ranks so when one fails; the handler is installed only where none was), exits, or calls
``Agent.close()``. The latest dump of a rank is the one analysed. Never raises into training.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import warnings
import weakref

from graphdeck.store.db import after_main_writes, main_thread_writing

DEFAULT_BUFFER = 2000
ENV = "TORCH_FR_BUFFER_SIZE"


def enable() -> str:
    """Turn the recorder on unless the user chose a size (``TORCH_FR_BUFFER_SIZE``); returns it."""
    return os.environ.setdefault(ENV, str(DEFAULT_BUFFER))


def dump_now() -> dict | None:
    """This process's recorder contents (the pickle torch dumps, loaded), or None."""
    try:
        import torch

        raw = torch._C._distributed_c10d._dump_fr_trace()
    except Exception:  # noqa: BLE001 - no distributed build, no recorder
        return None
    from graphdeck.store.fr_import import load_bytes

    dump, _fmt = load_bytes(bytes(raw)) if raw else (None, "")
    return dump if dump and dump.get("entries") else None


class FlightDumps:
    """Dumps ``agent``'s rank into its store on exception, SIGTERM, exit and :meth:`write`."""

    def __init__(self, agent):
        self.agent = agent
        self.size = enable()
        self._lock = threading.RLock()  # reentrant: NOTE: [A SIGTERM during a dump]
        self._owner: int | None = None  # the thread writing a dump now
        self._last: int | None = None  # entries count + last record id of the last dump written
        import graphdeck.store.fr_import  # noqa: F401 - loaded now: the last dump may run at interpreter exit,
        # when an import that registers an exit hook (as concurrent.futures does) raises
        _LIVE.add(self)
        _install_hooks()

    @classmethod
    def start(cls, agent) -> FlightDumps | None:
        """A FlightDumps for ``agent``, or None (with a warning) when it cannot be set up."""
        try:
            return cls(agent)
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: no Flight Recorder dumps: {type(exc).__name__}: {exc}")
            return None

    def write(self, reason: str) -> bool:
        """Store the recorder's contents now (``reason``: close, exception, sigterm, exit).
        Returns whether a dump was written (nothing new since the last one: not written)."""
        if self.size in ("0", ""):
            return False
        try:
            with self._lock:
                if self._owner is not None:
                    return False  # re-entered by a signal handler on the thread that is writing one
                self._owner = threading.get_ident()
                try:
                    return self._write(reason)
                finally:
                    self._owner = None
        finally:
            _deferred_term()  # a SIGTERM that arrived while this dump was written, the lock released

    def stop(self) -> None:
        """Dump no more for this agent (it was closed): a later exception, SIGTERM or exit in the
        same process must not file another job's collectives under this agent's run."""
        _LIVE.discard(self)

    def _write(self, reason: str) -> bool:
        dump = dump_now()
        if dump is None:
            return False
        ents = dump["entries"]
        key = hash((len(ents), ents[-1].get("record_id"), ents[-1].get("retired"), ents[-1].get("state")))
        if key == self._last:
            return False
        try:
            from graphdeck.store.fr_import import EVENT_NAME, normalise

            norm = normalise(dump, f"capture:{reason}")
            norm["format"] = "capture"
            self.agent.writer.write_compile_events([{
                "name": EVENT_NAME, "compile_id": None,
                "metadata": {"reason": reason, "entries": len(norm["entries"]), "dropped": len(norm["dropped"])},
                "payload": json.dumps(norm, separators=(",", ":"))}])
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: could not store the Flight Recorder dump: {type(exc).__name__}: {exc}")
            return False
        self._last = key
        return True



# One excepthook, one SIGTERM handler and one exit hook for the process, installed by the first
# agent; they dump every live agent's rank (weakly held: an agent nobody uses is collected).
_LIVE: weakref.WeakSet = weakref.WeakSet()
_HOOKS: dict = {}


def _write_all(reason: str) -> None:
    for fd in list(_LIVE):
        fd.write(reason)


# NOTE: [A SIGTERM during a dump]
# Python runs a signal handler on the main thread between two bytecodes, so torchrun's SIGTERM
# can land while that thread is inside ``FlightDumps.write`` (the excepthook's dump of a rank
# whose collective just failed, typically). Writing again from the handler would wait forever on
# the lock that the interrupted write holds, until torchrun's SIGKILL loses the dump; stopping at
# once would lose it too. The lock is reentrant, and the handler, finding this thread's write
# under way, notes the signal and returns; the interrupted write finishes, releases the lock,
# then does what the handler would have done (the other agents' dumps, the flush of
# what ``close()`` writes) and ends the process by the same SIGTERM. The same holds for any
# store write transaction open on the main thread (a compile's graphs, a gradient row): on SQLite
# it holds the write lock (BEGIN IMMEDIATE), which the handler's flush would wait for until
# ``busy_timeout``, past torchrun's SIGKILL; the handler defers to its end
# (``store.db.after_main_writes``).
_TERM: list = []


def _writing() -> bool:
    """Whether this (the main) thread is inside a dump or a store write transaction."""
    me = threading.get_ident()
    return any(fd._owner == me for fd in list(_LIVE)) or main_thread_writing()


def _deferred_term() -> None:
    """The deferred SIGTERM's work, once the writes it interrupted have ended."""
    if _TERM and threading.current_thread() is threading.main_thread() and not _writing():
        _TERM.clear()
        _terminate()


def _terminate() -> None:
    """What the SIGTERM handler does: every live agent's dump and flush, then death by SIGTERM
    (another SIGTERM meanwhile is ignored: this one is being carried out)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _write_all("sigterm")
    from graphdeck.capture.agent import _flush_at_exit

    for fd in list(_LIVE):  # the rest of what close() writes (compile records, gradient evidence)
        _flush_at_exit(weakref.ref(fd.agent), closed=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    if _HOOKS:
        return
    prev_hook = sys.excepthook

    def excepthook(tp, value, tb):
        _write_all("exception")
        (prev_hook or sys.__excepthook__)(tp, value, tb)

    def on_term(signum, frame):
        if _writing():  # NOTE: [A SIGTERM during a dump]
            if not _TERM:
                _TERM.append(signum)
                after_main_writes(_deferred_term)
            return
        _terminate()

    sys.excepthook = _HOOKS["excepthook"] = excepthook
    try:  # only where no handler was set (torchrun stops the other ranks with SIGTERM when one fails)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, on_term)
            _HOOKS["sigterm"] = on_term
    except (ValueError, OSError):  # not the main thread / no signals here
        pass
    import atexit

    atexit.register(_write_all, "exit")


__all__ = ["DEFAULT_BUFFER", "ENV", "FlightDumps", "dump_now", "enable"]
