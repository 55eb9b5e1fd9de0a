"""Text drawn in the graph SVG: tensor labels (dtype and shape), ellipsized node labels.

A node's label is its short op name (or the parameter a placeholder is bound to) and, under it,
its tensor: ``f32[8, 64]``. An op that returns several tensors (``split``, ``var_mean``,
``_foreach_*``, SDPA's tuple) stores a list of shapes; it is printed as shapes, never as a raw
list repr: ``f32[8, 512, 768] ×3`` when all are equal, else the first two then ``… (N)``, and a
label longer than :data:`MAX_LABEL_CHARS` ends in ``…`` (the node's ``<title>`` holds the full
text, so a hover shows it).
"""

from __future__ import annotations

from typing import Any

#: Longest label drawn in a node box (characters); longer ones end in "…".
MAX_LABEL_CHARS = 40

DTYPE_SHORT = {
    "float32": "f32", "float": "f32", "float16": "f16", "half": "f16", "bfloat16": "bf16",
    "float64": "f64", "double": "f64", "int64": "i64", "long": "i64", "int32": "i32", "int": "i32",
    "int16": "i16", "short": "i16", "int8": "i8", "uint8": "u8", "bool": "b8",
    "complex64": "c64", "complex128": "c128", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2",
}


def short_dtype(name: str) -> str:
    """``'float32'`` / ``'torch.float32'`` → ``'f32'`` (unknown names unchanged)."""
    name = name.removeprefix("torch.")
    return DTYPE_SHORT.get(name, name)


def ellipsize(text: str, limit: int = MAX_LABEL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, the last one ``…`` when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _one_shape(shape: Any) -> str:
    if isinstance(shape, list):
        if any(isinstance(d, list) for d in shape):  # nested further (a list of tuples): say so, briefly
            return "[…]"
        return "[" + ", ".join(map(str, shape)) + "]"
    return "–" if shape is None else str(shape)


def tensor_label(shape: Any, dtype: str | None, limit: int = MAX_LABEL_CHARS) -> str:
    """The tensor part of a node label.

    ``([8, 64], 'torch.float32')`` → ``'f32[8, 64]'``; a list of shapes (an op returning several
    tensors; ``None`` for a non-tensor output) → ``'f32[8, 64] ×3'`` when all are equal, else
    ``'f32[8, 64], [8] … (4)'`` (the first shapes that fit ``limit``, then how many in all);
    a shape stored as text is shown as it is, ellipsized; no shape and no dtype → ``''``.
    """
    short = short_dtype(dtype) if dtype else ""
    if shape is None:
        return short
    if isinstance(shape, list) and shape and all(isinstance(s, list) or s is None for s in shape) \
            and any(isinstance(s, list) for s in shape):
        parts = [_one_shape(s) for s in shape]
        if len(set(parts)) == 1:
            return ellipsize(f"{short}{parts[0]}" + (f" \u00d7{len(parts)}" if len(parts) > 1 else ""), limit)
        out = short + parts[0]
        shown = 1
        for p in parts[1:]:
            tail = f" \u2026 ({len(parts)})" if shown + 1 < len(parts) else ""
            if len(out) + 2 + len(p) + len(tail) > limit:
                break
            out += ", " + p
            shown += 1
        if shown < len(parts):
            out += f" \u2026 ({len(parts)})"
        return ellipsize(out, limit)
    if isinstance(shape, list):
        return ellipsize(f"{short}{_one_shape(shape)}", limit)
    return ellipsize(f"{short}{shape}", limit)
