"""Which launch a rank belongs to, and the run a launch records into when its run name is taken.

# NOTE: [One run per launch]
A run name names one job. Every rank of one launch must join the one run (torchrun's ranks, a
second ``Agent`` in the same process, the ranks ``graphdeck run`` starts), but a later launch
that reuses the name is another job: merged into the first run, its ranks' graphs, steps and
compile records would read as one job's (two rank 0s, twice the restarts, steps 0–4 twice). As
W&B does with a repeated display name, the later launch gets a run of its own: the name with a
suffix (``NAME-2``, ``NAME-3`` …; the first free one, or the one this launch already holds), and
rank 0 prints one notice naming both. ``Agent(..., append=True)``, ``GRAPHDECK_RUN_APPEND=1`` or
``graphdeck run --append`` adds to the named run instead (a job resumed after a crash).

A launch is told apart by what every rank of it shares and no other launch has (:func:`launch_id`):

* ``GRAPHDECK_LAUNCH`` when set: ``graphdeck run`` sets a UUID for every process its command
  starts (one ``graphdeck run`` is one launch, whatever it runs); a launcher of your own may set it;
* ``TORCHELASTIC_RUN_ID`` when it is not ``none`` (torchrun ``--standalone`` makes a UUID per
  launch; a c10d rendezvous takes the job's ``--rdzv-id``, on a cluster the job id): ``elastic:ID``;
* else, once ``torch.distributed`` is up with two ranks or more, a UUID the first rank to ask puts
  in the job's own c10d store (``compare_set``: never blocks, the same answer for every rank of the
  process group; torchrun's static rendezvous, ``mp.spawn``, a hand-set ``MASTER_PORT``):
  ``store:UUID``;
* else one process: ``process:HOST:PID:UUID`` (a UUID made once per process; a forked child makes
  its own).

A run records its launch in ``runs.meta_json["launch"]``; a run without one (made by an importer,
or by a capture older than this) is no launch's, so a capture never joins it silently.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.db import get_or_create_run
from graphdeck.store.schema import Run

ENV_APPEND = "GRAPHDECK_RUN_APPEND"
#: A launch named by the launcher: ``graphdeck run`` sets it for every process it starts.
ENV_LAUNCH = "GRAPHDECK_LAUNCH"
STORE_KEY = "graphdeck/launch"
#: Suffixes tried before giving up (a name reused 999 times is a script's loop, not a person).
MAX_SUFFIX = 999
_process: tuple[int, str] | None = None
_store_launch: str | None = None


def _process_launch() -> str:
    global _process
    if _process is None or _process[0] != os.getpid():
        _process = (os.getpid(), f"process:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}")
    return _process[1]


def launch_id() -> str:
    """This process's launch, the same string on every rank of one launch (NOTE: [One run per
    launch]). Never raises: a c10d store that cannot be asked falls back to the process."""
    global _store_launch
    given = os.environ.get(ENV_LAUNCH, "").strip()
    if given:
        return f"given:{given}"
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none":
        return f"elastic:{rid}"
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if _store_launch is None:
                from torch.distributed.distributed_c10d import _get_default_store

                mine = uuid.uuid4().hex
                got = _get_default_store().compare_set(STORE_KEY, "", mine)
                _store_launch = f"store:{(got.decode() if isinstance(got, bytes) else str(got)) or mine}"
            return _store_launch
    except Exception:  # noqa: BLE001 - capture never breaks training; the process then names the launch
        pass
    return _process_launch()


def _launch_of(run: Run) -> str | None:
    try:
        meta = json.loads(run.meta_json or "{}")
    except ValueError:
        return None
    return meta.get("launch") if isinstance(meta, dict) else None


def claim_run(session: Session, name: str, launch: str, *, world_size: int | None = None,
              append: bool = False) -> tuple[Run, str | None]:
    """The run this launch records into, made when missing, and a notice when it is not ``name``.

    ``name`` free: made, with ``launch`` in its meta. ``name`` held by this launch, or ``append``:
    that run. Held by another launch (or by none: an importer's run): ``NAME-k`` for the smallest
    k ≥ 2 that is free or this launch's. Returns ``(run, notice)``; ``notice`` is None when the run
    is ``name``. Raises ValueError after :data:`MAX_SUFFIX` names taken."""
    run = session.scalar(select(Run).where(Run.name == name))
    if run is None or append:
        return get_or_create_run(session, name, world_size=world_size, meta={"launch": launch}), None
    if _launch_of(run) == launch:
        return get_or_create_run(session, name, world_size=world_size), None
    for k in range(2, MAX_SUFFIX + 1):
        alt = f"{name}-{k}"
        other = session.scalar(select(Run).where(Run.name == alt))
        if other is None or _launch_of(other) == launch:
            new = get_or_create_run(session, alt, world_size=world_size, meta={"launch": launch})
            held = (f"another launch's (created {run.created_at:%Y-%m-%d %H:%M:%S})" if _launch_of(run)
                    else "not a capture's (an import, or an older graphdeck)")
            return new, (f"graphdeck: run {name!r} already exists in this store and is {held}; this launch "
                         f"records as run {alt!r} so the two jobs stay apart (Agent(append=True), "
                         f"{ENV_APPEND}=1 or graphdeck run --append adds to {name!r} instead)")
    raise ValueError(f"run names {name!r} to {name}-{MAX_SUFFIX} are all taken by other launches: pick another run name")


def append_wanted(append: bool | None) -> bool:
    """``append`` when given, else ``GRAPHDECK_RUN_APPEND`` set to 1/true/yes."""
    if append is not None:
        return bool(append)
    return os.environ.get(ENV_APPEND, "").strip().lower() in ("1", "true", "yes")


def notify(notice: str | None, rank: int) -> None:
    """Print ``notice`` once, on rank 0 (a 1,024-rank job prints one line, not 1,024)."""
    if notice and rank == 0:
        print(notice, file=sys.stderr, flush=True)
