"""Command-line specs for eager mode: ``module:attr`` references and example-input specs.

An input spec is one of:

* ``DTYPE[d0,d1,...]`` — ``float32[4,8]``: ``torch.randn`` (floating dtypes) of that shape;
* ``DTYPE[d0,...]<HIGH`` — ``int64[2,16]<256``: ``torch.randint(0, HIGH)``; integer dtypes
  without ``<HIGH`` use 2;
* ``pkg.mod:fn`` — ``fn()`` returns the example inputs (a tuple, a dict or one tensor);
* ``NAME=SPEC`` — a keyword argument (``input_ids=int64[2,16]<256``).

Random values come from a generator seeded with 0, so the same spec gives the same batch.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

from graphdeck.errors import UsageError

_SPEC_RE = re.compile(r"^(?P<dtype>[a-z0-9]+)\[(?P<shape>[0-9,\s]*)\](?:<(?P<high>\d+))?$")


def load_ref(ref: str, what: str) -> Any:
    """``"pkg.mod:name"`` → the object (the current directory is importable).

    Raises:
        UsageError: malformed reference, missing module or attribute (CLI exit 2).
    """
    if ":" not in ref:
        raise UsageError(f"{what} must be 'module:name', got {ref!r}")
    mod_name, attr = ref.split(":", 1)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise UsageError(f"{what}: cannot import {mod_name!r}: {exc}") from exc
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{what}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def parse_inputs(specs: list[str] | tuple[str, ...]) -> tuple | dict:
    """Example inputs from CLI specs (see the module docstring): a tuple of positional inputs, or
    a dict when every spec is ``NAME=SPEC``; a lone ``module:fn`` spec returns what ``fn()`` returns.

    Raises:
        UsageError: an unknown dtype, a malformed shape, positional and keyword specs mixed.
    """
    import torch

    if len(specs) == 1 and ":" in specs[0] and "[" not in specs[0]:
        value = load_ref(specs[0], "--inputs")
        return value() if callable(value) else value
    gen = torch.Generator().manual_seed(0)
    args, kwargs = [], {}
    for spec in specs:
        name, _, body = spec.rpartition("=") if "=" in spec else ("", "", spec)
        m = _SPEC_RE.match(body.strip())
        if not m:
            raise UsageError(f"--inputs {spec!r}: expected DTYPE[d0,d1,...] (e.g. float32[4,8] or int64[2,16]<256)")
        dtype = getattr(torch, m["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"--inputs {spec!r}: unknown dtype {m['dtype']!r}")
        shape = [int(d) for d in m["shape"].replace(" ", "").split(",") if d]
        if dtype.is_floating_point or dtype.is_complex:
            value = torch.randn(shape, generator=gen).to(dtype)
        else:
            value = torch.randint(0, int(m["high"] or 2), shape, generator=gen, dtype=dtype)
        if name:
            kwargs[name] = value
        else:
            args.append(value)
    if args and kwargs:
        raise UsageError("--inputs: give all inputs positionally or all as NAME=SPEC, not both")
    return kwargs if kwargs else tuple(args)
