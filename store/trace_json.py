"""Reading a Kineto trace: bytes to a stream of events and top-level metadata.

The input is the Chrome Trace Event Format (the "JSON Object Format" ``{"traceEvents": [...]}``
and the "JSON Array Format" ``[...]``) as PyTorch's profiler writes it through Kineto
(``torch.profiler.profile(...).export_chrome_trace``, ``tensorboard_trace_handler``), plain or
gzip-compressed. The format is described in Google's "Trace Event Format" document and in
Kineto's ``libkineto/src/output_json.cpp``; the corpus of real files this is tested on is listed
in ``shared/data/traces/SOURCES.md``.

The file is read as a token stream (ijson, yajl backend) and never loaded whole:
:class:`Reader` hands out the decompressed JSON text at most ``READ_SIZE`` bytes at a time
(gzip is told by its magic bytes; a cut or corrupt gzip stream is remembered in ``Reader.cut``)
and :func:`scan_events` yields the items of ``traceEvents`` one by one. Writing them is
:mod:`graphdeck.store.traces`' job.

Top-level keys other than ``traceEvents`` (``schemaVersion``, ``distributedInfo``,
``deviceProperties``, ``baseTimeNanoseconds``, ``traceName``, ...) are collected in
``Scan.meta`` whether they come before or after the events; a value larger than
:data:`META_MAX_TOKENS` JSON tokens is replaced by a marker and counted in
``Scan.meta_dropped``.

Units: Kineto's ``ts`` and ``dur`` are microseconds, ints or decimals (``123.456``); they are
parsed as exact decimals and stored as int64 nanoseconds, ``round(ts * 1000)`` (half to even;
:func:`to_ns`). See ``NOTE: [Trace time base]`` in :mod:`graphdeck.store.traces` for
``baseTimeNanoseconds``. ``pid`` / ``tid`` are stored as strings (legacy traces have tids like
``"stream 7"``; :func:`lane_id`). Integers outside int64 anywhere in an event are kept as decimal
strings (HTA's ``large_integer_trace``) and counted in ``Scan.big_ints``.
"""

from __future__ import annotations

import io
import json
import math
import re
import zlib
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, BinaryIO

import ijson
import orjson

try:  # ISA-L's inflate (pip isal): zlib's API, about 3x faster on these traces
    from isal import isal_zlib as _inflate_lib
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    _inflate_lib = zlib

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: A top-level metadata value with more JSON tokens than this is dropped (``meta_dropped``).
META_MAX_TOKENS = 200_000
#: ``args_json`` longer than this is shortened value by value (``args_truncated``).
ARGS_MAX_CHARS = 8192
#: One args value is cut to this many characters, then ``…[total_len=N]``.
ARG_VALUE_MAX_CHARS = 1024
READ_SIZE = 64 * 1024
_GZIP_MAGIC = b"\x1f\x8b"
_UTF8_BOM = b"\xef\xbb\xbf"
_TOO_LARGE = object()
#: What a corrupt deflate stream raises.
INFLATE_ERRORS = (zlib.error, _inflate_lib.error)


def gzip_inflater(fast: bool = True):
    """A decompressor for one gzip member (``wbits=31``): zlib's ``decompressobj`` API.

    ``fast`` picks ISA-L's. It holds back the last partial block of a cut stream, which zlib
    hands out, so the reading that reports truncation (the token path) takes zlib's: a cut file
    then keeps every event zlib can recover. The fast readings give up on a cut stream anyway.
    """
    return (_inflate_lib if fast else zlib).decompressobj(wbits=31)


# ---------------------------------------------------------------------------- reading bytes


class Reader:
    """``read(n)`` over the decompressed JSON text of ``raw``, counting bytes on both sides.

    gzip is decoded with zlib's inflate directly (not :class:`gzip.GzipFile`, whose buffered
    reads drop the last partial block when the stream is cut), or ISA-L's with ``fast_inflate``
    (:func:`gzip_inflater`), one member after another, at most ``n`` bytes at a time. A stream that is cut or corrupt reads as end-of-file and is remembered
    in ``cut``; the JSON parser then reports a premature end, which becomes a truncation.
    """

    def __init__(self, raw: BinaryIO, fast_inflate: bool = False):
        self._fast_inflate = fast_inflate
        self._raw = raw
        self._pending = raw.read(READ_SIZE)  # sniffed for the gzip magic, then handed out first
        if not isinstance(self._pending, bytes):
            raise TypeError("ingest_trace needs a binary file object (open(path, 'rb'))")
        self.file_bytes = len(self._pending)  # bytes read from ``raw``
        self.gzip = self._pending[:2] == _GZIP_MAGIC
        self._z = gzip_inflater(fast_inflate) if self.gzip else None
        self.offset = 0  # bytes of JSON text handed to the parser
        self.eof = False
        self.cut: str | None = None

    def _read_raw(self, size: int) -> bytes:
        if self._pending:
            data, self._pending = self._pending[:size], self._pending[size:]
            return data
        data = self._raw.read(size)
        self.file_bytes += len(data)
        return data

    def read(self, size: int = -1) -> bytes:
        if size == 0:  # ijson probes with read(0) for bytes vs str
            return b""
        size = size if size is not None and size > 0 else READ_SIZE
        data = self._inflate(size) if self.gzip else self._read_raw(size)
        if self.offset == 0 and data.startswith(_UTF8_BOM):
            self.offset, data = len(_UTF8_BOM), data[len(_UTF8_BOM) :]
        self.offset += len(data)
        self.eof = not data
        return data

    def _inflate(self, size: int) -> bytes:
        z = self._z
        try:
            while True:
                if z.unconsumed_tail:
                    data = z.decompress(z.unconsumed_tail, size)
                elif z.eof:  # end of a member: another may follow (NUL padding is skipped)
                    rest = z.unused_data.lstrip(b"\0")
                    while not rest:
                        more = self._read_raw(READ_SIZE)
                        if not more:
                            return b""
                        rest = more.lstrip(b"\0")
                    z = self._z = gzip_inflater(self._fast_inflate)
                    data = z.decompress(rest, size)
                else:
                    chunk = self._read_raw(READ_SIZE)
                    if not chunk:
                        self.cut = "the gzip stream ends before its end-of-stream marker"
                        return b""
                    data = z.decompress(chunk, size)
                if data:
                    return data
        except INFLATE_ERRORS as exc:
            self.cut = f"the gzip data is corrupt ({exc})"
            return b""


# ---------------------------------------------------------------------------- token stream


@dataclass
class Scan:
    """What the token scan learnt besides the events themselves."""

    form: str | None = None  # "object", "array", or the JSON type of a scalar
    has_events: bool = False  # saw a traceEvents array (or the array form)
    events_not_array: str | None = None
    complete: bool = False  # the top-level value closed
    keys: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    meta_dropped: int = 0
    big_ints: int = 0


def scan_events(tokens, st: Scan):
    """Yield each item of ``traceEvents`` (or of a top-level array) as a Python value; record
    every other top-level key in ``st.meta``. ``tokens`` are ijson ``basic_parse`` events."""
    it = iter(tokens)
    in_events = False
    top_key = None
    for ev, val in it:
        if in_events:
            if ev == "start_map":
                yield _build(it, {}, st, None)
            elif ev == "end_array":
                in_events = False
                if st.form == "array":
                    st.complete = True
            elif ev == "start_array":
                yield _build(it, [], st, None)
            else:
                yield _scalar(ev, val, st)
        elif st.form is None:
            if ev == "start_map":
                st.form = "object"
            elif ev == "start_array":
                st.form = "array"
                st.has_events = in_events = True
            else:
                st.form = ev
                st.complete = True
        elif ev == "map_key":
            top_key = val
            if len(st.keys) < 1000:
                st.keys.append(val)
        elif ev == "end_map":
            st.complete = True
        elif top_key == "traceEvents" and ev == "start_array" and not st.has_events:
            st.has_events = in_events = True
        else:
            if top_key == "traceEvents":
                st.events_not_array = ev
            if ev == "start_map" or ev == "start_array":
                value = _build(it, {} if ev == "start_map" else [], st, META_MAX_TOKENS)
                if value is _TOO_LARGE:
                    st.meta_dropped += 1
                    value = f"…[dropped: more than {META_MAX_TOKENS} JSON tokens]"
            else:
                value = _scalar(ev, val, st)
            st.meta[top_key] = value


def _scalar(ev: str, val: Any, st: Scan) -> Any:
    if ev == "number" and type(val) is int and not INT64_MIN <= val <= INT64_MAX:
        st.big_ints += 1
        return str(val)
    return val


def _build(it, root, st: Scan, budget: int | None):
    """Build the container opened by the token just read; ``_TOO_LARGE`` past ``budget`` tokens."""
    stack = [root]
    key = None
    n = 0
    for ev, val in it:
        if budget is not None:
            n += 1
            if n > budget:
                return _skip(it, ev, len(stack))
        if ev == "map_key":
            key = val
            continue
        if ev == "end_map" or ev == "end_array":
            stack.pop()
            if not stack:
                return root
            continue
        top = stack[-1]
        if ev == "start_map" or ev == "start_array":
            value = {} if ev == "start_map" else []
            stack.append(value)
        elif ev == "number" and type(val) is int and not INT64_MIN <= val <= INT64_MAX:
            st.big_ints += 1
            value = str(val)
        else:
            value = val
        if type(top) is dict:
            top[key] = value
        else:
            top.append(value)
    return root  # unreachable on valid input: ijson raises on a premature end


def _skip(it, ev: str, depth: int):
    depth += (ev == "start_map" or ev == "start_array") - (ev == "end_map" or ev == "end_array")
    while depth:
        ev, _ = next(it)
        depth += (ev == "start_map" or ev == "start_array") - (ev == "end_map" or ev == "end_array")
    return _TOO_LARGE

# ---------------------------------------------------------------------------- values


#: A ``ts`` / ``dur`` of this many µs or more is past int64 nanoseconds whatever the time base:
#: :func:`to_ns` answers ±``BEYOND_US * 1000`` for it (the ingest then skips the event, counted)
#: instead of computing ``1e308 * 1000`` (a float overflow) or a Decimal's thousand-digit integer.
BEYOND_US = 10**19


def to_ns(value: Any) -> int:
    """µs (int or decimal) → int ns, rounded half to even; ``ValueError`` for anything else.
    A magnitude of :data:`BEYOND_US` or more gives ±``BEYOND_US * 1000`` (past int64 either way)."""
    t = type(value)
    if t is int:
        return value * 1000
    if (t is Decimal and value.is_finite()) or (t is float and math.isfinite(value)):
        if not -BEYOND_US < value < BEYOND_US:
            return BEYOND_US * 1000 if value > 0 else -BEYOND_US * 1000
        return round(value * 1000)
    raise ValueError(value)


def as_int64(value: Any) -> int | None:
    if type(value) is int:
        return value if INT64_MIN <= value <= INT64_MAX else None
    if isinstance(value, str) and value.lstrip("-").isdigit():
        n = int(value)
        return n if INT64_MIN <= n <= INT64_MAX else None
    return None


def lane_id(value: Any) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= 64 else text[:63] + "…"


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):  # ijson's non-integer numbers; beyond float range as text
        f = float(value)
        return f if math.isfinite(f) else str(value)
    return str(value)


_ENCODER = json.JSONEncoder(default=_json_default, ensure_ascii=False, separators=(",", ":"))
dumps = _ENCODER.encode


def _fast_dumps(value: Any) -> str:
    """:func:`dumps` through orjson (several times faster); the stdlib encoder where orjson
    refuses (integers past 64 bits, non-string keys)."""
    try:
        return orjson.dumps(value, default=_json_default).decode()
    except TypeError:
        return dumps(value)


def dump_args(args: Any) -> tuple[str, bool]:
    """``args`` as JSON; giant values cut to ``…[total_len=N]``. Returns (text, was_truncated)."""
    text = _fast_dumps(args)
    if len(text) <= ARGS_MAX_CHARS:
        return text, False
    if not isinstance(args, dict):
        return dumps(text[:ARGS_MAX_CHARS] + f"…[total_len={len(text)}]"), True
    short: dict[str, Any] = {}
    used = 0
    for i, (k, v) in enumerate(args.items()):
        part = v if isinstance(v, str) else dumps(v)
        if len(part) > ARG_VALUE_MAX_CHARS:
            v = part[:ARG_VALUE_MAX_CHARS] + f"…[total_len={len(part)}]"
            part = v
        used += len(k) + len(part) + 6
        if used > ARGS_MAX_CHARS:
            short["…"] = f"[{len(args) - i} more keys, total_len={len(text)}]"
            break
        short[k] = v
    return dumps(short), True


# ---------------------------------------------------------------------------- repair mode

_STRING_SPECIAL = re.compile(rb'["\\\x00-\x1f\x80-\xff]')
_VALID_ESCAPE = frozenset(b'"\\/bfnrtu')
_CLOSERS = frozenset(b",:}]")
_VALUE_CLOSERS = frozenset(b",}]")  # after "key": a value string ends before , } ]
_KEY_CLOSERS = frozenset(b":")  # after {: a key ends before :
_WS = b" \t\r\n"


class _FilterReader:
    """Base of the repair-mode filters below: ``read(n)`` (ijson's reader protocol) over
    ``inner``'s JSON text as a subclass transforms it. ``_process(buf, final)`` appends output to
    ``self._out`` and returns how many input bytes it consumed (``self._base`` counts the bytes
    consumed before ``self._buf``); ``_at_end()`` runs once the input is exhausted."""

    def __init__(self, inner):
        self.inner = inner
        self._buf = b""
        self._out = bytearray()
        self._eof = False
        self._base = 0

    def read(self, size: int = -1) -> bytes:
        if size == 0:
            return b""
        size = size if size and size > 0 else READ_SIZE
        while len(self._out) < size and not (self._eof and not self._buf):
            self._fill()
        data = bytes(self._out[:size])
        del self._out[:size]
        return data

    def _fill(self) -> None:
        if not self._eof:
            more = self.inner.read(READ_SIZE)
            if more:
                self._buf += more
            else:
                self._eof = True
        done = self._process(self._buf, self._eof)
        self._base += done
        self._buf = self._buf[done:]
        if self._eof:
            self._at_end()

    def _process(self, buf: bytes, final: bool) -> int:
        raise NotImplementedError

    def _at_end(self) -> None:
        raise NotImplementedError

    def __getattr__(self, name):  # offset, eof, cut, gzip, file_bytes of the inner reader
        if name in ("offset", "eof", "cut", "gzip", "file_bytes"):
            return getattr(self.inner, name)
        raise AttributeError(name)


class RepairingReader(_FilterReader):
    """``read(n)`` over another reader's JSON text with broken strings repaired (repair mode).

    # NOTE: [String repair]
    Trace writers have emitted names that make a whole file invalid JSON: a bare ``"`` inside a
    name, raw control bytes and raw newlines, Windows paths with raw backslashes, and bytes that
    are not UTF-8 (shared/cases/traces.md, T2–T4). Inside each JSON string this filter:
    escapes a ``"`` whose next non-blank byte cannot follow the string (``, } ]`` after a value
    string, ``:`` after a key, either after ``,``) — ``repaired_quotes``; escapes a backslash that does not start a valid escape
    — ``repaired_backslashes``; writes raw bytes below 0x20 as ``\\u00XX`` —
    ``repaired_control_bytes``; and replaces invalid UTF-8 with U+FFFD — ``repaired_utf8``.
    ``counts["repaired_strings"]`` counts strings changed. Text outside strings passes unchanged.
    It runs in Python, a byte class at a time, so it is used only after the fast path met a
    syntax error (see :mod:`graphdeck.store.traces`).
    """

    def __init__(self, inner):
        super().__init__(inner)
        self.counts: dict[str, int] = {"repaired_strings": 0, "repaired_quotes": 0, "repaired_backslashes": 0,
                                       "repaired_control_bytes": 0, "repaired_utf8": 0}

    def _at_end(self) -> None:
        if self._buf:  # an unterminated string at the end: hand it over as is
            self._out += self._buf
            self._buf = b""

    def _process(self, buf: bytes, final: bool) -> int:
        """Repair what can be decided in ``buf``; returns how many bytes were consumed."""
        pos, n, out = 0, len(buf), self._out
        while pos < n:
            q = buf.find(b'"', pos)
            if q < 0:
                out += buf[pos:]
                return n
            out += buf[pos : q + 1]
            k = len(out) - 2
            while k >= 0 and out[k] in _WS:
                k -= 1
            before = out[k] if k >= 0 else 0
            closers = _VALUE_CLOSERS if before == 0x3A else _KEY_CLOSERS if before == 0x7B else _CLOSERS
            end = self._string_end(buf, q + 1, final, closers)
            if end is None:  # the string (or the look-ahead after a quote) continues past buf
                del out[len(out) - 1 :]
                return q
            out += self._repair(buf[q + 1 : end])
            out += b'"'
            pos = end + 1
        return n

    def _string_end(self, buf: bytes, start: int, final: bool, closers: frozenset = _CLOSERS) -> int | None:
        """Index of the quote that closes the string starting at ``start``, or None (need more)."""
        i, n = start, len(buf)
        while True:
            m = _STRING_SPECIAL.search(buf, i)
            if m is None:
                return None
            j = m.start()
            c = buf[j]
            if c == 0x5C:  # backslash: skip the escaped byte when it is a valid escape
                if j + 1 >= n:
                    return None
                i = j + 2 if buf[j + 1] in _VALID_ESCAPE else j + 1
                continue
            if c != 0x22:
                i = j + 1
                continue
            k = j + 1
            while k < n and buf[k] in _WS:
                k += 1
            if k >= n:
                return j if final else None
            if buf[k] in closers:
                return j
            i = j + 1  # a bare quote inside the string

    def _repair(self, raw: bytes) -> bytes:
        if not _STRING_SPECIAL.search(raw):
            return raw
        changed = False
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", "replace")
            self.counts["repaired_utf8"] += 1
            changed = True
        out = []
        i, n = 0, len(text)
        while i < n:
            ch = text[i]
            if ch == "\\":
                nxt = text[i + 1] if i + 1 < n else ""
                if nxt and nxt in '"\\/bfnrt':
                    out.append(text[i : i + 2])
                    i += 2
                    continue
                if nxt == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", text[i + 2 : i + 6] or ""):
                    out.append(text[i : i + 6])
                    i += 6
                    continue
                out.append("\\\\")
                self.counts["repaired_backslashes"] += 1
                changed = True
            elif ch == '"':
                out.append('\\"')
                self.counts["repaired_quotes"] += 1
                changed = True
            elif ord(ch) < 0x20:
                out.append(f"\\u{ord(ch):04x}")
                self.counts["repaired_control_bytes"] += 1
                changed = True
            else:
                out.append(ch)
            i += 1
        self.counts["repaired_strings"] += changed
        return "".join(out).encode("utf-8")

# ---------------------------------------------------------------------------- resynchronising

_STRUCT = re.compile(rb'["{}\[\],:]')
_NEXT_OBJECT = re.compile(rb",[ \t\r\n]*\{")
_ARRAY_THEN_OBJECT_END = re.compile(rb"\][ \t\r\n]*\}\Z")
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # after an opening quote: to the closing one


class ResyncReader(_FilterReader):
    """``read(n)`` over another reader's JSON text with the items of ``traceEvents`` that are not
    JSON values dropped (repair mode), so one bad stretch does not end the reading.

    # NOTE: [Resynchronising]
    A bad token between two events (``{...}, oops, {...}``) stops a JSON parser for good, and
    everything after it would be lost. This filter splits the ``traceEvents`` array (or a
    top-level array) into its items at the ``,`` that sit at the array's own depth (brackets and
    strings tracked, a ``}`` that closes nothing at that depth is taken as part of the item), checks
    each item alone (orjson, then ijson's own parser for what orjson refuses, such as integers
    past 64 bits), passes the good ones on with fresh commas and drops the others: ``corrupt_items``
    counts them (an empty item, ``,,``, is one too; a trailing comma, ``,]``, is left for the
    parser to report, as before) and ``first_corrupt_offset`` is where
    the first began in the JSON text (bytes). An item still open at the end of the input is handed
    over as is, so a cut file still reads as truncated. Text outside the events passes unchanged.
    Python byte scanning, used only on the repair path.
    """

    def __init__(self, inner):
        super().__init__(inner)
        self.corrupt_items = 0
        self.first_corrupt_offset: int | None = None
        self._depth = 0
        self._events_depth: int | None = None  # depth inside the events array while in it
        self._events_done = False
        self._last_str = b""
        self._key: bytes | None = None  # the top-level key whose value comes next
        self._item = bytearray()
        self._item_start = 0
        self._emitted = False  # an item of the current array went out
        self._commas = 0
        self._started = False  # a structural byte came at the top level

    def _at_end(self) -> None:
        if self._buf:
            self._take(self._buf)
            self._base += len(self._buf)
            self._buf = b""
        while self._events_depth is not None and self._resplit():
            pass
        if self._events_depth is not None:  # an item open at the end: as is (a cut)
            if self._item.strip(_WS) or self._commas:
                self._out += (b"," if self._emitted else b"") + self._item
            self._item = bytearray()
            self._events_depth = None

    def _take(self, data: bytes, at: int = 0) -> None:
        if self._events_depth is not None:
            if not self._item:
                self._item_start = self._base + at
            self._item += data
        else:
            self._out += data

    def _process(self, buf: bytes, final: bool) -> int:
        pos, n = 0, len(buf)
        while True:
            m = _STRUCT.search(buf, pos)
            if m is None:
                self._take(buf[pos:], pos)
                return n
            i = m.start()
            if i > pos:
                self._take(buf[pos:i], pos)
            c = buf[i]
            if c == 0x22:  # "
                sm = _STRING_REST.match(buf, i + 1)
                if sm is None:
                    if not final:
                        return i
                    self._take(buf[i:], i)
                    return n
                s = buf[i : sm.end()]
                self._take(s, i)
                if self._depth == 1 and self._events_depth is None:
                    self._last_str = s
                pos = sm.end()
                continue
            pos = i + 1
            ed = self._events_depth
            if ed is not None:
                if self._depth == ed and c in (0x2C, 0x5D):  # , or ] at the array's depth
                    self._end_item(closing=c == 0x5D, at=self._base + i)
                    if c == 0x5D:
                        self._out += b"]"
                        self._events_depth = None
                        self._events_done = True
                        self._depth -= 1
                    continue
                if not self._item:
                    self._item_start = self._base + i
                self._item.append(c)
                if c in (0x7B, 0x5B):
                    self._depth += 1
                elif c in (0x7D, 0x5D) and self._depth > ed:
                    self._depth -= 1
                continue
            if c == 0x5B and not self._events_done and (
                (self._depth == 0 and not self._started)
                or (self._depth == 1 and self._key == b'"traceEvents"')
            ):
                self._out.append(c)
                self._started = True
                self._depth += 1
                self._events_depth = self._depth
                self._emitted, self._commas = False, 0
                continue
            self._out.append(c)
            self._started = True
            if c in (0x7B, 0x5B):
                self._depth += 1
            elif c in (0x7D, 0x5D):
                self._depth = max(self._depth - 1, 0)
            elif c == 0x3A and self._depth == 1:
                self._key = self._last_str
            elif c == 0x2C and self._depth == 1:
                self._key = None

    def _resplit(self) -> bool:
        """At the end of the input an item is still open, yet the text ends as the events array
        does (``]`` or ``]}``): a bracket in a bad stretch never closed. Drop the item up to the
        next ``,`` that is followed by ``{`` (count it) and read the rest again from there."""
        item = bytes(self._item)
        tail = item.rstrip(_WS)
        if not (tail.endswith(b"]") or _ARRAY_THEN_OBJECT_END.search(tail)):
            return False
        m = _NEXT_OBJECT.search(item, 1)
        if m is None:
            return False
        self.corrupt_items += 1
        if self.first_corrupt_offset is None:
            self.first_corrupt_offset = self._item_start
        self._item = bytearray()
        self._depth = self._events_depth
        self._commas += 1
        self._base = self._item_start + m.end() - 1
        rest = item[m.end() - 1 :]
        self._process(rest, True)
        self._base += len(rest)
        return True

    def _end_item(self, *, closing: bool, at: int) -> None:
        item, self._item = bytes(self._item), bytearray()
        text = item.strip(_WS)
        if not text and closing:  # ``[]``; or a trailing comma, left for the parser to report
            if self._commas:
                self._out += b"," if self._emitted else b""
            return
        if not text:
            ok = False
        else:
            ok = _is_json_value(text)
        if not closing:
            self._commas += 1
        if ok:
            self._out += (b"," if self._emitted else b"") + item
            self._emitted = True
        elif ok is False:
            self.corrupt_items += 1
            if self.first_corrupt_offset is None:
                self.first_corrupt_offset = self._item_start if text else at

def _is_json_value(text: bytes) -> bool:
    """One JSON value, as ijson's parser would accept it (orjson first, for speed)."""
    try:
        orjson.loads(text)
        return True
    except orjson.JSONDecodeError:
        pass
    try:  # the exact reading's parser decides what orjson refuses
        for _ in ijson.basic_parse(io.BytesIO(text)):
            pass
    except ijson.JSONError:
        return False
    return True
