"""Facts the runtime checks of RLG016-RLG019 and the preflight share: which modules have dropout on, how close
two scorings of the same rows must be for a dtype, and how to take rows of (or pad) a batch-shaped argument.

Kept free of the decorator machinery so that ``rlguard.preflight`` uses the very same definitions.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any, Callable

import torch
from torch import nn

# Attributes through which modules apply dropout functionally while ``self.training`` is on (Hugging Face
# attention modules keep the rate as a float, ``attention_dropout``; others ``dropout_p`` or ``dropout``).
_DROPOUT_ATTRS = ("attention_dropout", "attn_dropout", "dropout_p", "dropout", "attn_pdrop", "resid_pdrop")


def dropout_rate(m: nn.Module) -> float:
    """The dropout rate ``m`` applies in train mode (0.0: none it is known to apply)."""
    if isinstance(m, nn.modules.dropout._DropoutNd):
        return float(m.p)
    for attr in _DROPOUT_ATTRS:
        v = m.__dict__.get(attr)
        if isinstance(v, float) and not isinstance(v, bool):
            return v
    return 0.0


def dropout_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` that can apply dropout (a dropout module, or a float dropout attribute), whatever
    its rate now: a rate may be raised later. Computed once per model by the callers that watch it."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) or any(
                isinstance(m.__dict__.get(a), float) for a in _DROPOUT_ATTRS):
            out.append((name or type(m).__name__, m))
    return out


def active_dropout(model: Any, modules: list[tuple[str, nn.Module]] | None = None) -> list[tuple[str, float]]:
    """``(name, rate)`` of the modules of ``model`` whose dropout is on now (train mode and a rate above 0)."""
    if modules is None:
        if not isinstance(model, nn.Module):
            return []
        modules = dropout_modules(model)
    return [(name, dropout_rate(m)) for name, m in modules if m.training and dropout_rate(m) > 0]


def describe_dropout(found: list[tuple[str, float]]) -> str:
    head = ", ".join(f"{name!r} (p={p:g})" for name, p in found[:3])
    return head + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def row_tolerance(*dtypes: torch.dtype) -> tuple[float, float]:
    """(mean, max) absolute gap allowed between two scorings of the same tokens computed in ``dtypes``.

    Two correct scorings of a row in different batches (other batch size, other padding) differ by the rounding
    of reordered sums: about 1e-7 in float32, up to a few units of the last place of a logit in bfloat16 (0.06 at
    a logit of 8). A padding leak moves whole rows by much more (attention to pads, shifted positions). The
    limits: float64 1e-9 / 1e-6, float32 1e-4 / 1e-2, half precision 0.05 / 1.0 (mean over the row's tokens, max).
    """
    worst = torch.float64
    for d in dtypes:
        if d.is_floating_point and torch.finfo(d).eps > torch.finfo(worst).eps:
            worst = d
    if worst == torch.float64:
        return 1e-9, 1e-6
    if worst == torch.float32:
        return 1e-4, 1e-2
    return 5e-2, 1.0


def order_tolerance(*dtypes: torch.dtype) -> float:
    """Relative gap allowed between a loss (or its gradient) and the same loss of the same rows in another order,
    computed in ``dtypes``: reordered sums round differently, by about 1e-7 relative in float32 and up to a few
    1e-3 in bfloat16 (a healthy bf16 trainer's gradient moves by ~2e-3). A field out of step with the other rows
    moves it by O(1). The limits: float32 / float64 1e-4, half precision 2e-2."""
    return 1e-4 if row_tolerance(*dtypes)[0] <= 1e-4 else 2e-2


def compute_dtypes(*objs: Any) -> list[torch.dtype]:
    """The floating dtypes of the given tensors and of the first parameter of the given modules."""
    out = []
    for o in objs:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            out.append(o.dtype)
        elif isinstance(o, nn.Module):
            for p in o.parameters():
                if p.is_floating_point():
                    out.append(p.dtype)
                break
    return out


def gaps(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None) -> tuple[float, float, int]:
    """(mean, max, row of the max) of ``|a - b|`` over ``valid`` (float64; 0, 0, -1 when nothing is valid)."""
    d = (a.detach().double() - b.detach().double()).abs()
    if valid is not None:
        d = torch.where(valid.bool(), d, torch.zeros((), dtype=d.dtype, device=d.device))
        n = int(valid.bool().sum())
    else:
        n = d.numel()
    if n == 0:
        return 0.0, 0.0, -1
    worst = float(d.max())
    row = int(torch.nonzero(d == d.max())[0][0]) if d.dim() else 0
    return float(d.sum()) / n, worst, row


def take_rows(value: Any, rows: torch.Tensor, n: int, objects: bool = False) -> Any:
    """``value`` with its first dim (of size ``n``) indexed by ``rows``: tensors, lists and tuples of length ``n``,
    and dicts of them; anything else is returned as it is (configs, scalars, models). ``objects``: also dataclass
    instances and plain objects (their attributes), as shallow copies with the batch-shaped fields taken (an
    object none of whose fields is batch-shaped is returned as it is; modules never are copied)."""
    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v[rows.to(v.device)] if v.dim() >= 1 and v.shape[0] == n else v
        if isinstance(v, (list, tuple)) and len(v) == n and not isinstance(v, str):
            picked = [v[i] for i in rows.tolist()]
            return type(v)(picked) if isinstance(v, tuple) and not hasattr(v, "_fields") else picked
        return v

    return rebuild(value, leaf, objects)


def fields_of(value: Any) -> dict[str, Any] | None:
    """The fields of a dataclass instance, a named tuple or a plain object (its ``__dict__``), name -> value;
    None for anything else (tensors, modules, classes, functions, builtins, objects without a ``__dict__``)."""
    if value is None or isinstance(value, (torch.Tensor, nn.Module, type, str, bytes, int, float, bool, complex,
                                           torch.Generator, torch.dtype, torch.device)) or inspect.isroutine(value):
        return None
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if hasattr(value, f.name)}
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return dict(zip(type(value)._fields, value))
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return None
    d = getattr(value, "__dict__", None)
    out = dict(d) if isinstance(d, dict) else {}
    for klass in type(value).__mro__:  # __slots__ classes
        slots = klass.__dict__.get("__slots__", ())
        for name in ([slots] if isinstance(slots, str) else slots):
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                out.setdefault(name, getattr(value, name))
    return out if (out or isinstance(d, dict)) else None


def with_fields(value: Any, changed: dict[str, Any]) -> Any:
    """A shallow copy of ``value`` (a dataclass instance, named tuple or plain object) with ``changed`` fields set
    (frozen dataclasses included); the original is left as it is."""
    if isinstance(value, tuple) and hasattr(type(value), "_replace"):
        return value._replace(**changed)
    new = copy.copy(value)
    for k, v in changed.items():
        object.__setattr__(new, k, v)
    return new


def rebuild(value: Any, leaf: Callable[[Any], Any], objects: bool = False, _depth: int = 0) -> Any:
    """``value`` with ``leaf`` applied to it, or (when ``leaf`` returns it as it is) to each value of a dict and,
    with ``objects``, to each field of a dataclass instance, named tuple or plain object (a shallow copy, made
    only when a field changed); nested containers likewise, up to 4 levels."""
    new = leaf(value)
    if new is not value or _depth > 4:
        return new
    if isinstance(value, dict):
        return {k: rebuild(v, leaf, objects, _depth + 1) for k, v in value.items()}
    if objects:
        fields = fields_of(value)
        if fields:
            changed = {}
            for k, v in fields.items():
                nv = rebuild(v, leaf, objects, _depth + 1)
                if nv is not v:
                    changed[k] = nv
            if changed:
                return with_fields(value, changed)
    return value


def group_permutation(n: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """A permutation of ``n`` rows that keeps each group of ``group_size`` contiguous rows together (the groups
    shuffled, and the rows inside each group): group statistics are the same after it. Never the identity when
    another permutation exists (drawn again: the identity would check nothing; small batches draw it often)."""
    g = group_size if group_size and n % group_size == 0 else 1
    for _ in range(16):
        groups = torch.randperm(n // g, generator=generator)
        inner = torch.stack([torch.randperm(g, generator=generator) for _ in range(n // g)])
        perm = (groups[:, None] * g + inner).reshape(-1)
        if n < 2 or not torch.equal(perm, torch.arange(n)):
            break
    return perm
