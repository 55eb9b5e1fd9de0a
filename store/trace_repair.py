"""Repair mode for damaged Kineto traces (``graphdeck ingest-trace --repair``): the reader filters
that fix broken strings and escapes (:class:`RepairingReader`) and skip to the next whole event
after a corrupt one (:class:`ResyncReader`), over :class:`graphdeck.store.trace_json.Reader`'s
bytes. Split from :mod:`graphdeck.store.trace_json`, which re-exports both."""

from __future__ import annotations

import io
import re

import ijson
import orjson

from graphdeck.store.trace_json import READ_SIZE

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
    except (ijson.JSONError, ValueError):  # ValueError: a lone low surrogate (``"\\udf0a"``) that
        return False  # yajl turns into bytes Python cannot decode (UnicodeDecodeError)
    return True
