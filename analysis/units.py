"""Durations in human units, for every text graphdeck prints (CLI text, findings' messages, the
run overview): one helper, so a 3.6 ms wait reads ``3.6 ms``, never ``0.00 s``.

# NOTE: [Human durations]
From 1 s up: seconds with ``digits`` decimals (the caller's precision: ``12.3 s`` for a compile,
``1.23 s`` for a wait); below 1 s: ``ms`` with one decimal; below 1 ms: ``µs`` with one decimal;
below 1 µs: whole ``ns``; exactly 0: ``0 s``. Negative durations keep their sign. JSON keeps its
numbers in ns or s as documented; only text goes through here.
"""

from __future__ import annotations

import math


def duration_text(seconds: float | int | None, digits: int = 2) -> str:
    """``3.6e-3`` → ``"3.6 ms"``, ``2.5e-5`` → ``"25.0 µs"``, ``1.234`` → ``"1.23 s"`` (``digits``
    decimals from 1 s up), ``0`` → ``"0 s"``, None or NaN → ``"?"`` (NOTE: [Human durations])."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "?"
    a = abs(seconds)
    if a == 0:
        return "0 s"
    if a >= 1 or math.isinf(a):
        return f"{seconds:.{digits}f} s"
    if a >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    if a >= 1e-6:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e9:.0f} ns"


def ns_text(ns: float | int | None, digits: int = 2) -> str:
    """:func:`duration_text` of a duration given in ns."""
    return duration_text(None if ns is None else ns / 1e9, digits)
