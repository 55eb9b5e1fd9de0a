"""Deterministic colours by name: the same name gets the same palette slot in every render."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def hash_slots(names: Iterable[str], size: int, taken: set[int] | None = None) -> dict[str, int]:
    """``name → slot`` in ``range(size)``: ``md5(name) % size``, probing forward past slots in
    ``taken`` (updated in place) while a free one is left, so names get distinct slots up to
    ``size`` of them. The order of ``names`` decides who probes first."""
    taken = set() if taken is None else taken
    slots = {}
    for name in names:
        slot = int(hashlib.md5(name.encode("utf-8")).hexdigest()[:8], 16) % size
        while slot in taken and len(taken) < size:
            slot = (slot + 1) % size
        taken.add(slot)
        slots[name] = slot
    return slots
