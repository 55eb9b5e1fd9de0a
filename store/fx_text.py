"""Parse printed FX graphs (``GraphModule.print_readable()`` text, as TORCH_TRACE logs them) back
into nodes and edges, without torch.

The text is the one ``torch.fx`` codegen writes (``torch/fx/graph.py``, ``_PyTreeCodeGen``,
verbose mode): a ``forward`` signature whose arguments are the placeholders (annotated with
tensor metadata, and in AOTAutograd graphs followed by a descriptor comment), then one statement
per node, ``# File: path:line in fn, code: text`` comments that give the source line of the
nodes below them, and a ``return``. Tensor metadata is printed as
``"f32[16, 512][512, 1]cpu"``: dtype abbreviation, shape, stride, device (stride and device are
absent in some graphs). Statements are parsed with Python's :mod:`ast`. :func:`module_paths` infers
the module path of a parsed graph's nodes (NOTE: [Module paths of imported graphs]).

Example::

    >>> g = parse_fx_text('''class GraphModule(torch.nn.Module):
    ...     def forward(self, L_x_: "f32[4, 8][8, 1]cpu"):
    ...         l_x_ = L_x_
    ...         # File: /job/m.py:3 in forward, code: y = x.relu()
    ...         y: "f32[4, 8][8, 1]cpu" = l_x_.relu();  l_x_ = None
    ...         return (y,)''')
    >>> [(n.name, n.op, n.target, n.shape) for n in g.nodes]
    [('l_x_', 'placeholder', 'L_x_', [4, 8]), ('y', 'call_method', 'relu', [4, 8]), ('output', 'output', 'output', None)]
    >>> [(e.src_idx, e.dst_idx, e.arg_pos) for e in g.edges], g.nodes[1].stack_trace
    ([(0, 1, 0), (1, 2, 0)], '  File "/job/m.py", line 3, in forward\\n    y = x.relu()')
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

#: torch's dtype abbreviations in printed graphs (``torch/fx/graph.py``'s ``dtype_abbrs``).
DTYPE_ABBRS = {
    "bf16": "bfloat16", "f64": "float64", "f32": "float32", "f16": "float16", "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2", "f8e4m3fnuz": "float8_e4m3fnuz", "f8e5m2fnuz": "float8_e5m2fnuz",
    "f8e8m0fnu": "float8_e8m0fnu", "f4e2m1fn_x2": "float4_e2m1fn_x2", "c32": "complex32", "c64": "complex64",
    "c128": "complex128", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "b8": "bool",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64", "bit": "bits8",
}
DTYPE_BYTES = {"bfloat16": 2, "float64": 8, "float32": 4, "float16": 2, "complex32": 4, "complex64": 8,
               "complex128": 16, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1, "uint8": 1,
               "uint16": 2, "uint32": 4, "uint64": 8}
ARG_REPR_LIMIT = 200

_META_RE = re.compile(r"^(?P<dtype>[a-z][a-z0-9_]*)\[(?P<shape>[^\]]*)\](?:\[(?P<stride>[^\]]*)\])?(?P<device>\S*)$")
_FREE_RE = re.compile(r"^[\w\s=]+= None$")
_DECL_RE = re.compile(r'^(\w+)\s*:\s*"[^"]*"$')
_FILE_RE = re.compile(r"^# File: (?P<path>.*?):(?P<line>\d+) in (?P<fn>[^,]*), code: (?P<code>.*)$")
_PARAM_RE = re.compile(r'^\s*(?P<name>\w+)(?:\s*:\s*(?P<ann>"[^"]*"|\'[^\']*\'|[^,=#]+?))?\s*(?:=\s*[^,#]+)?,?\s*(?:#\s*(?P<desc>.*))?$')
_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "truediv", ast.FloorDiv: "floordiv",
           ast.Mod: "mod", ast.Pow: "pow", ast.MatMult: "matmul", ast.BitAnd: "and_", ast.BitOr: "or_",
           ast.BitXor: "xor", ast.LShift: "lshift", ast.RShift: "rshift"}
_UNOPS = {ast.USub: "neg", ast.UAdd: "pos", ast.Invert: "invert", ast.Not: "not_"}
_CMPOPS = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}


@dataclass
class TextNode:
    """One FX node read from text. ``shape``/``stride`` are lists of ints or symbol strings (lists
    of lists for tuple outputs); ``dtype`` is torch's name without ``torch.`` (``"float32"``)."""

    idx: int
    name: str
    op: str
    target: str
    args: Any = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    shape: Any = None
    dtype: str | None = None
    stride: Any = None
    device: str | None = None
    size_bytes: int | None = None
    stack_trace: str | None = None
    desc: str | None = None


@dataclass
class TextEdge:
    src_idx: int
    dst_idx: int
    arg_pos: int
    size_bytes: int | None


@dataclass
class TextGraph:
    """A parsed graph: nodes in graph order (placeholders first, ``output`` last), data edges,
    the output's values (node names or ``None``) with their descriptor comments, a structural
    hash (op, target, shape, dtype, stride and input positions; not names) and counters of
    statements that could not be parsed (``bad_statements``)."""

    nodes: list[TextNode]
    edges: list[TextEdge]
    outputs: list[str | None]
    output_descs: list[str | None]
    structural_hash: str
    bad_statements: int = 0

    def placeholders(self) -> list[TextNode]:
        return [n for n in self.nodes if n.op == "placeholder"]


def parse_tensor_meta(annotation: str | None) -> tuple[Any, str | None, Any, str | None]:
    """``"f32[16, 512][512, 1]cpu"`` → ``([16, 512], "float32", [512, 1], "cpu")``; ``"Sym(s0)"``
    and anything else unrecognised → all ``None``."""
    if not annotation:
        return None, None, None, None
    text = annotation.strip().strip("\"'")
    m = _META_RE.match(text)
    if m is None or m.group("dtype") not in DTYPE_ABBRS:
        return None, None, None, None
    return (_dims(m.group("shape")), DTYPE_ABBRS[m.group("dtype")],
            _dims(m.group("stride")) if m.group("stride") is not None else None, m.group("device") or None)


def _dims(text: str) -> list[int | str]:
    out: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        if part:
            out.append(int(part) if part.lstrip("-").isdigit() else part)
    return out


def _size_bytes(shape: Any, dtype: str | None) -> int | None:
    if not isinstance(shape, list) or dtype not in DTYPE_BYTES or not all(isinstance(d, int) for d in shape):
        return None
    numel = 1
    for d in shape:
        numel *= d
    return numel * DTYPE_BYTES[dtype]


def _stack_trace(m: re.Match) -> str:
    return f'  File "{m.group("path")}", line {m.group("line")}, in {m.group("fn")}\n    {m.group("code").strip()}'


def _split_outside(text: str, sep: str) -> list[str]:
    """Split ``text`` on ``sep`` where it is outside brackets and quotes (parts unstripped)."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _split_top_level(text: str) -> list[str]:
    """Split ``a, b: "x[1, 2]", c`` on commas outside brackets and quotes."""
    return [p for p in _split_outside(text, ",") if p.strip()]


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[TextNode] = []
        self.index: dict[str, int] = {}
        self.edges: list[TextEdge] = []
        self.aliases: dict[str, str] = {}  # printed name -> node name
        self.outputs: list[str | None] = []
        self.output_descs: list[str | None] = []
        self.bad = 0
        self.declared: dict[str, str | None] = {}
        self.input_descs: dict[str, str] = {}

    def flatten_inputs(self, names: list[str]) -> None:
        """``primals_1, tangents_1, = fx_pytree.tree_flatten_spec([primals, tangents], ...)``: the
        flattened names are the graph's placeholders (replacing the pytree arguments)."""
        if any(n.op != "placeholder" for n in self.nodes):
            return
        self.nodes, self.index = [], {}
        for name in names:
            shape, dtype, stride, device = parse_tensor_meta(self.declared.get(name))
            self.add(TextNode(idx=0, name=name, op="placeholder", target=name, shape=shape, dtype=dtype,
                              stride=stride, device=device, size_bytes=_size_bytes(shape, dtype),
                              desc=self.input_descs.get(name)))

    def add(self, node: TextNode) -> TextNode:
        node.idx = len(self.nodes)
        self.nodes.append(node)
        self.index[node.name] = node.idx
        return node

    def ref(self, name: str) -> int | None:
        name = self.aliases.get(name, name)
        return self.index.get(name)

    # -- arguments -------------------------------------------------------------------------------
    def arg(self, tree: ast.AST, refs: list[int]) -> Any:
        """JSON-able value of an argument; node references become ``{"node": name}``."""
        if isinstance(tree, ast.Name):
            idx = self.ref(tree.id)
            if idx is not None:
                refs.append(idx)
                return {"node": self.nodes[idx].name}
            return {"repr": tree.id}
        if isinstance(tree, ast.Constant):
            value = tree.value
            if isinstance(value, str) and len(value) > ARG_REPR_LIMIT:
                return value[:ARG_REPR_LIMIT] + f"…[total_len={len(value)}]"
            return value if value is None or isinstance(value, (bool, int, float, str)) else {"repr": repr(value)}
        if isinstance(tree, (ast.List, ast.Tuple)):
            return [self.arg(e, refs) for e in tree.elts]
        if isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.USub) and isinstance(tree.operand, ast.Constant):
            return -tree.operand.value if isinstance(tree.operand.value, (int, float)) else {"repr": ast.unparse(tree)}
        if isinstance(tree, ast.Dict):
            return {ast.unparse(k) if k is not None else "**": self.arg(v, refs) for k, v in zip(tree.keys, tree.values)}
        for sub in ast.walk(tree):  # an expression: keep its text, still record the nodes it reads
            if isinstance(sub, ast.Name):
                idx = self.ref(sub.id)
                if idx is not None:
                    refs.append(idx)
        text = ast.unparse(tree)
        if len(text) > ARG_REPR_LIMIT:
            text = text[:ARG_REPR_LIMIT] + f"…[total_len={len(text)}]"
        return {"repr": text}

    # -- statements ------------------------------------------------------------------------------
    def statement(self, text: str, stack: str | None) -> None:
        try:
            module = ast.parse(text)
        except SyntaxError:
            self.bad += 1
            return
        if not module.body:
            return
        stmt = module.body[0]
        ann = None
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            name, value = stmt.target.id, stmt.value
            ann = stmt.annotation.value if isinstance(stmt.annotation, ast.Constant) else ast.unparse(stmt.annotation)
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name, value = stmt.targets[0].id, stmt.value
        elif isinstance(stmt, ast.Return):
            self.output(stmt.value)
            return
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            # a joint graph declares its flattened inputs first: ``primals_1: "f32[4]"``
            self.declared[stmt.target.id] = stmt.annotation.value if isinstance(stmt.annotation, ast.Constant) else None
            return
        elif (isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Tuple)
              and "tree_flatten_spec" in (_dotted(getattr(stmt.value, "func", None)) or "")):
            self.flatten_inputs([e.id for e in stmt.targets[0].elts if isinstance(e, ast.Name)])
            return
        elif isinstance(stmt, ast.Expr):  # a node whose value is unused, printed without a name
            name, value = f"_expr_{len(self.nodes)}", stmt.value
        else:
            self.bad += 1
            return
        if isinstance(value, ast.Name) and self.ref(value.id) is not None and ann is None:
            # ``l_x_ = L_x_``: Dynamo's placeholder printed under its target, renamed to its node name
            node = self.nodes[self.ref(value.id)]
            if node.op == "placeholder":
                self.aliases[node.name] = name
                del self.index[node.name]
                node.name = name
                self.index[name] = node.idx
                return
        op, target, args, kwargs, refs = self.call(value)
        shape, dtype, stride, device = parse_tensor_meta(ann) if isinstance(ann, str) else (None,) * 4
        node = self.add(TextNode(idx=0, name=name, op=op, target=target, args=args, kwargs=kwargs, shape=shape,
                                 dtype=dtype, stride=stride, device=device, size_bytes=_size_bytes(shape, dtype),
                                 stack_trace=stack))
        for pos, src in enumerate(refs):
            self.edges.append(TextEdge(src, node.idx, pos, self.nodes[src].size_bytes))

    def call(self, value: ast.AST) -> tuple[str, str, Any, dict, list[int]]:
        refs: list[int] = []
        if isinstance(value, ast.Call):
            func = value.func
            args = [self.arg(a, refs) for a in value.args]
            kwargs = {k.arg or "**": self.arg(k.value, refs) for k in value.keywords}
            dotted = _dotted(func)
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                return "call_module", func.attr, args, kwargs, refs
            if isinstance(func, ast.Attribute) and self._is_node_expr(func.value):
                obj_refs: list[int] = []
                obj = self.arg(func.value, obj_refs)
                return "call_method", func.attr, [obj, *args], kwargs, obj_refs + refs
            target = dotted.removeprefix("torch.ops.") if dotted else ast.unparse(func)
            return "call_function", target, args, kwargs, refs
        if isinstance(value, ast.BinOp):
            args = [self.arg(value.left, refs), self.arg(value.right, refs)]
            return "call_function", f"operator.{_BINOPS.get(type(value.op), type(value.op).__name__.lower())}", args, {}, refs
        if isinstance(value, ast.UnaryOp):
            return "call_function", f"operator.{_UNOPS.get(type(value.op), 'unary')}", [self.arg(value.operand, refs)], {}, refs
        if isinstance(value, ast.Compare) and len(value.ops) == 1:
            args = [self.arg(value.left, refs), self.arg(value.comparators[0], refs)]
            return "call_function", f"operator.{_CMPOPS.get(type(value.ops[0]), 'cmp')}", args, {}, refs
        if isinstance(value, ast.Subscript):
            args = [self.arg(value.value, refs), self.arg(value.slice, refs)]
            return "call_function", "operator.getitem", args, {}, refs
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self":
            return "get_attr", value.attr, [], {}, refs
        if isinstance(value, ast.Attribute) and self._is_node_expr(value.value):
            return "call_function", "builtins.getattr", [self.arg(value.value, refs), value.attr], {}, refs
        return "call_function", "constant", [self.arg(value, refs)], {}, refs

    def _is_node_expr(self, tree: ast.AST) -> bool:
        return isinstance(tree, ast.Name) and self.ref(tree.id) is not None

    def output(self, value: ast.AST | None) -> None:
        refs: list[int] = []
        if value is None:
            args: Any = None
            self.outputs = []
        else:
            args = self.arg(value, refs)
            elts = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
            self.outputs = [self.nodes[self.ref(e.id)].name if isinstance(e, ast.Name) and self.ref(e.id) is not None
                            else None for e in elts]
        node = self.add(TextNode(idx=0, name="output", op="output", target="output", args=[args]))
        for pos, src in enumerate(refs):
            self.edges.append(TextEdge(src, node.idx, pos, self.nodes[src].size_bytes))


def _dotted(tree: ast.AST) -> str | None:
    parts = []
    while isinstance(tree, ast.Attribute):
        parts.append(tree.attr)
        tree = tree.value
    if isinstance(tree, ast.Name):
        parts.append(tree.id)
        return ".".join(reversed(parts))
    return None


def _strip_comment(line: str) -> tuple[str, str | None]:
    """``'add,  # PlainAOTOutput(idx=0)'`` → ``('add,', 'PlainAOTOutput(idx=0)')`` (a ``#`` inside a
    string literal is kept)."""
    if "#" not in line:
        return line, None
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i].rstrip(), line[i + 1:].strip()
    return line, None


def parse_fx_text(text: str) -> TextGraph:
    """Parse the printed graph ``text`` (its first ``forward``; nested sub-module classes, as in
    DDPOptimizer's split graph, are skipped). Statements that do not parse are counted in
    ``bad_statements``, never raised. Raises nothing."""
    b = _Builder()
    lines = text.split("\n")
    i, n = 0, len(lines)
    while i < n and "def forward(" not in lines[i]:
        i += 1
    if i == n:
        return _finish(b)
    def_indent = len(lines[i]) - len(lines[i].lstrip())
    # Signature: one line "def forward(self, a: "..", b)" or one argument per line up to "):".
    sig = lines[i].strip()[len("def forward("):]
    if sig.rstrip().endswith("):") or sig.rstrip().endswith(")"):
        params = [(p, None) for p in _split_top_level(sig.rstrip().removesuffix(":").rstrip().removesuffix(")"))]
    else:
        params = []
        i += 1
        while i < n and not lines[i].strip().startswith(")"):
            params.append(_strip_comment(lines[i].strip()))
            i += 1
    for raw, desc in params:
        m = _PARAM_RE.match(raw)
        if m is None or m.group("name") == "self":
            continue
        ann = m.group("ann")
        shape, dtype, stride, device = parse_tensor_meta(ann)
        b.add(TextNode(idx=0, name=m.group("name"), op="placeholder", target=m.group("name"), shape=shape,
                       dtype=dtype, stride=stride, device=device, size_bytes=_size_bytes(shape, dtype),
                       desc=desc or m.group("desc")))
    i += 1
    stack: str | None = None
    while i < n:
        line = lines[i]
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        i += 1
        if not stripped:
            continue
        if indent <= def_indent:
            break  # the end of forward: a nested class or the next method
        if stripped.startswith("#"):
            m = _FILE_RE.match(stripped)
            if m is not None:
                stack = _stack_trace(m)
            elif stripped.startswith("# No stacktrace found"):
                stack = None
            continue
        if stripped.startswith("return") and stripped.rstrip()[-1:] in ("(", "["):
            items = []
            while i < n and lines[i].strip()[:1] not in (")", "]"):
                items.append(_strip_comment(lines[i].strip()))
                i += 1
            i += 1
            b.output_descs = [d for _, d in items]
            b.statement("return (" + " ".join(t for t, _ in items) + ")", stack)
            continue
        head, sep, tail = stripped.partition(";  ")
        if sep and _FREE_RE.match(tail) and "#" not in tail:
            b.statement(head, stack)  # the common "x: ... = f(a);  a = None": no comment, one node
            continue
        code, comment = _strip_comment(stripped)
        decl = _DECL_RE.match(code)
        if decl and comment:  # a joint graph's input declaration keeps its AOT descriptor
            b.input_descs[decl.group(1)] = comment
        for part in _split_statements(code):
            if _FREE_RE.match(part):  # FX's "a = b = None" frees, not nodes
                continue
            b.statement(part, stack)
    return _finish(b)


def _split_statements(code: str) -> list[str]:
    """``'x: "f32[2]" = f(a);  a = None'`` → the two statements (``;`` outside quotes/brackets)."""
    if ";" not in code:
        return [code]
    return [p.strip() for p in _split_outside(code, ";") if p.strip()]


def _finish(b: _Builder) -> TextGraph:
    hasher = hashlib.sha256()
    for node in b.nodes:
        hasher.update(f"{node.op}|{node.target}|{node.shape}|{node.dtype}|{node.stride};".encode())
    for e in b.edges:
        hasher.update(f"{e.src_idx}>{e.dst_idx}:{e.arg_pos};".encode())
    descs = b.output_descs if len(b.output_descs) == len(b.outputs) else [None] * len(b.outputs)
    return TextGraph(nodes=b.nodes, edges=b.edges, outputs=b.outputs, output_descs=descs,
                     structural_hash=hasher.hexdigest()[:32], bad_statements=b.bad)


# NOTE: [AOT descriptors] AOTAutograd prints each input/output's descriptor as a comment, e.g.
# ``PlainAOTInput(idx=1)``, ``ParamAOTInput(target='emb.weight')``,
# ``GradAOTOutput(grad_of=PlainAOTInput(idx=1))`` (torch/_functorch/_aot_autograd/descriptors.py).
_PLAIN_RE = re.compile(r"^PlainAOTInput\(idx=(\d+)\)$")
_PARAM_DESC_RE = re.compile(r"^(?:ParamAOTInput|BufferAOTInput)\(target=['\"]([^'\"]+)['\"]\)$")
_GRAD_RE = re.compile(r"^GradAOTOutput\(grad_of=(.*)\)$")


def input_ref(desc: str | None) -> int | str | None:
    """The Dynamo-graph input an AOT input descriptor names: ``PlainAOTInput(idx=3)`` → ``3``,
    ``ParamAOTInput(target='emb.weight')`` → ``"emb.weight"``; anything else → ``None``."""
    if not desc:
        return None
    desc = desc.strip()
    m = _PLAIN_RE.match(desc)
    if m:
        return int(m.group(1))
    m = _PARAM_DESC_RE.match(desc)
    return m.group(1) if m else None


def grad_of(desc: str | None) -> str | None:
    """``GradAOTOutput(grad_of=PlainAOTInput(idx=1))`` → ``"PlainAOTInput(idx=1)"``; else ``None``."""
    if not desc:
        return None
    m = _GRAD_RE.match(desc.strip())
    return m.group(1) if m else None


_SOURCE_KEY_RE = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


def fqn_from_source(source: str, is_parameter: bool = False) -> tuple[str, str] | None:
    """Dynamo source of a parameter or buffer → (fully-qualified name, kind):
    ``"L['self']._modules['blk']._parameters['weight']"`` → ``("blk.weight", "parameter")``;
    with ``is_parameter`` (``describe_tensor`` says so) also the attribute form older torch prints,
    ``"L['self'].layers[0].weight"`` → ``("layers.0.weight", "parameter")``. DDP's ``module.`` root
    dropped; sources that are not module attributes → ``None``."""
    if "_parameters" in source:
        kind = "parameter"
    elif "_buffers" in source:
        kind = "buffer"
    elif is_parameter and source.startswith(("L[", "G[")) and "." in source:
        kind = "parameter"
    else:
        return None
    text = re.sub(r"^(?:L|G)\[['\"][^'\"]+['\"]\]", "", source)
    text = text.replace("._modules", "").replace("._parameters", "").replace("._buffers", "")
    text = _SOURCE_KEY_RE.sub(lambda m: "." + m.group(1), text)
    parts = [p for p in text.split(".") if p]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return (".".join(parts), kind) if parts else None


def placeholder_key(name: str) -> str:
    """The form Dynamo gives a source as a placeholder name, case-folded for matching:
    ``"L['s']._modules['emb']._parameters['weight']"`` and ``"l_s_modules_emb_parameters_weight_"``
    both → ``"l_s_modules_emb_parameters_weight_"``."""
    return re.sub(r"_+", "_", re.sub(r"[^a-zA-Z0-9]", "_", name)).lower()


def fqn_from_placeholder(name: str) -> tuple[str, str] | None:
    """Fallback when the log has no ``describe_source``: ``"l_self_modules_blk_parameters_weight_"``
    → ``("blk.weight", "parameter")`` (module names containing ``_modules_`` are ambiguous)."""
    m = re.match(r"^[Ll]_(?:\w+?)_(modules_.*_)?(parameters|buffers)_(\w+?)_$", name)
    if m is None:
        return None
    mods = [p for p in re.split(r"_modules_", "_" + (m.group(1) or "")) if p.strip("_")]
    parts = [p.strip("_") for p in mods] + [m.group(3)]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts), "parameter" if m.group(2) == "parameters" else "buffer"


# NOTE: [Module paths of imported graphs] A printed graph carries no nn_module_stack, so the
# graph view's clusters are inferred: a parameter placeholder belongs to the module owning the
# parameter ("blk2.weight" -> "blk2"); an op reading a parameter placeholder belongs there too;
# and the other ops of the same "# File:" block (one source line) join them when that block's ops
# point at a single module. Inferred paths are marked in the node's meta (module_path: inferred).
def module_paths(text: TextGraph, owner_of_placeholder: dict[str, str]) -> dict[str, str]:
    """Node name → module path ``"a/b"`` for the nodes the rule above places (others absent)."""
    paths = dict(owner_of_placeholder)
    inputs: dict[int, list[int]] = {}
    for e in text.edges:
        inputs.setdefault(e.dst_idx, []).append(e.src_idx)
    nodes = text.nodes
    for n in nodes:
        if n.op in ("placeholder", "output") or n.name in paths:
            continue
        for src in inputs.get(n.idx, ()):
            got = owner_of_placeholder.get(nodes[src].name) if nodes[src].op == "placeholder" else None
            if got:
                paths[n.name] = got
                break
    block: list = []
    for n in [*nodes, None]:
        if n is not None and n.op not in ("placeholder", "output") and block and n.stack_trace == block[0].stack_trace:
            block.append(n)
            continue
        found = {paths[b.name] for b in block if b.name in paths}
        if block and block[0].stack_trace and len(found) == 1:
            path = found.pop()
            for b in block:
                paths.setdefault(b.name, path)
        block = [n] if n is not None and n.op not in ("placeholder", "output") else []
    return paths
