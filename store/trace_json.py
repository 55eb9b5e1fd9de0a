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

import json
import math
import zlib
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, BinaryIO

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


from graphdeck.store.trace_repair import RepairingReader, ResyncReader  # noqa: E402, F401 - re-exported
