"""Start a multi-process test job's ranks directly, as ``torchrun --standalone`` would, without
torchrun's launcher process (~2 CPU-s a job: it imports torch only to start the ranks and watch them).

Each rank is ``python -u ARGV...`` with the environment torchrun's local agent gives its workers
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_*``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_USE_AGENT_STORE=True``…),
and, as under torchrun, the ranks rendezvous on a TCPStore the launcher holds: here the test process
(port 0: the kernel picks a free one, no race with other jobs on the host). All ranks write to one
stdout and one stderr, as they do under torchrun. When a rank fails, the others get SIGTERM (then
SIGKILL 30 s later), as torchrun does, and the job's return code is 1.

Each rank, and each single-process torch job a test starts through :func:`start_python` /
:func:`run_python_job`, is forked from a pre-warmed zygote (tests/zygote.py) that has imported torch
once for all the jobs of its environment; ``GRAPHDECK_TEST_ZYGOTE=0`` starts fresh interpreters.

Tests that prove something about torchrun itself, or about how a job behaves when torchrun stops
its ranks (Flight Recorder dumps on SIGTERM, ``graphdeck run``'s launch forms, the framework
integrations as users launch them), keep launching ``torch.distributed.run``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

#: The variables a job's environment may hold that differ from its zygote's: each is read only
#: when a job sets up its process group or its run (``torch.distributed``, the capture agent),
#: never while the preloaded modules import (tests/zygote.py's ``PRELOAD``). Any other difference
#: — ``OMP_NUM_THREADS``, ``TORCH*``, ``TORCHINDUCTOR_*`` (Inductor's config reads some at import),
#: ``KINETO_*``, ``GRAPHDECK_*``… — gets a zygote of its own.
PER_JOB_ENV = frozenset({
    "RANK", "LOCAL_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTEST_CURRENT_TEST", "PORT",
})
#: ``GRAPHDECK_TEST_ZYGOTE=0`` starts every rank as a fresh ``python`` (the behaviour to compare with).
ZYGOTE_ENV = "GRAPHDECK_TEST_ZYGOTE"
#: User and system CPU s of the jobs forked by this process's zygotes that have ended (their own
#: ``wait4``); tests/conftest.py's CPU log adds them to each test's children.
FORKED_CPU = [0.0, 0.0]
#: The start of each command line forked from this process's zygotes (the CPU log counts them).
FORKED: list[str] = []


class Ranks:
    """``nproc`` ranks of ``python -u *argv`` started now; :meth:`wait` collects them.

    ``argv``: what follows ``torchrun --standalone --nproc-per-node N`` (a script and its
    arguments, or ``"-m", module, ...``). ``env``: the whole base environment (default
    ``os.environ``); ``OMP_NUM_THREADS`` defaults to 1, as torchrun sets it for several ranks."""

    def __init__(self, argv: Sequence[str], nproc: int = 2, *, env: dict | None = None,
                 cwd: str | os.PathLike | None = None, stderr_to_stdout: bool = False):
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False)
        base = dict(os.environ if env is None else env)
        base.setdefault("OMP_NUM_THREADS", "1")
        base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                     "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
                     "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
                     "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                     "TORCHELASTIC_RUN_ID": str(uuid.uuid4()), "TORCHELASTIC_USE_AGENT_STORE": "True"})
        base.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        self.out = tempfile.TemporaryFile("a+")
        self.err = self.out if stderr_to_stdout else tempfile.TemporaryFile("a+")
        self.procs = []
        for rank in range(nproc):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            self.procs.append(start_python(["-u", *map(str, argv)], env=rank_env, cwd=cwd, stdout=self.out,
                                           stderr=self.err))
        self.args = ["ranks", str(nproc), *map(str, argv)]
        self._kill_at: float | None = None

    def poll(self) -> bool:
        """True once every rank has exited. The first rank to fail gets the others SIGTERM, and
        SIGKILL 30 s later, as torchrun does."""
        codes = [p.poll() for p in self.procs]  # every rank polled, each time
        if None not in codes:
            return True
        if self._kill_at is None and any(c not in (None, 0) for c in codes):
            self._signal(signal.SIGTERM)
            self._kill_at = time.monotonic() + 30
        elif self._kill_at is not None and time.monotonic() > self._kill_at:
            self._signal(signal.SIGKILL)
        return False

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Wait for every rank: return code 0 when all ranks exit 0, else 1, and the ranks' output.
        After ``timeout`` s, the ranks are killed and ``subprocess.TimeoutExpired`` raised."""
        return wait_all({0: self}, timeout)[0]

    def _result(self) -> subprocess.CompletedProcess:
        code = 0 if all(p.returncode == 0 for p in self.procs) else 1
        out, err = self._read(self.out), self._read(self.err)
        self.out.close()
        self.err.close()
        self.store = None
        return subprocess.CompletedProcess(self.args, code, out, err)

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    @staticmethod
    def _read(f) -> str:
        if f.closed:
            return ""
        f.flush()
        f.seek(0)
        return f.read()


def wait_all(jobs: dict, timeout: float | None = None) -> dict:
    """``{name: Ranks}`` → ``{name: CompletedProcess}``, the jobs watched together (a failed rank's
    peers are stopped while another job is still running). After ``timeout`` s every job still
    running is killed and ``subprocess.TimeoutExpired`` raised."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not all([job.poll() for job in jobs.values()]):
            if deadline is not None and time.monotonic() > deadline:
                for job in jobs.values():
                    job._signal(signal.SIGKILL)
                    for p in job.procs:
                        p.wait()
                late = next(job for job in jobs.values() if job.store is not None)
                raise subprocess.TimeoutExpired(late.args, timeout, late._read(late.out), late._read(late.err))
            time.sleep(0.05)
        return {name: job._result() for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.out.close()
            job.err.close()
            job.store = None


def run_ranks(argv: Sequence[str], nproc: int = 2, *, env: dict | None = None, cwd: str | os.PathLike | None = None,
              timeout: float | None = 600) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc *argv`` without the launcher (:class:`Ranks`):
    a ``CompletedProcess`` with return code 0 when every rank exits 0, else 1, and the ranks'
    stdout and stderr (text)."""
    return Ranks(argv, nproc, env=env, cwd=cwd).wait(timeout)


# ---------------------------------------------------------------------------- zygotes


def start_python(args: Sequence[str], *, env: dict, cwd=None, stdout, stderr, preload: Sequence[str] | None = None):
    """``python ARGS`` (``[-u] script args…``, ``[-u] -m module args…`` or ``[-u] -c code args…``)
    with ``env``, ``cwd`` and ``stdout``/``stderr`` (open files): forked from a pre-warmed zygote
    (:class:`Zygote`, one per distinct environment, :data:`PER_JOB_ENV` aside, and preload list)
    unless ``GRAPHDECK_TEST_ZYGOTE=0`` or ``env`` lacks ``OMP_NUM_THREADS=1``; a ``subprocess.Popen``
    or a :class:`Forked`, which behave alike. ``preload``: the modules the zygote imports beyond
    torch, Dynamo, Inductor's config and torch.distributed (default :data:`DEFAULT_PRELOAD`, plus
    GPT-2's model for a job that names it); ``()`` for a job that must not find graphdeck imported."""
    args = [str(a) for a in args]
    # Only with one OpenMP/OpenBLAS thread do the preloaded libraries start no thread pool at import
    # (tests/zygote.py refuses to fork with a thread running): other jobs start fresh.
    if os.environ.get(ZYGOTE_ENV) == "0" or env.get(ZYGOTE_ENV) == "0" or env.get("OMP_NUM_THREADS") != "1":
        return subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=stdout, stderr=stderr)
    job = args[1:] if args and args[0] == "-u" else args
    return _zygote_for(env, job, preload).spawn(job, env, cwd, stdout, stderr)


def run_python_job(args: Sequence[str], *, env: dict | None = None, cwd=None, timeout: float | None = 600,
                   preload: Sequence[str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd,
    timeout=timeout)`` for a torch job, started by :func:`start_python` (forked from a zygote when
    ``env`` has ``OMP_NUM_THREADS=1``). On timeout the job is killed and ``TimeoutExpired`` raised."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        job = start_python(args, env=env, cwd=cwd, stdout=out, stderr=err, preload=preload)
        try:
            code = job.wait(timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([sys.executable, *map(str, args)], code, out.read(), err.read())


_ZYGOTES: "OrderedDict[tuple, Zygote]" = OrderedDict()  # (extra preload, environment) -> zygote
_ZYGOTES_LOCK = threading.Lock()
#: At most this many zygotes (~0.4 GB each) per test process, the least recently used closed first.
MAX_ZYGOTES = 4


#: Preloaded as well for a job that names one of these in its command line or script: the
#: GPT-2 that graphdeck.demo's ``build_model`` makes (~1.8 CPU-s to import). Other jobs get a
#: zygote without it, so none finds a library imported that it would not import itself.
GPT2_JOB_WORDS = ("graphdeck.demo", "build_model", "transformers")
GPT2_MODULES = ("transformers.models.gpt2.modeling_gpt2",)
#: What a zygote imports beyond tests/zygote.py's ``PRELOAD`` unless told otherwise.
DEFAULT_PRELOAD = ("graphdeck.capture.agent",)


def _extra_preload(job: list) -> tuple:
    text = " ".join(job)
    script = Path(job[0]) if job and job[0] not in ("-m", "-c") else None
    if script is not None and script.suffix == ".py" and script.is_file():
        text += script.read_text(errors="replace")
    return GPT2_MODULES if any(w in text for w in GPT2_JOB_WORDS) else ()


def _zygote_for(env: dict, job: list, preload: Sequence[str] | None) -> "Zygote":
    extra = (*DEFAULT_PRELOAD, *_extra_preload(job)) if preload is None else tuple(preload)
    key = (extra, tuple(sorted((k, v) for k, v in env.items() if k not in PER_JOB_ENV)))
    with _ZYGOTES_LOCK:
        zygote = _ZYGOTES.pop(key, None)
        if zygote is None or not zygote.alive():
            zygote = Zygote(dict(key[1]), extra)
        _ZYGOTES[key] = zygote
        idle = [k for k, z in _ZYGOTES.items() if k != key and not z.live]  # oldest first
        for k in idle[:max(0, len(_ZYGOTES) - MAX_ZYGOTES)]:
            _ZYGOTES.pop(k).close()
        return zygote


def close_zygotes() -> None:
    """Close this process's zygotes (each exits once its running jobs have ended)."""
    with _ZYGOTES_LOCK:
        while _ZYGOTES:
            _ZYGOTES.popitem()[1].close()


atexit.register(close_zygotes)


class Zygote:
    """A ``python -u tests/zygote.py`` that has imported torch, Dynamo, torch.distributed and the
    capture, started with ``env``; :meth:`spawn` forks a job from it (tests/zygote.py)."""

    def __init__(self, env: dict, extra: Sequence[str] = ()):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.log = tempfile.TemporaryFile("a+")
        self.proc = subprocess.Popen([sys.executable, "-u", str(Path(__file__).with_name("zygote.py")),
                                      str(theirs.fileno()), *extra], env=env, pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        theirs.close()
        self.sock = ours
        self.sock.setblocking(False)
        self.buf = b""
        self.pids: list[int] = []
        self.ended: dict[int, int] = {}  # pid -> status, until its Forked reads it
        self.live: set[int] = set()  # forked, not yet seen to end
        self.lock = threading.RLock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list, env: dict, cwd, stdout, stderr) -> "Forked":
        with self.lock:
            msg = (json.dumps({"argv": argv, "env": env, "cwd": None if cwd is None else str(cwd)}) + "\n").encode()
            self.sock.setblocking(True)
            try:
                socket.send_fds(self.sock, [msg], [stdout.fileno(), stderr.fileno()])
            finally:
                self.sock.setblocking(False)
            while not self.pids:
                self._pump(block=True)
            FORKED.append(" ".join(argv[:4])[:120])
            pid = self.pids.pop(0)
            self.live.add(pid)
            return Forked(self, pid, argv)

    def _pump(self, block: bool = False) -> None:
        with self.lock:
            while True:
                try:
                    data = self.sock.recv(1 << 16)
                except ConnectionResetError:
                    data = b""
                except BlockingIOError:
                    if not block:
                        return
                    if not self.alive():
                        raise RuntimeError(f"the zygote exited ({self.proc.returncode}):\n{self._log()}")
                    time.sleep(0.005)
                    continue
                if not data:
                    try:
                        self.proc.wait(10)
                    finally:
                        raise RuntimeError(f"the zygote ended ({self.proc.poll()}):\n{self._log()}")
                self.buf += data
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "pid" in msg:
                        self.pids.append(msg["pid"])
                        block = False
                    else:
                        self.ended[msg["exit"]] = msg["status"]
                        self.live.discard(msg["exit"])
                        FORKED_CPU[0] += msg["utime"]
                        FORKED_CPU[1] += msg["stime"]

    def _log(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def close(self) -> None:
        """Kill the jobs still running (a test that never waited for them), then end the zygote."""
        with self.lock:
            try:
                self._pump()
            except RuntimeError:
                pass
            for pid in self.live - set(self.ended):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.sock.close()
            finally:
                self.proc.wait()
                self.log.close()


class Forked:
    """A job forked by a :class:`Zygote`, with the parts of ``subprocess.Popen`` that tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote._pump()
            self.returncode = self.zygote.ended.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            try:  # until the zygote says something (an exit), at most 0.2 s
                select.select([self.zygote.sock], [], [], 0.2)
            except (OSError, ValueError):
                time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


__all__ = ["Ranks", "run_ranks", "wait_all", "start_python", "run_python_job", "close_zygotes"]
