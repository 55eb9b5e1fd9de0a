"""Which field of a Flight Recorder dump has a type torch never writes (issue 36, item 7): the
file is refused naming it (:func:`dump_problem`), or the entry dropped naming it
(:func:`entry_problem`), instead of a traceback deep in the import (see
:mod:`graphdeck.store.fr_import` for the format)."""

from __future__ import annotations


def _kind(v) -> str:
    return type(v).__name__


def _int64(v) -> bool:
    return type(v) is int and -(2**63) <= v < 2**63


def dump_problem(dump: dict) -> str | None:
    """The first top-level field of ``dump`` whose type torch never writes (``pg_config`` a
    mapping of group name → mapping, ``pg_status`` a mapping, ``rank`` an int), as
    ``"pg_config is a float"``; None when they fit. Entries are checked one by one
    (:func:`entry_problem`): a bad one is dropped and named, not the file."""
    cfg = dump.get("pg_config")
    if cfg is not None:
        if not isinstance(cfg, dict):
            return f"pg_config is a {_kind(cfg)}, not a mapping"
        bad = next((k for k, v in cfg.items() if not isinstance(v, dict)), None)
        if bad is not None:
            return f"pg_config[{bad!r:.40}] is a {_kind(cfg[bad])}, not a mapping"
    status = dump.get("pg_status")
    if status is not None and not isinstance(status, dict):
        return f"pg_status is a {_kind(status)}, not a mapping"
    if "rank" in dump and not (_int64(dump["rank"]) and dump["rank"] >= 0) and dump["rank"] is not None:
        return f"rank is {dump['rank']!r:.40}, not a rank number"
    return None


#: Entry fields besides op, sequence id and group: the types torch writes (None where it may).
_ENTRY_TYPES = (("input_sizes", (list, type(None))), ("output_sizes", (list, type(None))),
                ("input_dtypes", (list, type(None))), ("output_dtypes", (list, type(None))),
                ("frames", (list, type(None))), ("state", (str, type(None))), ("retired", (bool, type(None))))


def entry_problem(e: dict) -> str | None:
    """Why entry ``e`` (a dict with its op, sequence id and group) cannot be stored, naming the
    field (``"input_sizes is a float"``), or None."""
    for name, kinds in _ENTRY_TYPES:
        if not isinstance(e.get(name), kinds):
            return f"{name} is a {_kind(e.get(name))}"
    for name in ("record_id", "time_created_ns", "p2p_seq_id", "collective_seq_id"):
        v = e.get(name)
        if v is not None and not _int64(v):
            return f"{name} is {v!r:.40}, not a 64-bit integer"
    pg = e.get("process_group")
    if not all(isinstance(x, (str, int)) for x in pg):
        return "process_group holds something else than names"
    return None
