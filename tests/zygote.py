"""A pre-warmed interpreter that forks test jobs (the server side of :class:`tests.launch.Zygote`).

Started as ``python -u tests/zygote.py FD [MODULE...]`` with the jobs' environment, it imports
torch, Dynamo, Inductor's config, torch.distributed and the MODULEs (by default graphdeck's capture
agent, and GPT-2's transformers model for the jobs that build one) once (~3 CPU-s that every fresh rank process would
spend again), then serves requests on the Unix socket ``FD``: each request is a JSON line
``{"argv": [...], "env": {...}, "cwd": ...}`` with the job's stdout and stderr descriptors attached
(``SCM_RIGHTS``). For each it forks a child that becomes the job: ``os.environ`` set to ``env``
(``putenv`` too, so C code reading the environment later sees it), ``cwd``, stdin ``/dev/null``,
stdout/stderr the given files, ``sys.argv``/``sys.path[0]`` as ``python ARGV`` sets them, the
intra-op thread count from ``OMP_NUM_THREADS``; then the script, ``-m`` module or ``-c`` code runs
as ``__main__`` (:mod:`runpy`) and the child ends as that interpreter would: an uncaught exception
prints its traceback and exits 1, ``SystemExit`` exits with its code, ``atexit`` handlers and
non-daemon threads are waited for.

Replies, JSON lines: ``{"pid": P}`` per request, and ``{"exit": P, "status": S, "utime": U,
"stime": T}`` when child ``P`` ends (``S``: ``Popen.returncode``'s convention, ``-SIG`` for a
signal; ``U``/``T``: its user/system CPU s from ``wait4``). It exits when the socket closes, after
reaping its children.

Only the environment the zygote started with may differ from a job's in variables read after
start-up (:data:`tests.launch.PER_JOB_ENV`); no thread exists before a fork (the imports start
none: checked at start).
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading

#: Always imported first; the client names the rest (tests/launch.py ``DEFAULT_PRELOAD``).
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.config", "torch.distributed")


def _preload(extra: list[str]) -> None:
    import importlib

    for name in (*PRELOAD, *extra):
        importlib.import_module(name)
    import gc

    gc.collect()
    gc.freeze()  # the preloaded objects: never traversed again, so a child's collections copy no pages
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit(f"zygote: the preloaded imports started threads: {threading.enumerate()}")


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def serve(sock: socket.socket):
    """Serve until the socket closes; returns a job (in a forked child) or None (in the zygote)."""
    buf = b""
    fds: list[int] = []
    children: set[int] = set()
    open_ = True
    while open_ or children:
        if open_:
            ready, _, _ = select.select([sock], [], [], 0.02)
            if ready:
                data, new_fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
                fds.extend(new_fds)
                if not data:
                    open_ = False
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    job = json.loads(line)
                    out, err = fds.pop(0), fds.pop(0)
                    pid = os.fork()
                    if pid == 0:
                        sock.close()
                        job["out"], job["err"] = out, err
                        return job
                    os.close(out)
                    os.close(err)
                    children.add(pid)
                    _send(sock, {"pid": pid})
        else:
            select.select([], [], [], 0.02)
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            if open_:
                try:
                    _send(sock, {"exit": pid, "status": code, "utime": usage.ru_utime, "stime": usage.ru_stime})
                except OSError:
                    open_ = False
    return None


def become(job: dict) -> None:
    """In the forked child: set up the process as ``python ARGV`` would be, then run the job."""
    import importlib.machinery
    import runpy
    import types

    import atexit
    import gc

    # At exit the preloaded objects are collectable again, as in a fresh interpreter's finalization
    # (extension modules that count their live objects at exit, nanobind's, find none left over).
    atexit.register(gc.unfreeze)
    os.environ.clear()
    os.environ.update(job["env"])
    if job.get("cwd"):
        os.chdir(job["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(job["out"], 1)
    os.dup2(job["err"], 2)
    os.close(job["out"])
    if job["err"] != job["out"]:
        os.close(job["err"])
    # OMP_NUM_THREADS and the other variables read at start-up are the zygote's own (the zygote is
    # chosen by them): libgomp and torch's intra-op pool, not started yet, start as in a fresh process.
    argv = list(job["argv"])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")  # as ``python -c`` has it: no __file__, no __spec__
        main.__loader__ = importlib.machinery.BuiltinImporter
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), vars(main))
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _preload(sys.argv[2:])
    job = serve(sock)
    if job is not None:
        become(job)


if __name__ == "__main__":
    main()
