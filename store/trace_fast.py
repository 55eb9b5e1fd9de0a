"""The fast readings of a Kineto trace: the events parsed in C, the top-level metadata around them.

:mod:`graphdeck.store.trace_json` holds the reading that is always right (the token stream, with
its error classification and string repair); this module holds two faster ones that give the
same events or give up. :mod:`graphdeck.store.traces` tries them in this order, and reads the
input again the next way whenever one gives up (raises :class:`NotFast`):

1. :func:`chunked_events` — the events parsed by orjson a chunk of text at a time
   (NOTE: [Chunked orjson reading]);
2. :func:`fast_events` — the events built by ijson's C ``items`` (NOTE: [Fast path]);
3. the token path, then the repair path (in :mod:`graphdeck.store.trace_json`).

Also here: :func:`peek_base_time`, which reads ``baseTimeNanoseconds`` from the end of a file
before the events are parsed.
"""

from __future__ import annotations

import io
import json
import re
from collections import deque
from decimal import Decimal

import ijson
import orjson

from graphdeck.store.trace_json import (
    INFLATE_ERRORS,
    INT64_MAX,
    INT64_MIN,
    READ_SIZE,
    Scan,
    as_int64,
    gzip_inflater,
    scan_events,
)

_GZIP_MAGIC = b"\x1f\x8b"

#: The fast path looks this far into the text for the start of ``traceEvents``.
HEAD_LIMIT = 16 * 1024 * 1024


class NotFast(Exception):
    """The fast path cannot read this input; the caller reads it again token by token."""


class NoEventsHead(NotFast):
    """No ``traceEvents`` array opens near the start: no fast reading can read this input."""


def fast_events(reader, st: Scan):
    """Yield the items of ``traceEvents`` like :func:`scan_events`, parsed by ijson's C ``items``.

    # NOTE: [Fast path]
    Building each event in Python from ``basic_parse`` tokens costs more than the rest of the
    ingest. Here the top-level keys before the events are read token by token from the head of
    the text (up to the ``[`` of ``traceEvents``); the events are built in C by ijson's
    ``items`` reading the same bytes (the pull API: twice as fast as ``items_coro`` here); the keys after the events are parsed from the text that
    follows the last event: it starts at the ``]`` that closes ``traceEvents``, the only ``]``
    after which ``{`` + the rest of the text is one JSON object (every earlier candidate leaves
    unbalanced closers). Any surprise — no ``traceEvents`` array in the first
    :data:`HEAD_LIMIT` bytes, a parser error, a tail that does not parse — raises
    :class:`NotFast` or ``ijson.JSONError``, and the caller reads the input again the slow way,
    which classifies errors (truncation, repair) precisely.
    """
    head, prefix = _read_head(reader, st)
    # the tail is searched from inside the events: an array-valued key before them
    # (``deviceProperties``) would otherwise pass for their end when the file fits in the head
    skip = _events_start(head, prefix)
    tee = _Tee(head, reader)
    last_chunk = 0
    chunks = tee.chunks
    for obj in ijson.items(tee, prefix, buf_size=READ_SIZE):
        last_chunk = len(chunks) - 1
        if last_chunk > 64:  # only the chunks from the last event's on are ever needed
            del chunks[:last_chunk]
            last_chunk, skip = 0, 0
        yield obj
    if reader.cut:
        raise NotFast(reader.cut)
    _tail_meta(b"".join(tee.chunks[last_chunk:])[skip if last_chunk == 0 else 0 :], st)


class _Tee:
    """Serves ``head`` then ``reader``, keeping what it served in ``chunks`` (trimmed by the caller)."""

    def __init__(self, head: bytes, reader):
        self.pending = head
        self.reader = reader
        self.chunks: list[bytes] = []

    def read(self, size: int = -1) -> bytes:
        if size == 0:
            return b""
        if self.pending:
            data, self.pending = self.pending, b""
        else:
            data = self.reader.read(size)
        self.chunks.append(data)
        return data


def _read_head(reader, st: Scan) -> tuple[bytes, str]:
    """Read the text up to (and a little past) the ``[`` of the events: ``(head, prefix)``, the
    prefix being ijson's path of the events (``item`` for the JSON Array Format)."""
    parts: list[bytes] = []
    size, prefix, seen = 0, None, False
    while prefix is None:
        chunk = reader.read(READ_SIZE)
        if not chunk:
            raise NoEventsHead("no traceEvents array")
        # the head is joined and parsed only once the key can be in it (no quadratic re-joins)
        seen = seen or b'"traceEvents"' in (parts[-1][-16:] if parts else b"") + chunk or size == 0
        parts.append(chunk)
        size += len(chunk)
        if seen:
            parts = [b"".join(parts)]
            prefix = _events_prefix(parts[0], st)
        if prefix is None and size > HEAD_LIMIT:
            raise NoEventsHead("no traceEvents array near the start")
    return parts[0], prefix


def _events_prefix(head: bytes, st: Scan) -> str | None:
    text = head.lstrip()
    if text[:1] == b"[":
        st.form, st.has_events = "array", True
        return "item"
    if text[:1] != b"{":
        raise NotFast("not a JSON object or array")
    if b'"traceEvents"' not in head:
        return None
    trial = Scan()
    for _ in scan_events(_head_tokens(head), trial):
        raise NotFast("events before traceEvents")
    if not trial.has_events:
        return None
    st.form, st.has_events, st.keys, st.meta = trial.form, True, trial.keys, trial.meta
    st.meta_dropped, st.big_ints = trial.meta_dropped, trial.big_ints
    return "traceEvents.item"


def _head_tokens(head: bytes):
    """basic_parse tokens of ``head`` up to the ``[`` of the top-level ``traceEvents``."""
    depth, key = 0, None
    try:
        for ev, val in ijson.basic_parse(io.BytesIO(head)):
            yield ev, val
            if ev == "map_key" and depth == 1:
                key = val
            elif ev == "start_map" or ev == "start_array":
                depth += 1
                if depth == 2 and ev == "start_array" and key == "traceEvents":
                    return
            elif ev == "end_map" or ev == "end_array":
                depth -= 1
    except ijson.JSONError:  # the head ends mid-value: more bytes are needed
        return


_ARRAY_END = re.compile(rb"\]\s*([,}])")


def _tail_meta(text: bytes, st: Scan) -> None:
    """Read the keys after the events from ``text``, which starts at or before the ``]`` that
    closes ``traceEvents``: the first ``]`` after which the rest parses (:func:`_tail_at`)."""
    if st.form == "array":
        st.complete = True
        return
    for m in _ARRAY_END.finditer(text):
        if _tail_at(text, m.start(), st):
            return
    raise NotFast("the text after the events does not parse")


def _tail_at(text: bytes, at: int, st: Scan) -> bool:
    """Whether ``text[at:]`` is a ``]`` closing ``traceEvents`` followed by the rest of a valid
    trace; if so, its keys go into ``st.meta`` (exact decimals, integers past int64 as text) and
    ``st.complete`` is set."""
    m = _ARRAY_END.match(text, at)
    if st.form == "array":
        ok = text[at : at + 1] == b"]" and not text[at + 1 :].strip()
    elif m is None:
        ok = False
    elif m.group(1) == b"}":
        ok = not text[m.end() :].strip()
    else:
        try:
            obj = json.loads(b"{" + text[m.end() :], parse_float=Decimal)
        except ValueError:
            return False
        if not isinstance(obj, dict):
            return False
        for k, v in obj.items():
            if len(st.keys) < 1000:
                st.keys.append(k)
            st.meta[k] = str(v) if type(v) is int and not INT64_MIN <= v <= INT64_MAX else v
        ok = True
    st.complete = st.complete or ok
    return ok


_BASE_TIME = re.compile(rb'"baseTimeNanoseconds"\s*:\s*"?(\d+)"?')


def peek_base_time(fh, window: int = 256 * 1024, origin: int | None = None) -> int | None:
    """``baseTimeNanoseconds`` from the last ``window`` bytes of the JSON text of a seekable
    file whose text starts at byte ``origin`` (default: the current position), or None; the
    file position is restored. Kineto writes the key after the events, so without this every
    stored ``ts_ns`` would need a second, indexed ``UPDATE`` at the end (the ingest checks the
    value against the parsed one and corrects a mismatch). A gzip file is inflated once for it
    (no parsing; ISA-L: ~0.05 s for 62 MB). The ingest asks only when the key did not come
    before the events."""
    here = fh.tell()
    start = here if origin is None else origin
    try:
        fh.seek(start)
        magic = fh.read(2)
        fh.seek(start)
        if magic == _GZIP_MAGIC:
            z = gzip_inflater()
            kept: deque[bytes] = deque()  # the last pieces, at least ``window`` bytes: flat memory
            size = 0
            while chunk := fh.read(16 * READ_SIZE):
                while chunk:
                    piece = z.decompress(chunk, 4 * window)
                    kept.append(piece)
                    size += len(piece)
                    while size - len(kept[0]) >= window:
                        size -= len(kept.popleft())
                    if z.unconsumed_tail:
                        chunk = z.unconsumed_tail
                    elif z.eof:
                        chunk = z.unused_data.lstrip(b"\0")
                        z = gzip_inflater()
                    else:
                        chunk = b""
            tail = b"".join(kept)[-window:]
        else:
            fh.seek(0, 2)
            fh.seek(max(start, fh.tell() - window))
            tail = fh.read()
    except (OSError, *INFLATE_ERRORS):
        return None
    finally:
        fh.seek(here)
    found = _BASE_TIME.findall(tail)
    return as_int64(found[-1].decode()) if found else None


# ---------------------------------------------------------------------------- chunked orjson reading

#: Text parsed by one orjson call; its events are held as one list (64 KiB: the fastest and
#: flattest of 64 KiB–512 KiB, measured on the xdit and OWLv2 traces).
CHUNK_BYTES = 64 << 10
#: Text read (and inflated) at a time, then cut into chunks (1 MiB reads cost 3 MiB more peak
#: RSS than 256 KiB on the OWLv2 trace, for no measurable time).
READ_BYTES = 256 << 10
#: A chunk that holds no event boundary grows up to this size before the reading gives up.
MAX_CHUNK_BYTES = 64 << 20
#: ``|ts|`` and ``|dur|`` (µs) below this convert from a float to exactly the ns of the decimal
#: text whatever that text (NOTE: [Chunked orjson reading]); up to :data:`FLOAT_WIDE_US` when the
#: chunk writes them with at most 3 decimals; larger ones make the reading give up.
FLOAT_EXACT_US = float(2**42)
FLOAT_WIDE_US = float(2**43)
_MANY_DECIMALS = (re.compile(rb'"ts"\s*:\s*-?[0-9]+(?:\.[0-9]{4}|\.?[0-9]*[eE])'),
                  re.compile(rb'"dur"\s*:\s*-?[0-9]+(?:\.[0-9]{4}|\.?[0-9]*[eE])'))
_SPLIT_TRIES = 8
_WS = b" \t\r\n"
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')


class Inexact(NotFast):
    """A float that orjson read cannot be converted exactly as the decimal text would be."""


class Chunk:
    """The events of one chunk of text (``events``, a list) and the ``text`` they came from."""

    __slots__ = ("events", "text", "_short_decimals")

    def __init__(self, events: list, text: bytes):
        self.events, self.text = events, text
        self._short_decimals: bool | None = None

    def ns(self, value: float) -> int:
        """ns of a ``ts`` / ``dur`` float of this chunk, exactly as from its decimal text, or
        :class:`Inexact` (NOTE: [Chunked orjson reading])."""
        if not -FLOAT_WIDE_US < value < FLOAT_WIDE_US:  # also inf and nan: 1e308 * 1000 overflows
            raise Inexact(f"{value!r} µs")
        n = round(value * 1000)
        if n / 1000 == value and -FLOAT_EXACT_US < value < FLOAT_EXACT_US:
            return n
        if -FLOAT_WIDE_US < value < FLOAT_WIDE_US and self.short_decimals():
            for m in (n, n - 1, n + 1):
                if m / 1000 == value:
                    return m
        raise Inexact(f"{value!r} µs")

    def short_decimals(self) -> bool:
        """Whether every ``ts`` / ``dur`` in the text has at most 3 decimals (and no exponent)."""
        if self._short_decimals is None:
            self._short_decimals = not any(r.search(self.text) for r in _MANY_DECIMALS)
        return self._short_decimals


def chunked_events(reader, st: Scan):
    """Yield the items of ``traceEvents`` as :class:`Chunk` lists, one per chunk of about
    :data:`CHUNK_BYTES` of text, parsed by orjson.

    # NOTE: [Chunked orjson reading]
    orjson builds an event about 7x faster than ijson's C ``items`` (floats instead of
    ``Decimal``), and the fastest way to call it is on many events at once. The text of the
    events is cut after an event's closing ``}`` that a ``,`` follows; the cut is right when
    ``[`` + the text so far + ``]`` parses. That proof holds because JSON is read the same way
    from the same state: the text starts where an event may start, so if it parses as a list of
    values, it ends where the next event may start; a cut inside a string or inside a nested
    object leaves the list unclosed and does not parse. Failing cuts are retried at earlier
    ``}``; a parse error in the first half of a chunk means the text itself is bad, and the
    reading gives up. The end of the events is the ``]`` found the same way from the end of the
    text, with the keys after it parsed by :func:`_tail_at`.

    What orjson reads differently from the exact readers, and how it is kept out:

    * integers below -2**63 or above 2**64 - 1 become floats. Where that can matter it is
      caught: a ``ts``/``dur`` that large fails the range check below, a float ``pid``/``tid``/
      name gives up, and args are dumped with ``OPT_STRICT_INTEGER`` (integers past 53 bits
      take a careful path that turns top-level ones past int64 into text, as the exact readers
      do) and searched for a float of magnitude >= 2**63 only when their JSON holds ``e+``
      (orjson writes such floats with an exponent); finding one gives up. (A first version
      scanned every chunk for 19-digit runs instead: 0.1 s per 60 MB.)
    * non-integral numbers are floats, not ``Decimal``. In args and names they are written as
      the same float either way. ``ts`` and ``dur`` become ns as ``n = round(f * 1000)``, which
      is the exact decimal's ``round(x * 1000)`` when ``|f| < 2**42`` and ``n / 1000 == f``
      (then ``x`` and ``n/1000`` round to the same double, so they differ by at most one ulp,
      ``2**-11``, and ``1000 x`` lies within 0.49 of ``n``). Kineto's clock often reads 4e12 to
      8e12 µs (past ``2**42``); there, where the chunk's text gives every ``ts`` / ``dur`` with
      at most 3 decimals (checked by a regex, once per chunk, only when such a value occurs),
      ``x = N/1000`` and distinct ``N`` round to distinct doubles below ``2**43`` (ulp
      ``2**-10 < 0.001``), so ``N`` is the one of ``n-1, n, n+1`` with ``N / 1000 == f``
      (:meth:`Chunk.ns`). The caller checks this per event and raises :class:`Inexact`
      otherwise, as for a float ``pid``/``tid``/name, whose text would differ.
    * anything orjson refuses (lone surrogates, invalid UTF-8, NaN) makes the reading give up.

    Giving up raises :class:`NotFast`; the caller reads the input again with
    :func:`fast_events`. A cut or corrupt gzip stream gives up too (the token path reports it).
    """
    head, prefix = _read_head(reader, st)
    buf, pos = head, _events_start(head, prefix)  # buf[pos:] is the text not parsed yet
    need, eof, after_comma = 2 * CHUNK_BYTES, False, False
    while True:
        if not eof and len(buf) - pos < need:  # read on, in larger pieces than the chunks
            parts, size = [buf[pos:]], len(buf) - pos
            while size < need:
                data = reader.read(READ_BYTES)
                if not data:
                    eof = True
                    break
                parts.append(data)
                size += len(data)
            buf, pos = b"".join(parts), 0
        if eof:
            break
        found = _split(buf, pos, min(len(buf), pos + CHUNK_BYTES)) or _split(buf, pos, len(buf))
        if found is None:  # an event longer than the text at hand: grow geometrically
            if len(buf) - pos >= MAX_CHUNK_BYTES:
                raise NotFast(f"no event boundary in {len(buf) - pos} bytes")
            need = 2 * (len(buf) - pos)
            continue
        chunk, pos = found
        need, after_comma = 2 * CHUNK_BYTES, True
        yield chunk
    if reader.cut:
        raise NotFast(reader.cut)
    chunk, tail = _last(buf[pos:], st, after_comma)
    yield chunk
    st.complete = True  # the keys after the events are known only once the events are taken
    st.meta.update(tail.meta)
    st.keys.extend(tail.keys[: max(0, 1000 - len(st.keys))])


def _events_start(head: bytes, prefix: str) -> int:
    """Offset just past the ``[`` that opens the events in ``head``."""
    if prefix == "item":
        return head.index(b"[") + 1
    for m in _EVENTS_KEY.finditer(head):
        try:  # the key is a top-level key when the text before it closes as an object
            json.loads(head[: m.start()] + b'"":0}')
        except ValueError:
            continue
        return m.end()
    raise NotFast("the start of traceEvents was not found")


def _split(buf: bytes, start: int, end: int):
    """``(chunk, offset after the comma)`` for the longest parsing run of whole events in
    ``buf[start:end]`` from its start, or None."""
    i, n, tries = end, len(buf), 0
    while tries < _SPLIT_TRIES:
        i = buf.rfind(b"}", start, i)
        if i < 0:
            return None
        j = i + 1
        while j < n and buf[j] in _WS:
            j += 1
        if j >= n or buf[j] != 0x2C:  # not followed by a comma: not between events
            continue
        tries += 1
        got = _parse(buf[start : i + 1])
        if got is not None:
            return got, j + 1
    return None


def _parse(text: bytes):
    """A :class:`Chunk` of the events in ``text``, or None when it is not whole events."""
    doc = b"[" + text + b"]"
    try:
        return Chunk(orjson.loads(doc), doc)
    except orjson.JSONDecodeError as exc:
        if exc.pos < len(doc) // 2:  # broken well before the cut: the text itself is bad
            raise NotFast(f"orjson: {exc}") from exc
        return None


def _last(buf: bytes, st: Scan, after_comma: bool):
    """``(chunk, tail)``: the last events and a :class:`Scan` of the keys after them. The ``]`` closing the events is the last one before which the events parse and after
    which the rest does."""
    k, tries = len(buf), 0
    while tries < 1000:
        k = buf.rfind(b"]", 0, k)
        if k < 0:
            break
        tries += 1
        trial = Scan(form=st.form)
        if not _tail_at(buf, k, trial):
            continue
        if not buf[:k].strip():
            if after_comma:  # "..., ]": a trailing comma is not JSON
                raise NotFast("a comma after the last event")
            got = Chunk([], b"")
        else:
            got = _parse(buf[:k])
            if got is None:
                continue
        return got, trial
    raise NotFast("the end of traceEvents was not found")
