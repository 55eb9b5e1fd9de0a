"""Deterministic colours: palette slots by name hash, a heat ramp for overlays, edge byte scale."""

from __future__ import annotations

import hashlib
import math
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


#: Overlay heat ramp, low → high (a perceptually ordered yellow-orange-red sequence).
HEAT = ("#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#b10026")
#: Edge colours by byte bin, light → dark (sequential blues); the heaviest edges get EDGE_HEAVY.
EDGE_BINS = ("#c6dbef", "#9ecae1", "#6baed6", "#3182bd", "#08519c")
EDGE_HEAVY = "#d62728"
#: Categorical overlay values (partition, rank).
QUALITATIVE = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666",
               "#a6cee3", "#fb9a99")


def heat(value: float, lo: float, hi: float) -> str:
    """The ramp colour of ``value`` on a log scale between ``lo`` and ``hi`` (both ≥ 0)."""
    if hi <= lo:
        return HEAT[-1]
    frac = (math.log1p(max(value, 0) - lo) / math.log1p(hi - lo)) if value > lo else 0.0
    return HEAT[min(len(HEAT) - 1, int(frac * len(HEAT)))]


def edge_bin(nbytes: int, max_bytes: int) -> int:
    """Bin of ``nbytes`` in ``range(len(EDGE_BINS))``, log scale up to ``max_bytes``."""
    if max_bytes <= 0 or nbytes <= 0:
        return 0
    frac = math.log1p(nbytes) / math.log1p(max_bytes)
    return min(len(EDGE_BINS) - 1, int(frac * len(EDGE_BINS)))


def bin_floor(b: int, max_bytes: int) -> int:
    """The smallest byte count that falls in bin ``b`` (inverse of :func:`edge_bin`)."""
    if b == 0 or max_bytes <= 0:
        return 0
    return math.ceil(math.expm1(b / len(EDGE_BINS) * math.log1p(max_bytes)))


def edge_width(nbytes: int, max_bytes: int) -> float:
    """Stroke width 0.8–5 px, log scale of bytes."""
    if max_bytes <= 0 or nbytes <= 0:
        return 0.8
    return round(0.8 + 4.2 * math.log1p(nbytes) / math.log1p(max_bytes), 2)


def fmt_bytes(n: float) -> str:
    """``1536`` → ``'1.5 KiB'``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    v, i = float(n), 0
    while abs(v) >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    return f"{int(v)} B" if i == 0 else f"{v:.1f} {units[i]}"


def fmt_ns(n: float) -> str:
    """``1_500_000`` → ``'1.50 ms'``."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} ns"
