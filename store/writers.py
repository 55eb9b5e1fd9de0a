"""Who is writing a row that is not finished, and whether that writer still lives.

# NOTE: [Writer stamps] A writer that leaves rows visible before it is done (a trace ``ingesting``
# batch by batch, a TORCH_TRACE import committing a rank every few thousand records) puts
# :func:`stamp` in their ``meta_json`` (``"writer"``): host name, PID namespace (two containers
# may share a host name, never a PID namespace), pid and the process's start time
# (``/proc/<pid>/stat`` field 22, clock ticks since boot, so a reused pid is not taken for the
# writer). :func:`alive` answers ``False`` only when the writer ran on this host, in this PID
# namespace, and that process is gone: such rows are left over by a killed writer and may be swept (a trace) or replaced (a
# rank) at once, without the 30-minute stale-ingest wait (NOTE: [Stale ingests] in
# graphdeck.store.db), which stays the rule for writers on other hosts (``None``: cannot tell).
"""

from __future__ import annotations

import os

WRITER_KEY = "writer"


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22 of the whole line; fields[0] here is field 3 (state)
    except (OSError, IndexError, ValueError):
        return None


def _host() -> str:
    """The host name, as ``socket.gethostname()`` gives it (POSIX: ``uname``'s node name) without
    importing ``socket`` (~3 ms of a small ``graphdeck import``: issue 41 goal 4)."""
    if hasattr(os, "uname"):
        return os.uname().nodename
    import socket

    return socket.gethostname()


def _pid_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def stamp() -> dict:
    """This process as a writer: ``{"host": str, "ns": str | None, "pid": int, "start": int | None}``."""
    return {"host": _host(), "ns": _pid_ns(), "pid": os.getpid(), "start": _start_ticks(os.getpid())}


def alive(writer: dict | None) -> bool | None:
    """Whether the process ``writer`` (a :func:`stamp`) still runs: ``True``, ``False`` (it ran on
    this host and PID namespace and is gone, or its pid now belongs to a later process), or
    ``None`` (no stamp, another host or another PID namespace: cannot tell)."""
    if not isinstance(writer, dict) or writer.get("host") != _host() or writer.get("ns") != _pid_ns():
        return None
    pid = writer.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process with that pid: it exists
    start = writer.get("start")
    now = _start_ticks(pid)
    if start is not None and now is not None and now != start:
        return False
    return True


def describe(writer: dict | None) -> str:
    """``pid 123 on host h`` for messages."""
    if not isinstance(writer, dict):
        return "an unknown writer"
    return f"pid {writer.get('pid')} on host {writer.get('host')}"
