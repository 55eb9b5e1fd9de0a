"""Reading pickles of plain data (Flight Recorder dumps, CUDA memory snapshots) that may be hostile.

# NOTE: [Bounded unpickling]
torch writes both files as pickles of builtins only: dicts, lists, tuples, str, int, float, bool
and None (FR: ``torch._C._distributed_c10d._dump_fr_trace``, read by torch's own
``flight_recorder/components/loader.py`` with a bare ``pickle.load``; snapshots:
``torch.cuda.memory._snapshot``). A bare ``pickle.load`` of a file someone else made is unsafe
in more ways than running code:

* **memory before any check**: CPython's unpickler allocates a ``BINBYTES8`` / ``BYTEARRAY8``
  object of the length the file claims, reads a ``BINUNICODE8`` / ``LONG4`` / ``FRAME`` of that
  length through a buffered reader that allocates it first, and grows its memo table to twice a
  ``LONG_BINPUT`` index — a 9-byte file can ask for 16 GiB;
* **work after loading**: memo references (``BINGET``) make a DAG, so ``[a, a]`` nested 40 times
  is a 5 KB file that becomes 2^40 items when ``str()``-ed or serialised, and nesting 100,000
  levels deep ends in a ``RecursionError`` wherever the object is walked;
* **decompression**: ``gzip.decompress`` inflates a bomb whole before anything is checked.

So :func:`load_plain` first walks the opcodes in pure Python (:func:`scan`, ~0.1 µs per opcode;
nothing is allocated from a length the file claims): only the binary opcodes of protocol 2-5
that build builtins are allowed (no ``GLOBAL``/``REDUCE``/``BUILD``/bytes/buffers/sets/protocol-0
text), every length must fit in what is left of the file, memo indices must be handed out in
order (as every pickler does), and at most ``max_objects`` objects may be made. Only then does the
C unpickler (which refuses every class as well) build the object, and :func:`measure` walks it
once, shared parts once (memo by ``id``), refusing nesting deeper than ``max_depth`` and an
*expanded* size (every reference counted as often as it is reached; a string counts one unit per
16 characters) over ``max_units`` — which bounds what any later walk of the result (``str``,
JSON, the importers' loops) can cost. :func:`read_capped` inflates gzip in steps with a cap.
Every refusal is a :class:`UnsafePickle` naming the problem (a ``ValueError``).
"""

from __future__ import annotations

import io
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path


class UnsafePickle(ValueError):
    """A pickle (or its gzip) refused before or while loading; the message says why."""


class TruncatedPickle(UnsafePickle):
    """A pickle or gzip that ends too soon (a dump cut by a killed writer, not a hostile one)."""


@dataclass(frozen=True)
class Limits:
    """Bounds for :func:`load_plain`.

    Attributes:
        max_bytes: largest file, and largest inflated gzip, in bytes.
        max_objects: containers the opcodes may create (an upper bound: see :func:`scan`); with
            ``max_bytes`` this bounds the unpickler's memory (~70 bytes a container, a few
            bytes per other opcode).
        max_units_per_byte, min_units: the expanded size of the result (see NOTE: [Bounded
            unpickling]) may reach ``max(min_units, max_units_per_byte * len(data))``; a real
            dump's is under 1 a byte (its shared frames included).
        max_depth: deepest nesting of containers (the top object is depth 1).
        max_str: longest single string, in bytes.
    """

    max_bytes: int = 512 << 20
    max_objects: int = 20_000_000
    max_units_per_byte: float = 64.0
    min_units: int = 1_000_000
    max_depth: int = 32
    max_str: int = 16 << 20


#: Bytes a checked opcode takes, argument included, by opcode (NOTE: [Bounded unpickling]);
#: 0: looked at by :func:`_scan` one by one (strings, LONG1, LONG_BINPUT, FRAME, PROTO, STOP)
#: or refused. Argument-less: MARK POP POP_MARK APPEND(S) SETITEM(S) NONE NEWTRUE NEWFALSE
#: EMPTY_LIST/TUPLE/DICT LIST TUPLE TUPLE1-3 DICT MEMOIZE; then BINGET BININT1 BINPUT (1-byte
#: argument), BININT2, BININT LONG_BINGET, BINFLOAT.
_STEP = [0] * 256
for _op in b"(01aesuN\x88\x89])}lt\x85\x86\x87d\x94":
    _STEP[_op] = 1
for _ops, _n in ((b"hKq", 2), (b"M", 3), (b"Jj", 5), (b"G", 9)):
    for _op in _ops:
        _STEP[_op] = _n
#: opcodes that make a new container (what the object count bounds)
_CONTAINER_OPS = tuple(bytes([c]) for c in b"])}lt\x85\x86\x87d")
_CLASS_OPS = frozenset(b"ci\x93\x82\x83\x84")  # GLOBAL INST STACK_GLOBAL EXT1/2/4
_STRINGS = {0x8C: 1, ord("X"): 4, 0x8D: 8}  # SHORT_BINUNICODE BINUNICODE BINUNICODE8: length bytes
_NAMES = {0x8E: "BINBYTES8", 0x96: "BYTEARRAY8", ord("B"): "BINBYTES", ord("C"): "SHORT_BINBYTES",
          ord("c"): "GLOBAL", 0x93: "STACK_GLOBAL", ord("R"): "REDUCE", ord("b"): "BUILD", ord("i"): "INST",
          ord("o"): "OBJ", 0x81: "NEWOBJ", 0x92: "NEWOBJ_EX", ord("P"): "PERSID", ord("Q"): "BINPERSID",
          0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x8B: "LONG4", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER",
          0x8F: "EMPTY_SET", 0x90: "ADDITEMS", 0x91: "FROZENSET", ord("2"): "DUP", ord("I"): "INT",
          ord("L"): "LONG", ord("F"): "FLOAT", ord("S"): "STRING", ord("T"): "BINSTRING", ord("U"): "SHORT_BINSTRING",
          ord("V"): "UNICODE", ord("g"): "GET", ord("p"): "PUT", 0x8A: "LONG1", ord("r"): "LONG_BINPUT"}


def scan(data: bytes, limits: Limits = Limits()) -> int:
    """Check the opcodes of ``data`` (see NOTE: [Bounded unpickling]) without building anything;
    returns an upper bound on the containers they would create (every byte of ``data`` that is a
    container-making opcode, string contents included).

    Raises:
        UnsafePickle: an opcode a dump never holds (bytes, classes, sets, protocol-0 text...), a
            length past the end of the data or over ``limits.max_str``, an integer over 9 bytes,
            a memo index beyond the data's size, over ``limits.max_objects`` containers, or no
            ``STOP``.
    """
    n = len(data)
    if n < 2 or data[0] != 0x80 or not 2 <= data[1] <= 5:
        raise UnsafePickle("not a pickle of protocol 2-5 (a dump starts with 0x80 and the protocol)")
    containers = sum(map(data.count, _CONTAINER_OPS))
    if containers > limits.max_objects:
        raise UnsafePickle(f"up to {containers:,} containers, over the {limits.max_objects:,} limit")
    try:
        _scan(data, n, limits.max_str)
    except IndexError:  # an argument cut by the end of the data
        raise TruncatedPickle("the pickle ends inside an opcode (cut short?)") from None
    return containers


def _scan(data: bytes, n: int, max_str: int) -> None:
    step = _STEP
    i = 2
    while True:
        k = step[data[i]]
        if k:
            i += k
            continue
        op = data[i]
        if op == 0x8C:  # SHORT_BINUNICODE: 255 bytes at most
            i += 2 + data[i + 1]
            continue
        if op == 0x2E:  # STOP
            return
        w = _STRINGS.get(op)
        if w is not None:
            size = int.from_bytes(data[i + 1:i + 1 + w], "little")
            i += 1 + w
            if size > max_str:
                raise UnsafePickle(f"a string of {size:,} bytes at offset {i - w - 1}, over the {max_str:,}-byte "
                                   "limit (a dump's strings are names and paths)")
            if size > n - i:
                raise TruncatedPickle(f"a string of {size:,} bytes at offset {i - w - 1} runs past the end of the "
                                      "data (cut short?)")
            i += size
        elif op == 0x8A:  # LONG1
            if data[i + 1] > 9:
                raise UnsafePickle(f"an integer of {data[i + 1]} bytes at offset {i} (a dump's fit in 9)")
            i += 2 + data[i + 1]
        elif op == 0x72:  # LONG_BINPUT: the unpickler's memo table grows to twice its index
            idx = int.from_bytes(data[i + 1:i + 5], "little")
            if idx > i:  # each memo entry took an opcode byte before this one
                raise UnsafePickle(f"memo index {idx:,} at offset {i}: more than the data could have stored")
            i += 5
        elif op == 0x95:  # FRAME: its opcodes follow; only its length is checked
            size = int.from_bytes(data[i + 1:i + 9], "little")
            i += 9
            if size > n - i:
                raise (TruncatedPickle if size <= max_str else UnsafePickle)(
                    f"a frame of {size:,} bytes at offset {i - 9}, past the end of the data")
        elif op == 0x80 and 2 <= data[i + 1] <= 5:  # PROTO again
            i += 2
        else:
            what = " (the pickle names a class or function)" if op in _CLASS_OPS else ""
            raise UnsafePickle(f"opcode {_NAMES.get(op, hex(op))} at offset {i}{what}: a dump of plain data never "
                               "holds it")


_LEAVES = frozenset({int, float, bool, type(None)})
_CONTAINERS = frozenset({dict, list, tuple})


def measure(obj, limits: Limits = Limits(), max_units: int | None = None) -> int:
    """The expanded size of ``obj`` in units (each container, number and ``None`` 1; a string 1
    per 16 characters, at least 1), every reference counted as often as it is reached, computed
    once per shared container (so in time linear in the distinct objects).

    Raises:
        UnsafePickle: over ``max_units`` (default ``limits.min_units``), deeper than ``limits.max_depth``, or holding
            anything but dict / list / tuple / str / int / float / bool / None.
    """
    done: dict[int, int] = {}
    cap = limits.min_units if max_units is None else max_units
    max_depth, leaves, containers = limits.max_depth, _LEAVES, _CONTAINERS

    def units(o, depth: int) -> int:
        got = done.get(id(o))
        if got is not None:
            return got
        if depth >= max_depth:
            raise UnsafePickle(f"containers nested deeper than {max_depth} levels (a dump's are a few)")
        if type(o) is dict:
            items = o.values()
            total = 1 + 2 * len(o)
            if set(map(type, o)) == {str}:  # the keys: names, as in every dump
                total += sum(map(len, o)) >> 4
            else:
                total += units(list(o), depth + 1) - 1
        else:
            items = o
            total = 1 + len(items)
        for x in items:
            t = type(x)
            if t is str:
                total += len(x) >> 4
            elif t in containers:
                total += units(x, depth + 1) - 1
                if total > cap:
                    break
            elif t not in leaves:
                raise UnsafePickle(f"a {t.__name__} object (a dump holds only dicts, lists, tuples, strings and "
                                   "numbers)")
        if total > cap:
            raise UnsafePickle(f"it expands to more than {cap:,} items (parts shared many times over)")
        done[id(o)] = total
        return total

    if type(obj) not in _CONTAINERS:
        return 1
    return units(obj, 0)


class _PlainOnly(pickle.Unpickler):
    def find_class(self, module, name):  # scan() lets no opcode through that gets here
        raise UnsafePickle(f"refused class {module}.{name}")


def load_plain(data: bytes, limits: Limits = Limits()):
    """The object pickled in ``data`` (already inflated), checked by :func:`scan` before and
    :func:`measure` after loading.

    Raises:
        UnsafePickle: any refusal, or an unpickling error (the message says which)."""
    if len(data) > limits.max_bytes:
        raise UnsafePickle(f"{len(data):,} bytes, over the {limits.max_bytes:,}-byte limit")
    scan(data, limits)
    try:
        # a buffered reader: the unpickler peeks whole chunks instead of reading each opcode of a
        # frameless protocol-2 pickle through a Python call (3x faster than a bare BytesIO); every
        # length was checked against the data above, so no read asks for more than is there
        reader = io.BufferedReader(io.BytesIO(data), buffer_size=min(max(len(data), 8192), 16 << 20))
        obj = _PlainOnly(reader).load()
    except UnsafePickle:
        raise
    except EOFError as exc:
        raise TruncatedPickle(f"EOFError: {str(exc)[:160]}") from None
    except Exception as exc:  # noqa: BLE001 - a malformed stream: refused, named
        raise UnsafePickle(f"{type(exc).__name__}: {str(exc)[:160]}") from None
    measure(obj, limits, max(limits.min_units, int(limits.max_units_per_byte * len(data))))
    return obj


#: Gzip may inflate past this many bytes only at ``max_ratio`` or less (as the server's uploads).
RATIO_FREE_BYTES = 64 << 20


def inflate_capped(raw: bytes, max_bytes: int, max_ratio: float = 200.0) -> bytes:
    """``raw`` gunzipped (every member), refused as soon as more than ``max_bytes`` come out, or
    more than :data:`RATIO_FREE_BYTES` at over ``max_ratio`` times the compressed bytes read so
    far (a real snapshot pickle compresses ~20x): inflated 64 KiB of input and at most 16 MiB of
    output at a time, so a bomb is refused long before it is whole.

    Raises:
        UnsafePickle: over a cap ("inflates to more than ..."), or not valid gzip ("bad gzip: ...");
            TruncatedPickle: the data ends inside a member."""
    out = bytearray()
    pending = memoryview(raw)
    fed = 0
    d = zlib.decompressobj(wbits=31)
    try:
        while True:
            if d.eof:
                rest = bytes(d.unused_data).lstrip(b"\x00") + bytes(pending)  # another member, or padding
                if not rest.strip(b"\x00"):
                    return bytes(out)
                d, pending = zlib.decompressobj(wbits=31), memoryview(rest)
                continue
            if d.unconsumed_tail:
                chunk = d.unconsumed_tail
            elif pending:
                chunk, pending = pending[:1 << 16], pending[1 << 16:]
                fed += len(chunk)
            else:
                raise TruncatedPickle("bad gzip: the compressed data ends before its end marker (cut short?)")
            out += d.decompress(chunk, 1 << 24)
            if len(out) > max_bytes:
                raise UnsafePickle(f"gzip that inflates to more than the {max_bytes:,}-byte limit")
            if len(out) > RATIO_FREE_BYTES and len(out) > max_ratio * fed:
                raise UnsafePickle(f"gzip that inflates over {max_ratio:g} times ({len(out):,} bytes from the first "
                                   f"{fed:,}): a bomb, not a dump")
    except zlib.error as exc:
        raise UnsafePickle(f"bad gzip: {exc}") from None


def read_capped(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, gunzipped when they start with the gzip magic, both capped at
    ``max_bytes`` (:func:`inflate_capped`).

    Raises:
        OSError: unreadable. UnsafePickle: too large, or bad gzip."""
    p = Path(path)
    size = p.stat().st_size
    if size > max_bytes:
        raise UnsafePickle(f"a {size:,}-byte file, over the {max_bytes:,}-byte limit")
    raw = p.read_bytes()
    return inflate_capped(raw, max_bytes) if raw[:2] == b"\x1f\x8b" else raw
