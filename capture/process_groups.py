"""The process groups a rank runs with, and their collective timeouts, for the store.

A ``graphdeck_process_groups`` compile record (JSON payload ``{"groups": [{"name", "desc",
"backend", "ranks", "timeout_s"}]}``) written by the agent once the default group exists.
:mod:`graphdeck.analysis.ranks.compile_skew` names the timeout a compile skew risks from it (NOTE:
[Compile skew]); without it, torch's default for the backend is assumed.
"""

from __future__ import annotations

EVENT_NAME = "graphdeck_process_groups"


def _timeout_s(pg) -> float | None:
    """The group's collective timeout in seconds, from its backends' options; None if unknown."""
    import torch

    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
            return float(backend.options._timeout.total_seconds())
        except Exception:  # noqa: BLE001 - no backend for that device, or no options
            continue
    return None


def process_group_record() -> dict | None:
    """``{"groups": [...]}`` for every process group this process knows (the default group
    first), or None when torch.distributed is not initialised. Never raises."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_available() or not dist.is_initialized():
            return None
        groups = []
        for pg, name in list(c10d._world.pg_names.items()):
            ranks = c10d._world.pg_group_ranks.get(pg) or {}
            groups.append({"name": str(name), "desc": getattr(pg, "group_desc", None),
                           "backend": str(dist.get_backend(pg)), "ranks": sorted(int(r) for r in ranks),
                           "timeout_s": _timeout_s(pg)})
        default = dist.group.WORLD
        groups.sort(key=lambda g: g["name"] != c10d._world.pg_names.get(default))
        return {"groups": groups} if groups else None
    except Exception:  # noqa: BLE001 - capture never breaks training
        return None


def write_record(writer) -> bool:
    """Write :func:`process_group_record` through ``writer`` (a
    :class:`~graphdeck.capture.writer.StoreWriter`); False when there is nothing to write or the
    write failed (warned). Never raises."""
    import json
    import warnings

    record = process_group_record()
    if record is None:
        return False
    try:
        writer.write_compile_events([{"name": EVENT_NAME, "compile_id": None, "metadata": {},
                                      "payload": json.dumps(record)}])
        return True
    except Exception as exc:  # noqa: BLE001 - capture never breaks training
        warnings.warn(f"graphdeck: could not record process groups: {type(exc).__name__}: {exc}")
        return False
