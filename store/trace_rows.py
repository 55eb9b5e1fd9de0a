"""Trace events to rows: the per-event half of :mod:`graphdeck.store.traces`' ingest.

:class:`EventRows` is a mixin of the ingest (``_Ingest``): it turns each item of ``traceEvents``
into a row of its batch (see :mod:`graphdeck.store.trace_write` for the row's shape) or a count,
with every skip counted and ``strict`` failing on any. :meth:`EventRows._event` takes one event
from any reading; :meth:`EventRows._chunk` takes a chunk of the chunked orjson reading (NOTE:
[Chunked orjson reading] in :mod:`graphdeck.store.trace_fast`) with the common shape inline and
everything else through ``_event``, so both give the same rows and counters;
:func:`summary_line` says those counters in one line.

The ingest provides the attributes these methods read and update: ``events_total``, ``stored``,
``by_ph``, ``skips``, ``counts``, ``batch``, ``new_strings``, ``unresolved``, ``string_ids``,
``lane_ids``, ``lanes``, ``base_inline``, ``base_from_peek``, ``peek``, ``min_ts``, ``max_end``,
``st`` (a :class:`~graphdeck.store.trace_json.Scan`), ``fast``, ``strict`` and ``name``.
"""

from __future__ import annotations

import gc
import math
import operator
import threading
from decimal import Decimal
from typing import Any

import orjson

from graphdeck.errors import BadInputError
from graphdeck.store.trace_fast import FLOAT_EXACT_US, Chunk, Inexact
from graphdeck.store.trace_json import (
    ARGS_MAX_CHARS,
    INT64_MAX,
    INT64_MIN,
    as_int64,
    dump_args,
    dumps,
    lane_id,
    to_ns,
)

#: Phases stored as rows; everything else is only counted.
STORED_PH = frozenset({"X", "i", "I"})
#: NOTE: [Forward-backward flows] Kineto links each backward op (``autograd::engine::evaluate_function:
#: AddmmBackward0``) to the forward op that made its autograd node with a flow of category
#: ``fwdbwd`` (``s`` at the forward op, ``f`` with ``bp: "e"`` at the backward op, same ``id``);
#: the forward op's args carry no sequence number to match by, so these two phases of that
#: category are kept as rows (``ph`` ``s`` / ``f``, ``dur_ns`` 0, the flow id in ``correlation``;
#: ``stats["fwdbwd_flows"]``): what :mod:`graphdeck.analysis.traces.backward` attributes backward
#: time to forward modules with. Every other flow is only counted.
FWDBWD = "fwdbwd"
#: At most this many process / thread names are kept from ``M`` events.
MAX_LANE_NAMES = 10_000
_NO_MIN, _NO_MAX = INT64_MAX + 1, INT64_MIN - 1  # min/max of no event yet
_FIELD_NAMES = ("ts", "dur", "name", "cat", "pid", "tid", "args")
_FIELDS = operator.itemgetter(*_FIELD_NAMES)
_STRICT_INT = orjson.OPT_STRICT_INTEGER  # dumping raises on integers past 53 bits
_TWO_63 = float(2**63)


def _check_floats(obj: dict, chunk: Chunk) -> None:
    """Make this orjson-read event read by :meth:`_Ingest._event` as its decimal text would be
    (NOTE: [Chunked orjson reading]): a ``ts`` / ``dur`` whose float :func:`to_ns` would round
    differently becomes the exact ``Decimal``; :class:`Inexact` where that cannot be known."""
    for key in ("ts", "dur"):
        value = obj.get(key)
        if type(value) is float:
            n = chunk.ns(value)
            if n != round(value * 1000):
                obj[key] = Decimal(n).scaleb(-3)
    for key in ("pid", "tid", "name", "cat"):
        if type(obj.get(key)) is float:
            raise Inexact(f"{key} {obj.get(key)!r}")
    if _huge_float(obj):
        raise Inexact("a number past 2**63: orjson may have read an integer as a float")


def _huge_float(value: Any) -> bool:
    """Whether a float of magnitude >= 2**63 is in ``value``: orjson reads integers below -2**63
    or above 2**64 - 1 as floats, which the exact readers keep as integers. Walked with a list,
    not recursion: args nested hundreds deep are data, not a RecursionError."""
    todo = [value]
    pop, push = todo.pop, todo.extend
    while todo:
        item = pop()
        kind = type(item)
        if kind is float:
            if not -_TWO_63 < item < _TWO_63:
                return True
        elif kind is dict:
            push(item.values())
        elif kind is list:
            push(item)
    return False


#: Numbers of a ``[memory]`` event that the measured-memory reader turns into integers.
_MEMORY_NUMBERS = ("Bytes", "Total Allocated", "Total Reserved")


def _memory_args_ok(args: Any) -> bool:
    """Whether a ``[memory]`` event's args can be read as measured memory: an object whose
    ``Bytes``, ``Total Allocated`` and ``Total Reserved`` (each optional; ``Bytes`` may be null)
    are finite numbers or integer text. Anything else is skipped (``skipped_bad_memory``)."""
    if args is None:
        return True
    if type(args) is not dict:
        return False
    for key in _MEMORY_NUMBERS:
        if key not in args:
            continue
        value = args[key]
        kind = type(value)
        if kind is int or kind is bool or (value is None and key == "Bytes"):
            continue
        if kind is float or kind is Decimal:
            if not math.isfinite(float(value)):
                return False
            continue
        if kind is not str:
            return False
        try:
            int(value)
        except ValueError:
            return False
    return True


def _wide_int_args(args: dict, st) -> bytes | None:
    """``args`` with top-level integers past int64 as text (counted in ``st.big_ints``, as the
    exact readers keep them), dumped; None when orjson cannot dump it."""
    for k, v in args.items():
        if type(v) is int and not INT64_MIN <= v <= INT64_MAX:
            args[k] = str(v)
            st.big_ints += 1
    try:
        return orjson.dumps(args)
    except TypeError:
        return None


class EventRows:
    """Per-event methods of the ingest (see the module docstring)."""

    def _skip(self, reason: str, index: int, detail: str) -> None:
        self.skips[reason] += 1
        if self.strict:
            raise BadInputError(
                f"trace {self.name!r}: event #{index} {detail} (strict mode drops nothing)",
                file=self.name, reason=reason, event_index=index,
            )

    def _event(self, obj: Any) -> None:
        index = self.events_total
        self.events_total += 1
        if type(obj) is not dict:
            return self._skip("skipped_not_object", index, f"is a JSON {type(obj).__name__}, not an object")
        ph = obj.get("ph")
        if not isinstance(ph, str):
            return self._skip("skipped_missing_ph", index, "has no string 'ph'")
        self.by_ph[ph] += 1
        flow = (ph == "s" or ph == "f") and obj.get("cat") == FWDBWD
        if ph not in STORED_PH and not flow:
            if ph == "M":
                self._metadata_event(obj)
            return None
        ts = obj.get("ts")
        if ts is None:
            return self._skip("skipped_missing_ts", index, "has no 'ts'")
        try:
            ts_ns = to_ns(ts)
        except ValueError:
            return self._skip("skipped_bad_ts", index, f"has a non-numeric 'ts' {str(ts)[:40]!r}")
        dur_ns = 0
        if ph == "X":
            dur = obj.get("dur")
            if dur is None:
                self.counts["missing_dur"] += 1
            else:
                try:
                    dur_ns = to_ns(dur)
                except ValueError:
                    return self._skip("skipped_bad_dur", index, f"has a non-numeric 'dur' {str(dur)[:40]!r}")
        if self.base_inline is None:
            self._init_base()
        ts_ns += self.base_inline
        end_ns = ts_ns + dur_ns
        if not (INT64_MIN <= ts_ns <= INT64_MAX and INT64_MIN <= end_ns <= INT64_MAX):
            return self._skip("skipped_bad_ts", index, "has a 'ts' or 'dur' beyond int64 nanoseconds")
        args = obj.get("args")
        if obj.get("name") == "[memory]" and not _memory_args_ok(args):
            return self._skip("skipped_bad_memory", index, "is a [memory] event whose Bytes / Total Allocated / "
                                                           "Total Reserved is not a number")
        corr = None
        args_json = None
        if args is not None:
            if type(args) is dict:
                if self.fast:  # the C parser keeps integers past int64 as ints: text, as the token path does
                    for k, v in args.items():
                        if type(v) is int and not INT64_MIN <= v <= INT64_MAX:
                            args[k] = str(v)
                            self.st.big_ints += 1
                c = args.get("correlation")
                if c is None:
                    c = args.get("External id", args.get("external id"))
                if c is not None:
                    corr = as_int64(c)
            args_json, cut = dump_args(args)
            self.counts["args_truncated"] += cut
        if flow:  # NOTE: [Forward-backward flows]: the flow id in ``correlation``
            corr = as_int64(obj.get("id")) if isinstance(obj.get("id"), (int, str)) else None
            self.counts["fwdbwd_flows"] += 1
            self.counts["fwdbwd_" + ph] += 1
        name = obj.get("name")
        if not isinstance(name, str):
            name = "" if name is None else dumps(name)
        cat = obj.get("cat")
        if cat is not None and not isinstance(cat, str):
            cat = dumps(cat)
        if self.min_ts is None or ts_ns < self.min_ts:
            self.min_ts = ts_ns
        if self.max_end is None or end_ns > self.max_end:
            self.max_end = end_ns
        self.stored += 1
        name_id = self.string_ids.get(name)
        cat_id = None if cat is None else self.string_ids.get(cat)
        if name_id is None or (cat_id is None and cat is not None):
            self.unresolved.append(len(self.batch))
            if name_id is None:
                name_id = name
                self.new_strings.add(name)
            if cat_id is None and cat is not None:
                cat_id = cat
                self.new_strings.add(cat)
        self.batch.append((ph, name_id, cat_id, ts_ns, dur_ns, lane_id(obj.get("pid")), lane_id(obj.get("tid")), corr, args_json))
        return None

    def _chunk(self, chunk: Chunk) -> None:
        """Every event of one parsed chunk (NOTE: [Chunked orjson reading]), exactly as
        :meth:`_event` would take it: the common shape (a stored event with numeric ``ts`` /
        ``dur``, string name and category, object args) inline, anything else through
        :meth:`_event`, after checking that orjson's floats read like the exact decimals."""
        ids_get, new_strings, lanes, unresolved = self.string_ids.get, self.new_strings, self.lane_ids, self.unresolved
        batch, by_ph, counts = self.batch, self.by_ph, self.counts
        append = batch.append
        base, lim, odumps, st = self.base_inline, FLOAT_EXACT_US, orjson.dumps, self.st
        events, ns = chunk.events, chunk.ns
        n, stored = self.events_total, self.stored
        lo = _NO_MIN if self.min_ts is None else self.min_ts
        hi = _NO_MAX if self.max_end is None else self.max_end
        n_x = n_i = n_cap_i = 0
        for obj in events:
            try:
                ph = obj["ph"]
            except (KeyError, TypeError):
                ph = None
            if ph != "X" and ph != "i" and ph != "I":
                if type(ph) is str and ph != "M" and not ((ph == "s" or ph == "f") and obj.get("cat") == FWDBWD):
                    # flows, counters, ...: only counted (forward-backward flows are kept: _event)
                    by_ph[ph] += 1
                    n += 1
                    continue
            else:
                try:  # one C call for the usual fields; the absent ones are None, as with .get
                    ts, dur, name, cat, pid, tid, args = _FIELDS(obj)
                except KeyError:
                    ts, dur, name, cat, pid, tid, args = map(obj.get, _FIELD_NAMES)
                kind = type(ts)
                if kind is float:
                    if -lim < ts < lim:  # round(1e308 * 1000) would overflow: ns() says Inexact
                        t = round(ts * 1000)
                        if t / 1000 != ts:
                            t = ns(ts)
                    else:
                        t = ns(ts)
                elif kind is int:
                    t = ts * 1000
                else:
                    t = None
                d = 0
                if ph == "X":
                    kind = type(dur)
                    if kind is float:
                        if -lim < dur < lim:  # round(1e308 * 1000) would overflow: ns() says Inexact
                            d = round(dur * 1000)
                            if d / 1000 != dur:
                                d = ns(dur)
                        else:
                            d = ns(dur)
                    elif kind is int:
                        d = dur * 1000
                    else:
                        t = None
                if t is not None and base is not None and type(name) is str and (cat is None or type(cat) is str) \
                        and (args is None or type(args) is dict) \
                        and (name != "[memory]" or _memory_args_ok(args)):
                    t += base
                    e = t + d
                    if INT64_MIN <= t <= INT64_MAX and INT64_MIN <= e <= INT64_MAX:
                        kind = type(pid)
                        p = lanes.get(pid) if kind is int or kind is str else None
                        if p is None:
                            if kind is float:
                                raise Inexact(f"pid {pid!r}")
                            p = lane_id(pid)
                            if kind is int or kind is str:
                                lanes[pid] = p
                        kind = type(tid)
                        q = lanes.get(tid) if kind is int or kind is str else None
                        if q is None:
                            if kind is float:
                                raise Inexact(f"tid {tid!r}")
                            q = lane_id(tid)
                            if kind is int or kind is str:
                                lanes[tid] = q
                        corr = args_json = None
                        if args is not None:
                            c = args.get("correlation")
                            if c is None:
                                c = args.get("External id", args.get("external id"))
                            if c is not None:
                                corr = c if type(c) is int and INT64_MIN <= c <= INT64_MAX else as_int64(c)
                            try:  # integers within 53 bits; past that, the careful way
                                raw = odumps(args, option=_STRICT_INT)
                            except TypeError:
                                raw = _wide_int_args(args, st)
                            if raw is not None and b"e+" in raw and _huge_float(args):
                                raise Inexact("a number past 2**63 in args: orjson may have read an integer as a float")
                            if raw is not None and len(raw) <= ARGS_MAX_CHARS:
                                args_json = raw.decode()
                            else:
                                args_json, cut = dump_args(args)
                                counts["args_truncated"] += cut
                        name_id = ids_get(name)
                        cat_id = None if cat is None else ids_get(cat)
                        if name_id is None or (cat_id is None and cat is not None):
                            unresolved.append(len(batch))
                            if name_id is None:
                                name_id = name
                                new_strings.add(name)
                            if cat_id is None and cat is not None:
                                cat_id = cat
                                new_strings.add(cat)
                        append((ph, name_id, cat_id, t, d, p, q, corr, args_json))
                        if t < lo:
                            lo = t
                        if e > hi:
                            hi = e
                        stored += 1
                        n += 1
                        if ph == "X":
                            n_x += 1
                        elif ph == "i":
                            n_i += 1
                        else:
                            n_cap_i += 1
                        continue
            # anything else: the general path, with the counters handed over and back
            if type(obj) is dict:
                _check_floats(obj, chunk)
            self.events_total, self.stored = n, stored
            self.min_ts, self.max_end = (None if lo == _NO_MIN else lo), (None if hi == _NO_MAX else hi)
            self._event(obj)
            n, stored, base = self.events_total, self.stored, self.base_inline
            lo = _NO_MIN if self.min_ts is None else self.min_ts
            hi = _NO_MAX if self.max_end is None else self.max_end
        self.events_total, self.stored = n, stored
        self.min_ts, self.max_end = (None if lo == _NO_MIN else lo), (None if hi == _NO_MAX else hi)
        for ph, k in (("X", n_x), ("i", n_i), ("I", n_cap_i)):
            if k:
                by_ph[ph] += k

    def _init_base(self) -> None:
        """The base added to every ``ts_ns`` as rows are built (NOTE: [Trace time base])."""
        base = as_int64(self.st.meta.get("baseTimeNanoseconds"))
        if base is None and self.peek is not None:
            peeked = self.peek()
            if peeked:
                base, self.base_from_peek = peeked, True
        self.base_inline = base or 0

    def _metadata_event(self, obj: dict) -> None:
        args = obj.get("args")
        value = args.get("name") if isinstance(args, dict) else None
        kind = obj.get("name")
        pid = lane_id(obj.get("pid"))
        if kind == "process_labels" and isinstance(args, dict):
            table, key, value = self.lanes["process_labels"], pid, args.get("labels")
        elif kind == "process_name":
            table, key = self.lanes["process_names"], pid
        elif kind == "thread_name":
            table, key = self.lanes["thread_names"], f"{pid}/{lane_id(obj.get('tid'))}"
        else:
            return
        if isinstance(value, str) and (key in table or len(table) < MAX_LANE_NAMES):
            table[key] = value


_GC_LOCK = threading.Lock()
_gc_pausers = [0, False]  # ingests in the loop now, whether the collector was on when the first began


def gc_paused(fn, *args):
    """``fn(*args)`` with Python's cyclic garbage collector paused (NOTE: [Ingest without the
    cyclic collector]).

    # NOTE: [Ingest without the cyclic collector]
    The parse-and-write loop makes, per event, a parsed dict (orjson), a row tuple and strings:
    no reference cycle, so the collector's passes over them (gen 0 every 700 allocations, and
    five full passes over every live object during the 239k-event xdit trace) free nothing; they
    were ~0.1–0.2 of its ~1.8 CPU s (issue 41). Paused for the loop only; the post-ingest
    analyses run with it as it was. Ingests in threads of one process (the server) share the
    pause: the first one in turns it off, the last one out turns it back on if it was on, also
    when the loop raises."""
    with _GC_LOCK:
        if _gc_pausers[0] == 0:
            _gc_pausers[1] = gc.isenabled()
            gc.disable()
        _gc_pausers[0] += 1
    try:
        return fn(*args)
    finally:
        with _GC_LOCK:
            _gc_pausers[0] -= 1
            if _gc_pausers[0] == 0 and _gc_pausers[1]:
                gc.enable()


def summary_line(stats: dict) -> str:
    """One line saying what an ingest kept, what it read but does not store by design (metadata,
    flows, counters, begin/end pairs: per phase) and what it dropped or repaired (only non-zero
    counters), from :class:`~graphdeck.store.traces.IngestResult` ``stats``; e.g. ``kept 9,308
    events (X 9,000, i 308); not stored by design: 4,932 (M 120, f 2,406, s 2,406); dropped: none``."""
    by_ph = stats.get("by_ph") or {}
    kept = {ph: n for ph, n in by_ph.items() if ph in STORED_PH and n}
    other = {ph: n for ph, n in by_ph.items() if ph not in STORED_PH and n}
    if stats.get("fwdbwd_flows"):  # NOTE: [Forward-backward flows]: kept, with the events
        kept["fwdbwd flows"] = stats["fwdbwd_flows"]
        other = {ph: n - (stats.get(f"fwdbwd_{ph}") or 0) for ph, n in other.items()}
        other = {ph: n for ph, n in other.items() if n}

    def parts(d: dict) -> str:
        return ", ".join(f"{ph} {n:,}" for ph, n in sorted(d.items()))

    line = f"kept {stats.get('stored', sum(kept.values())):,} events" + (f" ({parts(kept)})" if kept else "")
    if other:
        line += f"; not stored by design (metadata, flows, counters…): {sum(other.values()):,} ({parts(other)})"
    problems = {k: v for k, v in stats.items() if isinstance(v, int) and v and k not in (
        "events_total", "stored", "bytes_file", "bytes_json", "gpu_kernels") and (
        k.startswith(("skipped_", "repaired_", "corrupt")) or k in (
            "truncated", "trailing_garbage", "missing_dur", "args_truncated", "big_int_as_string", "meta_dropped",
            "base_time_not_applied"))}
    line += "; dropped/changed: " + (", ".join(f"{k} {v:,}" for k, v in sorted(problems.items())) if problems else "none")
    return line
