"""Compile jaxtyping annotations into a per-function check plan, once, at decoration time.

jaxtyping's own ``isinstance`` machinery re-reads the annotation and copies its memo dicts on every check; here
each ``Float[Tensor, "B T-1"]`` becomes a :class:`TensorSpec`: a frozenset of torch dtypes and a flat list of
``(axis, kind, payload, broadcastable)`` operations. A call then runs in two phases over all tensors:

1. dtype, rank, fixed sizes and plain named dims (``B``, ``T``, ``*batch``), which bind on first sight;
2. symbolic dims (``T-1``, ``T+1``, ``2*T``), evaluated against the bindings of the whole call. A symbolic dim
   of the form ``name + c`` whose name no argument binds plainly binds the name itself (``T-1`` of size 255
   gives ``T=256``), so ``policy_loss(logp: "B T-1", mask: "B T-1")`` works without any ``[B, T]`` argument.

So the order of parameters never matters (plain jaxtyping evaluates ``T-1`` only after ``T`` was bound by an
earlier argument). Supported dim syntax: names, ints, ``_``, ``...``, ``*name``, ``#name`` (size 1 broadcasts),
``name=4``, and arithmetic expressions over dim names with ``+ - * //`` and int constants.
"""

from __future__ import annotations

import ast
import re
import typing
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import AbstractArray

from rlguard.catalog import LOGITS_LABEL_SHIFT, MASK_NOT_SHIFTED, TENSOR_CONTRACT
from rlguard.contracts.errors import ContractDefinitionError, Violation

try:  # private sentinels of jaxtyping 0.3.x (pinned by the [torch] extra)
    from jaxtyping._array_types import (
        _anonymous_dim,
        _anonymous_variadic_dim,
        _any_dtype,
        _FixedDim,
        _NamedDim,
        _NamedVariadicDim,
        _SymbolicDim,
    )
except ImportError as e:  # pragma: no cover - only with an unpinned jaxtyping
    raise ImportError("rlguard.contracts needs jaxtyping 0.3.x (pip install 'rlguard[torch]')") from e

FIXED, NAMED, SYMBOLIC = 1, 2, 3
_NO_BUILTINS: dict[str, Any] = {"__builtins__": {}}
_ALLOWED_OPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)
_ALL_TORCH_DTYPES = [v for v in vars(torch).values() if isinstance(v, torch.dtype)]
DOCS = "docs/rules/{code}.md"


ALIAS_KINDS: dict[Any, str] = {}  # alias annotation -> "mask" / "logp" (filled by rlguard.contracts.aliases)


def is_array_annotation(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, AbstractArray) and tp is not AbstractArray


def argument_kind(argument: str) -> str | None:
    """'mask' or 'logp' from an argument's name: chooses the likely-cause hint of a shape error."""
    low = argument.lower()
    if "mask" in low:
        return "mask"
    if any(k in low for k in ("logp", "logprob", "log_prob")):
        return "logp"
    return None


@dataclass(frozen=True)
class SymExpr:
    text: str
    code: Any  # compiled expression
    names: tuple[str, ...]
    inverse: tuple[str, int] | None  # ("T", -1) for "T-1": value = T + offset


def _parse_symbolic(text: str, where: str) -> SymExpr:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ContractDefinitionError(f"{where}: unknown dim syntax {text!r}") from None
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise ContractDefinitionError(f"{where}: dim {text!r}: only int constants are allowed")
        elif isinstance(node, ast.UnaryOp):
            # "-T", "T--1", "T+-1": jaxtyping reads them as expressions, but a signed term is a typo for T-1/T+1
            raise ContractDefinitionError(
                f"{where}: invalid dim {text!r}: a sign in front of a name or number is not a dim size; write "
                "binary expressions such as 'T-1', 'T+1', '2*T'")
        elif isinstance(node, ast.BinOp):
            op = node.op
            if not isinstance(op, _ALLOWED_OPS):
                raise ContractDefinitionError(
                    f"{where}: dim {text!r}: unsupported operator {type(op).__name__}; use + - * //")
        elif not isinstance(node, (ast.Expression, ast.Load, ast.operator, ast.unaryop)):
            raise ContractDefinitionError(
                f"{where}: unknown dim syntax {text!r} (names, ints and + - * // only; f-string dims and calls "
                "are not supported)")
    inverse = None
    body = tree.body
    if (isinstance(body, ast.BinOp) and isinstance(body.op, (ast.Add, ast.Sub))
            and isinstance(body.left, ast.Name) and isinstance(body.right, ast.Constant)):
        c = body.right.value
        inverse = (body.left.id, c if isinstance(body.op, ast.Add) else -c)
    return SymExpr(text, compile(tree, f"<dim {text}>", "eval"), tuple(dict.fromkeys(names)), inverse)


def _torch_dtypes(annotation: Any) -> frozenset | None:
    if annotation.dtypes is _any_dtype:
        return None
    out = set()
    for d in annotation.dtypes:
        if isinstance(d, str):
            t = getattr(torch, d, None)
            if isinstance(t, torch.dtype):
                out.add(t)
        elif isinstance(d, re.Pattern):
            out.update(t for t in _ALL_TORCH_DTYPES if d.match(str(t).removeprefix("torch.")))
    return frozenset(out)


_EXOTIC = re.compile(r"^(float8|float4|u?int[1-7]$|bits|complex32)")


def _dtype_label(annotation: Any, dtypes: frozenset | None) -> str:
    if dtypes is None:
        return "any"
    label = getattr(annotation.dtype, "label", None)
    if isinstance(label, str):
        return label
    names = sorted(str(d).removeprefix("torch.") for d in dtypes)
    common = [n for n in names if not _EXOTIC.match(n)] or names
    if len(common) <= 2:
        return " or ".join(common)
    return f"{annotation.dtype.__name__.lower()} ({', '.join(common)})"


class TensorSpec:
    """One tensor argument (or return element) compiled: what ``check`` needs, nothing re-parsed per call."""

    __slots__ = ("argument", "function", "label", "dim_str", "dtypes", "dtype_label", "ops", "ndim",
                 "variadic", "var_index", "optional", "kind", "plain_names", "sym_names", "inverse_names", "fast")

    def __init__(self, annotation: Any, argument: str, function: str, optional: bool = False) -> None:
        where = f"{function}(), argument {argument!r}"
        if annotation.array_type is not torch.Tensor:
            raise ContractDefinitionError(
                f"{where}: rlguard contracts check torch tensors; got an annotation over {annotation.array_type!r}")
        self.argument = argument
        self.function = function
        self.label = annotation.__name__
        self.dim_str = annotation.dim_str
        self.dtypes = _torch_dtypes(annotation)
        self.dtype_label = _dtype_label(annotation, self.dtypes)
        self.optional = optional
        if argument.startswith("return"):
            self.kind = ALIAS_KINDS.get(annotation) or argument_kind(function.rsplit(".", 1)[-1])
        else:
            self.kind = argument_kind(argument) or ALIAS_KINDS.get(annotation)
        dims = annotation.dims
        self.var_index = annotation.index_variadic
        self.ndim = len(dims) - (0 if self.var_index is None else 1)
        self.variadic: str | None = None
        self.plain_names: set[str] = set()
        self.sym_names: set[str] = set()
        self.inverse_names: set[str] = set()
        ops = []
        for i, d in enumerate(dims):
            axis = i if (self.var_index is None or i < self.var_index) else i - len(dims)
            if d is _anonymous_dim:
                continue
            if d is _anonymous_variadic_dim:
                self.variadic = ""
                continue
            if type(d) is _NamedVariadicDim:
                if d.treepath:
                    raise ContractDefinitionError(f"{where}: tree-path dims ('?') are not supported")
                self.variadic = "*" + d.name
                self.plain_names.add(self.variadic)
                continue
            if type(d) is _FixedDim:
                if d.size < 0:
                    raise ContractDefinitionError(
                        f"{where}: invalid dim {d.size} in {self.dim_str!r}: sizes are >= 0 (dims are separated by "
                        "spaces, so 'B -1' is the two dims 'B' and '-1'; write 'B T-1' for one less than T)")
                ops.append((axis, FIXED, d.size, d.broadcastable))
            elif type(d) is _NamedDim:
                if d.treepath:
                    raise ContractDefinitionError(f"{where}: tree-path dims ('?') are not supported")
                ops.append((axis, NAMED, d.name, d.broadcastable))
                self.plain_names.add(d.name)
            elif type(d) is _SymbolicDim:
                expr = _parse_symbolic(d.elem, where)
                ops.append((axis, SYMBOLIC, expr, d.broadcastable))
                self.sym_names.update(expr.names)
                if expr.inverse:
                    self.inverse_names.add(expr.inverse[0])
            else:  # pragma: no cover - a jaxtyping we do not know
                raise ContractDefinitionError(f"{where}: unknown dim {d!r} in {self.dim_str!r}")
        self.ops = tuple(ops)
        self.fast = self._compile_fast()

    def _compile_fast(self) -> Any:
        """Generate ``fast(x, b, deferred) -> bool``: phase 1 unrolled into straight-line Python.

        It only says pass/fail (no message); on a failure the decorator re-runs :meth:`check` to explain it.
        Specs with variadic dims use :meth:`check` directly.
        """
        if self.var_index is not None:
            def fast(x: Any, b: dict, deferred: list, _check: Any = self.check) -> bool:
                return _check(x, b, {}, deferred) is None

            return fast
        ns: dict[str, Any] = {"_T": torch.Tensor, "_D": self.dtypes, "_spec": self}
        lines = ["def fast(x, b, deferred):",
                 "    if not isinstance(x, _T):",
                 f"        return x is None and {self.optional!r}"]
        if self.dtypes is not None:
            lines.append("    if x.dtype not in _D: return False")
        names = [f"d{i}" for i in range(self.ndim)]
        if self.ndim:  # unpacking checks the rank and reads the sizes in one step
            lines += ["    try:", f"        {', '.join(names)}, = x.shape", "    except ValueError:",
                      "        return False"]
        else:
            lines.append("    if x.dim() != 0: return False")
        for k, (axis, kind, p, bc) in enumerate(self.ops):
            axis = names[axis]
            ind = "    "
            if bc:
                lines.append(f"    if {axis} != 1:")
                ind = "        "
            if kind == NAMED:
                lines += [f"{ind}v = b.get({p!r})",
                          f"{ind}if v is None: b[{p!r}] = {axis}",
                          f"{ind}elif v != {axis}: return False"]
            elif kind == FIXED:
                lines.append(f"{ind}if {axis} != {p!r}: return False")
            else:
                ns[f"_e{k}"] = p
                lines.append(f"{ind}deferred.append((_spec, {axis[1:]}, {axis}, _e{k}, False))")
        lines.append("    return True")
        exec(compile("\n".join(lines), f"<rlguard spec {self.function}:{self.argument}>", "exec"), ns)  # noqa: S102
        return ns["fast"]

    # -- per call -------------------------------------------------------------------------------------------
    def check(self, x: Any, b: dict, src: dict, deferred: list) -> str | None:
        """Phase 1: dtype, rank, fixed and plain named dims. Returns a problem string or None."""
        if not isinstance(x, torch.Tensor):
            if x is None and self.optional:
                return None
            return f"expected a torch.Tensor, got {type(x).__name__}"
        if self.dtypes is not None and x.dtype not in self.dtypes:
            return f"dtype is {str(x.dtype).removeprefix('torch.')}, expected {self.dtype_label}"
        shape = x.shape
        n = len(shape)
        if self.var_index is None:
            if n != self.ndim:
                return f"has {n} dims, expected {self.ndim} ({self.dim_str!r})"
        elif n < self.ndim:
            return f"has {n} dims, expected at least {self.ndim} ({self.dim_str!r})"
        for axis, kind, p, bc in self.ops:
            size = shape[axis]
            if kind == NAMED:
                prev = b.get(p)
                if prev is None:
                    if not (bc and size == 1):
                        b[p] = size
                        src[p] = self.argument
                elif prev != size and not (bc and size == 1):
                    return f"dim {axis % n} ({p}) is {size}, but {p}={prev}"
            elif kind == FIXED:
                if size != p and not (bc and size == 1):
                    return f"dim {axis % n} is {size}, expected {p}"
            else:
                deferred.append((self, axis % n, size, p, bc))
        if self.variadic:
            i = self.var_index
            sub = tuple(shape[i:n - (self.ndim - i)])
            prev = b.get(self.variadic)
            if prev is None:
                b[self.variadic] = sub
                src[self.variadic] = self.argument
            elif prev != sub:
                return f"dims {self.variadic} are {sub}, but {self.variadic}={prev}"
        return None

    def violation(self, x: Any, problem: str, b: dict, src: dict, code: str = TENSOR_CONTRACT,
                  hint: str | None = None) -> Violation:
        return Violation(code, self.function, self.argument,
                         format_message(code, self.function, self.argument, problem,
                                        expected=f"{self.label}  (dtype {self.dtype_label})",
                                        bindings=b, sources=src, got=describe(x), hint=hint))


def check_deferred(deferred: list, b: dict, src: dict | None) -> tuple[TensorSpec, str, str | None] | None:
    """Phase 2: the symbolic dims of every tensor of the call, against the bindings of the whole call.

    Returns ``(spec, problem, hint_name)`` for the first failure: ``hint_name`` is the dim name of an
    expression ``name-1`` whose argument arrived with size ``name`` (the one-token shift of RLG001/RLG012).
    """
    for spec, axis, size, expr, bc in deferred:
        if bc and size == 1:
            continue
        inv = expr.inverse
        if inv is not None:  # fast path for "name + c": no eval
            base = b.get(inv[0])
            if base is None:
                b[inv[0]] = size - inv[1]
                if src is not None:
                    src[inv[0]] = spec.argument
                continue
            if base + inv[1] == size:
                continue
        try:
            value = eval(expr.code, _NO_BUILTINS, b)  # noqa: S307 - compiled from a checked AST, no builtins
        except NameError:
            missing = [n for n in expr.names if n not in b]
            return spec, f"cannot evaluate {expr.text!r}: {', '.join(missing)} not bound by any argument", None
        if value != size:
            shift = None
            inv = expr.inverse
            if inv is not None and inv[1] == -1 and size == b.get(inv[0]):
                shift = inv[0]
            bound = ", ".join(f"{n}={b[n]}" for n in expr.names)
            return spec, f"dim {axis} is {size}, but {expr.text} = {value} with {bound}", shift
    return None


def shift_hint(spec: TensorSpec, name: str) -> tuple[str, str]:
    """The code and likely cause for a per-token tensor that arrived one token too long."""
    if spec.kind == "mask":
        return MASK_NOT_SHIFTED, (f"mask aligned to ids, not ids[:, 1:]? It has {name} columns where the per-token "
                          f"tensors have {name}-1: build it from owner[:, 1:] (or mask[:, 1:]); see RLG001")
    if spec.kind == "logp":
        return LOGITS_LABEL_SHIFT, ("log-probs gathered from logits[:, t] against ids[:, t] (no shift)? Use "
                          "logits[:, :-1] against ids[:, 1:]; see RLG012")
    return TENSOR_CONTRACT, (f"per-token tensors are aligned to ids[:, 1:] and have {name}-1 columns; this one has "
                      f"{name}; see RLG000")


def describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        extra = ""
        if x.requires_grad or x.grad_fn is not None:
            extra = f", requires_grad={x.requires_grad}"
            if x.grad_fn is not None:
                extra += f", grad_fn={type(x.grad_fn).__name__}"
        return (f"shape {tuple(x.shape)}, dtype {str(x.dtype).removeprefix('torch.')}, "
                f"device {x.device}{extra}")
    text = repr(x)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(x).__name__} {text}"


def format_bindings(b: dict, src: dict | None = None) -> str:
    if not b:
        return "(none)"
    text = ", ".join(f"{k}={v}" for k, v in b.items())
    if src:
        by: dict[str, list[str]] = {}
        for k, a in src.items():
            if k in b:
                by.setdefault(a, []).append(k)
        text += "  (" + "; ".join(f"{', '.join(ks)} from {a}" for a, ks in by.items()) + ")"
    return text


def format_message(code: str, function: str, argument: str, problem: str, *, expected: str | None = None,
                   bindings: dict | None = None, sources: dict | None = None, got: str | None = None,
                   hint: str | None = None) -> str:
    where = "return value" if argument.startswith("return") else f"argument {argument!r}"
    if argument.startswith("return["):
        where = f"return value {argument[6:]}"
    lines = [f"{code} {function}(): {where}: {problem}"]
    if expected is not None:
        lines.append(f"  expected: {expected}")
    if bindings is not None:
        lines.append(f"  bindings so far: {format_bindings(bindings, sources)}")
    if got is not None:
        lines.append(f"  got: {got}")
    if hint:
        lines.append(f"  likely cause: {hint}")
    lines.append(f"  see: {DOCS.format(code=code)}")
    return "\n".join(lines)


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``Optional[X]`` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False
