"""Start a multi-process test job's ranks directly, as ``torchrun --standalone`` would, without
torchrun's launcher process (~2 CPU-s a job: it imports torch only to start the ranks and watch them).

Each rank is ``python -u ARGV...`` with the environment torchrun's local agent gives its workers
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_*``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_USE_AGENT_STORE=True``…),
and, as under torchrun, the ranks rendezvous on a TCPStore the launcher holds: here the test process
(port 0: the kernel picks a free one, no race with other jobs on the host). All ranks write to one
stdout and one stderr, as they do under torchrun. When a rank fails, the others get SIGTERM (then
SIGKILL 30 s later), as torchrun does, and the job's return code is 1.

Tests that prove something about torchrun itself, or about how a job behaves when torchrun stops
its ranks (Flight Recorder dumps on SIGTERM, ``graphdeck run``'s launch forms, the framework
integrations as users launch them), keep launching ``torch.distributed.run``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Sequence


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
            self.procs.append(subprocess.Popen([sys.executable, "-u", *map(str, argv)], env=rank_env,
                                               cwd=cwd, stdout=self.out, stderr=self.err))
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


__all__ = ["Ranks", "run_ranks", "wait_all"]
