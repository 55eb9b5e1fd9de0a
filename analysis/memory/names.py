"""The op and dtype names the memory model reads: which ops alias their input (:data:`ALIAS_OPS`,
:data:`CAST_OPS`), an op's bare name (:func:`op_name`), bytes per element (:data:`ITEMSIZE`) and
the spellings of dtypes (:func:`canonical_dtype`). Re-exported by :mod:`graphdeck.analysis.memory.core`."""

from __future__ import annotations

import functools

from graphdeck.errors import UsageError

#: Ops whose output aliases their first tensor input (no new storage). Matched against the op
#: name without namespace/overload: ``aten.view.default`` → ``view``; ``torch.Tensor.view`` and
#: ``call_method`` targets too.
ALIAS_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "expand_as",
    "slice", "select", "squeeze", "unsqueeze", "alias", "as_strided", "detach", "narrow", "diagonal",
    "unflatten", "flatten", "view_as", "view_as_real", "view_as_complex", "unfold", "split", "split_with_sizes",
    "chunk", "unbind", "getitem", "contiguous", "movedim", "swapaxes", "numpy_T", "mT", "T",
    "lift_fresh", "_to_copy_view",
})

#: Dtype/device casts that return their input itself when nothing changes (``x.float()`` on a
#: float32 tensor): an alias when the output's dtype, device and bytes equal the first input's,
#: else a new tensor. Not ``_to_copy`` or ``lift_fresh_copy``: they always copy.
CAST_OPS = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool",
                      "cpu", "cuda"})

#: Bytes per element by dtype name, for what-if dtype changes.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
            "float8_e5m2": 1}

#: Common short names of dtypes (as torch, numpy and mixed-precision configs spell them).
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
                 "fp32": "float32", "f32": "float32", "float": "float32", "single": "float32",
                 "fp64": "float64", "f64": "float64", "double": "float64",
                 "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
                 "e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
                 "long": "int64", "int": "int32", "short": "int16"}


def canonical_dtype(dtype: str) -> str:
    """``"bf16"``, ``"torch.bfloat16"``, ``"BFloat16"`` → ``"bfloat16"`` (a key of :data:`ITEMSIZE`).

    Raises:
        UsageError: not a dtype name or alias this module knows.
    """
    key = dtype.strip().lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key not in ITEMSIZE:
        raise UsageError(f"unknown dtype {dtype!r}; one of {', '.join(sorted(ITEMSIZE))} "
                         f"(or {', '.join(sorted(DTYPE_ALIASES))})")
    return key


@functools.lru_cache(maxsize=8192)
def op_name(target: str) -> str:
    """``aten.view.default`` → ``view``; ``torch.Tensor.view`` → ``view``; ``_operator.getitem`` → ``getitem``."""
    parts = target.split(".")
    if len(parts) >= 3 and parts[0] in ("aten", "prims", "torch") and parts[-1] in ("default", "Tensor", "int",
                                                                                     "Scalar", "dim", "self", "using_ints"):
        return parts[-2]
    if len(parts) == 3 and parts[0] == "aten":
        return parts[1]
    return parts[-1]
