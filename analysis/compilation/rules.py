"""How check-compile reads torch's compile texts: graph-break reasons, guard failures and failed
compiles, each sorted into a class with a hint; and frame labels that keep their file.

Sources of the formats (torch 2.13 ``torch/_dynamo``; older logs of the tlparse corpus too):

* a ``dynamo_graph_break_reason`` payload starts ``Graph break in user code at FILE:LINE``, then
  ``Graph Break Reason: <what Dynamo tried>`` and, since torch 2.7, a blank line, a headline
  (``Unsupported Tensor.item() call with capture_scalar_outputs=False``), ``Explanation:``,
  ``Hint:`` lines, a graph-break-site link (``gb/gb0124.html``) and ``User code traceback:`` with
  ``File "...", line N, in name`` entries. Older logs carry only the one-line reason.
* a ``recompile_reasons`` entry is ``<compile id>: <guard failure>``: ``tensor 'x' size mismatch
  at index 0. expected 4, actual 5``, ``tensor 'x' requires_grad mismatch. expected
  requires_grad=0``, ``___stack1 == 1017  # n = int(...)  # file:11 in fn``, ``L['self'].num_iter
  == 3``, ``GLOBAL_STATE changed: grad_mode``, ``dtype mismatch``, ...
* a failed compile's ``compilation_metrics`` has ``fail_type`` / ``fail_reason``:
  ``Dynamo recompile limit exceeded`` (``Unsupported``), ``FailOnRecompileLimitHit`` under
  ``fullgraph=True``, ``Failed to handle graph break gracefully`` (the frame is skipped).

Pure functions of text; no store access.
"""

from __future__ import annotations

import json
import os
import re

_AT_RE = re.compile(r"Graph break in user code at (\S+):(\d+)")
_REASON_RE = re.compile(r"Graph Break Reason:\s*(.*)")
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_GB_RE = re.compile(r"/gb/(gb\d+)\.html")
_CID_PREFIX_RE = re.compile(r"^\s*!?\d+(?:/\d+)*(?:_\d+)?:\s*")
_NUM_RE = re.compile(r"(?<![\w'])-?\d+(?:\.\d+)?")
_COMMENT_RE = re.compile(r"\s+#.*$", re.S)
_VALUE_RE = re.compile(r"(==|!=)\s*-?\d")
#: Path parts of code that is not the user's: torch itself and the Python standard library.
_LIBRARY_RE = re.compile(r"(/(?:site|dist)-packages/torch/|/torch/_|/lib/python\d\.\d+/(?!(?:site|dist)-packages/)|^<)")
#: An installed distribution's file: ``.../site-packages/<package>/...`` (or Debian's ``dist-packages``).
_INSTALLED_RE = re.compile(r"/(?:site|dist)-packages/([A-Za-z_][\w.-]*)/")

BREAK_HINTS = {
    "scalar output": "Tensor.item()/.tolist() leaves the graph: set torch._dynamo.config.capture_scalar_outputs"
                     "=True (the value becomes an unbacked symbol) or keep the value a tensor (e.g. (x > 0).sum() "
                     "without .item()); move logging .item() calls out of the compiled region",
    "data-dependent branch": "a Python if/while on a tensor's value: use torch.where / torch.cond, or decide "
                             "the branch outside the compiled region",
    "logging": "print/logging inside the compiled region: move it out, or add the function to "
               "torch._dynamo.config.reorderable_logging_functions",
    "dynamic output shape": "an op whose output shape depends on data (nonzero, unique, masked_select): set "
                            "torch._dynamo.config.capture_dynamic_output_shape_ops=True or avoid the op",
    "unsupported call": "a call Dynamo cannot trace: wrap it in torch.compiler.disable (an intended break), "
                        "register it as a custom op (torch.library.custom_op), or replace it by torch ops",
    "explicit graph_break()": "the user code calls torch._dynamo.graph_break() (an intended break, not an "
                              "unsupported op); inside a loop Dynamo cannot resume after it and runs the whole "
                              "frame eagerly (no graph): put it outside loops, between unrolled sections",
    "other": "see the reason text and the graph-break site link it names",
}

GUARD_HINTS = {
    "shape": "sizes change between calls: torch._dynamo.mark_dynamic(x, dim) on the input, or "
             "torch.compile(..., dynamic=True); for parameters whose shapes differ set "
             "torch._dynamo.config.force_parameter_static_shapes=False",
    "grad mode": "requires_grad / grad mode differs between calls (e.g. the first layer's input has no grad, "
                 "later ones do, or parameters are frozen on some steps): keep it the same on every call, or "
                 "accept one graph per variant (count it in the budget)",
    "dtype": "the dtype differs between calls: cast once before the compiled region (or accept one graph per dtype)",
    "device": "the device differs between calls: move inputs to one device before the compiled region",
    "python value": "a Python int/float/bool is specialised as a constant (`== N` guard): keep it a tensor, "
                    "hoist it out of the compiled region, or mark it dynamic "
                    "(torch._dynamo.config.specialize_int=False / allow_unspec_int_on_nn_module=True)",
    "object identity": "a different Python object each call (ID_MATCH / ___check_obj_id): reuse the object or "
                       "pass its tensors as arguments",
    "type": "the argument's type changes between calls: pass the same type every call",
    "global state": "global torch state changed between calls (autocast, deterministic mode, default dtype): "
                    "keep it fixed around the compiled call",
    "other": "see the guard text; TORCH_LOGS=recompiles_verbose prints every failing guard",
}


def is_library_path(path: str | None) -> bool:
    """True for torch's own files and the standard library (``contextlib.py``), whose graph
    breaks are not the user's (DDP's intended breaks live there)."""
    return bool(path) and bool(_LIBRARY_RE.search(str(path).replace("\\", "/")))


def framework_of(path: str | None) -> str | None:
    """The installed package (top-level import name, e.g. ``"transformers"``, ``"lightning"``) whose
    file ``path`` is, for code that is neither torch/stdlib (:func:`is_library_path`) nor the user's:
    a file under ``site-packages``/``dist-packages``; ``None`` for the user's own files.

    # NOTE: [Framework graph breaks]
    # A training framework's own code can break the graph (transformers' ``logger.warning_once``
    # about ``loss_type``, reached from the model's forward): the user did not write it and it is
    # fixed by the framework's settings or an upgrade, not by editing the line. check-compile names
    # such a break as the framework's (``framework``) and keeps it out of the "user code" count and
    # ``--max-graph-breaks``; it is still listed, with its hint, and diff-runs still reports a new
    # one (an upgrade that adds a break is a regression of the job).
    """
    if not path or is_library_path(path):
        return None
    m = _INSTALLED_RE.search(str(path).replace("\\", "/"))
    return m.group(1).split(".")[0] if m else None


def short_path(path: str | None) -> str:
    return os.path.basename(str(path or "")) or "?"


def frame_label(name: str | None, filename, line) -> str:
    """``"name (file.py:line)"``; a file given only as an interned id (an int: its ``str`` record
    was lost) is named ``<file #id>`` rather than passed off as a file name."""
    where = f"<file #{filename}>" if isinstance(filename, int) or filename is None else short_path(filename)
    return f"{name or '?'} ({where}:{line if line is not None else '?'})"


def parse_break(text: str) -> dict:
    """One ``dynamo_graph_break_reason`` payload → ``{"file", "line", "source_line" ("file.py:N"),
    "headline", "reason_class", "hint", "gb" (site code or None), "user_frame" ("name (file:N)"
    of the traceback entry at the break, else the innermost one), "library" (the break is in
    torch/stdlib code), "eager_fallback" (Dynamo skipped the whole frame)}``."""
    text = text or ""
    m = _AT_RE.search(text)
    file, line = (m.group(1), int(m.group(2))) if m else (None, None)
    lines = [ln.rstrip() for ln in text.splitlines()]
    headline = None
    for i, ln in enumerate(lines):
        rm = _REASON_RE.match(ln.strip())
        if rm:
            rest = [x.strip() for x in lines[i + 1:] if x.strip()]
            headline = rest[0] if rest and not rest[0].startswith(("User code traceback", "File ")) else rm.group(1)
            break
    if headline is None:
        headline = next((x.strip() for x in lines if x.strip() and not x.startswith("Graph break in user code")), "")
    frames = _FRAME_RE.findall(text)
    user = next(((f, n, fn) for f, n, fn in reversed(frames) if file and f == file and int(n) == line), None)
    user = user or (frames[-1] if frames else None)
    cls = break_class(text, headline)
    gb = _GB_RE.search(text)
    return {"file": file, "line": line, "source_line": f"{short_path(file)}:{line}" if file else None,
            "headline": headline[:300], "reason_class": cls, "hint": BREAK_HINTS[cls],
            "gb": gb.group(1) if gb else None,
            "user_frame": frame_label(user[2], user[0], user[1]) if user else None,
            "library": is_library_path(file), "framework": framework_of(file),
            "eager_fallback": "Failed to handle graph break gracefully" in text or "falling back to eager" in text}


def break_class(text: str, headline: str = "") -> str:
    """The reason class of a graph break (keys of :data:`BREAK_HINTS`)."""
    t = f"{headline}\n{text}"
    if "User-inserted graph break" in t or "Call to `torch._dynamo.graph_break()`" in t:
        return "explicit graph_break()"
    t = t.split("User code traceback:", 1)[0]  # the traceback's source lines are the user's code, not the reason
    low = t.lower()
    if re.search(r"\.item\(\)|tolist|capture_scalar_outputs|item \(\) \{\}", t):
        return "scalar output"
    if "data-dependent" in low or "data dependent" in low or "generic_jump" in low or "dynamic control flow" in low:
        return "data-dependent branch"
    if "dynamic shape operator" in low or "capture_dynamic_output_shape_ops" in low:
        return "dynamic output shape"
    if re.search(r"`print`|builtin print|logging|logger\.|reorderable_logging", low):
        return "logging"
    if re.search(r"unsupported (method|function|builtin)|marked as skipped|call_function|call_method|"
                 r"failed to trace builtin|skip reason|not supported|unsupported", low):
        return "unsupported call"
    return "other"


def guard_text(reason: str) -> str:
    """A recompile reason without its ``"0/3: "`` prefix and its trailing source comment."""
    first = (reason or "").strip().splitlines()[0] if (reason or "").strip() else ""
    return _COMMENT_RE.sub("", _CID_PREFIX_RE.sub("", first)).strip()


_GUARD_SRC_RE = re.compile(r"#\s*(.*?)\s+#\s*(\S+?):(\d+) in (\S+)")
_REASON_START_RE = re.compile(r"^\s*!?\d+/\d+(?:_\d+)?: ")


def split_reasons(payload: str | None) -> list[str]:
    """A ``recompile_reasons`` payload as one string per guard failure: a JSON list (torch ≤ 2.9,
    and 2.13 from the second recompile on), else plain text where each failure starts with its
    compile id (``0/0: ...``) and may go on over lines (``User stack trace:`` and its frames)."""
    text = (payload or "").strip()
    try:
        got = json.loads(text or "[]")
    except ValueError:
        got = None
    if isinstance(got, list):
        return [str(x) for x in got if str(x).strip()]
    if isinstance(got, str):
        return [got]
    out: list[str] = []
    for ln in text.splitlines():
        if _REASON_START_RE.match(ln) or not out:
            out.append(ln)
        else:
            out[-1] += "\n" + ln
    return [x for x in out if x.strip()]


def guard_source(reason: str) -> str | None:
    """``"file.py:47"``: the user line a guard came from, when its text names it
    (``self.num_iter == 0  # self.num_iter += 1  # .../m.py:47 in forward``)."""
    first = (reason or "").strip().splitlines()[0] if (reason or "").strip() else ""
    m = _GUARD_SRC_RE.search(first)
    return f"{short_path(m.group(2))}:{m.group(3)}" if m else None


def guard_key(reason: str) -> str:
    """The guard that failed with its numbers replaced by ``N`` (``tensor 'p' size mismatch at
    index N. expected N, actual N``): the same guard failing again has the same key (a storm)."""
    return _NUM_RE.sub("N", guard_text(reason))


def guard_class(reason: str) -> str:
    """The class of a guard failure (keys of :data:`GUARD_HINTS`)."""
    g = guard_text(reason).lower()
    if any(k in g for k in ("size mismatch", "stride mismatch", "rank mismatch", "dimensionality", "size()",
                            "sizes mismatch", ".size(", "stride()", "numel")):
        return "shape"
    if "requires_grad" in g or "grad_mode" in g or "grad mode" in g:
        return "grad mode"
    if "dtype" in g:
        return "dtype"
    if "device" in g:
        return "device"
    if "global_state" in g or "autocast" in g or "deterministic" in g:
        return "global state"
    if "id_match" in g or "check_obj_id" in g or "obj_id" in g:
        return "object identity"
    if "type mismatch" in g or "check_type_id" in g or "type(" in g:
        return "type"
    if _VALUE_RE.search(g) or "___stack" in g:
        return "python value"
    return "other"


def failure_kind(fail_type: str | None, fail_reason: str | None) -> str | None:
    """``"recompile limit"``, ``"graph break not handled"`` (Dynamo skipped the frame),
    ``"compile error"`` (any other failure), or None when the compile did not fail."""
    if not fail_type and not fail_reason:
        return None
    text = f"{fail_type or ''} {fail_reason or ''}".lower()
    if "recompile limit" in text or "recompilelimit" in text or "cache_size_limit" in text \
            or "recompile_limit" in text or "cache size limit" in text:
        return "recompile limit"
    if "failed to handle graph break gracefully" in text or "falling back to eager" in text \
            or (fail_type or "") == "Unsupported":
        return "graph break not handled"
    return "compile error"
