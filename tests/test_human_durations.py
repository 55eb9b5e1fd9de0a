"""Durations in human units in every text (NOTE: [Human durations] in analysis/units.py): the
straggler note said a 3.6 ms wait was "0.00 s"; one helper now says ms below 1 s and µs below 1 ms."""

from __future__ import annotations

import pytest

from graphdeck.analysis.ranks.cpu_collectives import rank_timing
from graphdeck.analysis.units import duration_text, ns_text


@pytest.mark.parametrize("seconds,digits,text", [
    (3.6e-3, 2, "3.6 ms"), (0.0036, 1, "3.6 ms"), (0.9996, 2, "999.6 ms"), (1.234, 2, "1.23 s"), (12.34, 1, "12.3 s"),
    (2.5e-5, 2, "25.0 µs"), (4e-7, 2, "400 ns"), (0, 2, "0 s"), (-3.6e-3, 2, "-3.6 ms"), (None, 2, "?"),
])
def test_duration_text(seconds, digits, text):
    assert duration_text(seconds, digits) == text
    if seconds is not None:
        assert ns_text(seconds * 1e9, digits) == text


def _coll(seq: int, waits: dict[int, int], transfer_ns: int, last: int) -> dict:
    """One matched collective as align_and_match gives it (ns)."""
    return {"group": "0", "kind": "allreduce", "seq": seq, "last_rank": last, "suspect": None,
            "ranks": {r: {"arrive_ns": 1_000_000 * seq + (0 if r != last else max(waits.values())),
                          "wait_ns": w, "transfer_ns": transfer_ns, "kernel": "gloo:all_reduce"}
                      for r, w in waits.items()}}


def test_the_straggler_note_says_milliseconds_and_microseconds():
    matched = {"collectives": [_coll(1, {0: 0, 1: 3_600_000}, 25_000, 0), _coll(2, {0: 0, 1: 0}, 25_000, 0)],
               "step_times": {}}
    msg = rank_timing(matched)["message"]
    assert msg.startswith("straggler: rank 0 arrived last at 2 of 2 matched collectives, 3.6 ms late in total; "
                          "rank 1 waited 3.6 ms for it"), msg
    assert "50.0 µs moving data" in msg and "0.0 ms" not in msg and "0.00 s" not in msg, msg
