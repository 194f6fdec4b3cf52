"""``@row_independent`` (RLG016) and ``@permutation_invariant`` (RLG019): checks at the point of use that call the
decorated function once or twice more on a changed batch.

``@row_independent``: RLG016. A scoring function's values for a row must not depend on how
much padding the row carries or on which rows share its batch.

On a cadence (``every``-th call, the first included), after the real call, the function is called twice more on
one row of the batch (a different row each time): the row alone (its neighbours gone) and the row alone with
``extra`` columns of padding (``pad_id`` in the ids, 0 in the mask and in every other per-token argument, on
``side``). Both must reproduce the row's values from the real call on its valid positions, within a tolerance
for the dtype (:func:`rlguard.contracts.invariance.row_tolerance`). A padded re-call that fails (more positions
than the model has) is logged once and dropped: the neighbour check goes on. The re-calls run under ``torch.no_grad()``
with the random number generators forked, their results are discarded, and the real call's return value is
returned untouched: training is not changed (a function with side effects, a cache or a counter, sees two more
calls). They are skipped while a module among the arguments (or a module attribute of ``self``) has dropout
on: two passes could not agree anyway (RLG018). An error inside the check itself is logged once and switches
the check off for that function; only a violation is reported (raised in ``raise`` mode).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlguard.catalog import PADDING_LEAK, ROWS_OUT_OF_STEP
from rlguard.contracts.errors import ContractDefinitionError, Violation
from rlguard.contracts.invariance import (
    active_dropout, compute_dtypes, describe_dropout, gaps, group_permutation, row_tolerance, take_rows,
)
from rlguard.contracts.settings import STATE, report
from rlguard.contracts.spec import format_message

_log = logging.getLogger("rlguard.contracts")
_PATH = re.compile(r"^([A-Za-z_]\w*)(?:\[['\"]([^'\"]+)['\"]\])?$")


def _path(fn_name: str, params: list[str], what: str, text: str | None) -> tuple[str, str | None] | None:
    if text is None:
        return None
    m = _PATH.match(text) if isinstance(text, str) else None
    if m is None or m.group(1) not in params:
        raise ContractDefinitionError(
            f"{fn_name}(): row_independent({what}={text!r}): {what} names a parameter or a key of a dict parameter "
            f"(\"input_ids\", \"batch['input_ids']\"); parameters: {', '.join(params) or 'none'}")
    return m.group(1), m.group(2)


def _get(values: dict, path: tuple[str, str | None] | None) -> Any:
    if path is None:
        return None
    v = values.get(path[0])
    return v.get(path[1]) if path[1] is not None and isinstance(v, dict) else (None if path[1] else v)


def _set(values: dict, path: tuple[str, str | None], new: Any) -> None:
    if path[1] is None:
        values[path[0]] = new
    else:
        values[path[0]] = dict(values[path[0]], **{path[1]: new})


def _pad(x: torch.Tensor, extra: int, side: str, value: Any) -> torch.Tensor:
    pad = [0, 0] * (x.dim() - 2) + ([extra, 0] if side == "left" else [0, extra])
    return F.pad(x, pad, value=value)


def _modules(values: dict) -> list[nn.Module]:
    out = []
    for v in values.values():
        if isinstance(v, nn.Module):
            out.append(v)
        elif v is not None and hasattr(v, "__dict__") and not isinstance(v, (torch.Tensor, type)):
            out += [a for a in vars(v).values() if isinstance(a, nn.Module)]  # self.model, self.ref_model
    return out


def _pick(out: Any, output: int | None) -> Any:
    return out[output] if output is not None and isinstance(out, (tuple, list)) else out


class _Recheck:
    """The machinery both decorators share: the signature bound once, a call counter for the cadence, the
    re-calls under no_grad with the random generators forked, the notes logged once, and an error of the check
    itself logged once, switching it off for that function. ``make(self)`` returns ``check(values, out)``."""

    def __init__(self, f: Callable, decorator: str, every: int, make: Callable) -> None:
        self.f, self.decorator, self.every = f, decorator, every
        self.name = getattr(f, "__qualname__", getattr(f, "__name__", repr(f)))
        try:
            self.sig = inspect.signature(f)
        except (TypeError, ValueError) as exc:
            raise ContractDefinitionError(f"{decorator} on {self.name}: no signature ({exc})") from exc
        self.params = list(self.sig.parameters)
        self.state: dict[str, Any] = {"calls": 0, "on": True, "noted": set()}
        self.check = make(self)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = f(*args, **kwargs)
            if STATE.mode == "off" or not self.state["on"]:
                return out
            self.state["calls"] += 1
            if (self.state["calls"] - 1) % every:
                return out
            try:
                bound = self.sig.bind(*args, **kwargs)
                bound.apply_defaults()
                violation = self.check(dict(bound.arguments), out)
            except Exception as exc:  # noqa: BLE001 - rlguard's own failure must not stop the run it watches
                self.state["on"] = False
                _log.warning("rlguard: %s on %s() failed (%s: %s) and is switched off for it", decorator,
                             self.name, type(exc).__name__, exc)
                return out
            if violation is not None:
                report([violation])
            return out

        wrapper.__rlguard_recheck__ = self.state  # type: ignore[attr-defined]
        self.wrapper = wrapper

    def note(self, key: str, text: str) -> None:
        if key not in self.state["noted"]:
            self.state["noted"].add(key)
            _log.warning("rlguard: %s on %s(): %s", self.decorator, self.name, text)

    def call(self, values: dict) -> Any:
        again = inspect.BoundArguments(self.sig, values)  # in signature order: *args and **kwargs as they came
        return self.f(*again.args, **again.kwargs)

    @staticmethod
    def quiet(values: dict):
        """no_grad, and the CPU's and the arguments' CUDA devices' generators forked (restored after)."""
        import contextlib

        devices = sorted({v.device.index or 0 for v in values.values()
                          if isinstance(v, torch.Tensor) and v.device.type == "cuda"})
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.random.fork_rng(devices=devices))
        return stack


def row_independent(fn: Callable | None = None, *, ids: str = "input_ids", mask: str | None = "attention_mask",
                    pad_id: int = 0, every: int = 16, extra: int = 8, side: str = "right",
                    tol: tuple[float, float] | None = None, output: int | None = None) -> Callable:
    """Decorate a scoring function (``logps = f(model, input_ids, attention_mask)`` -> ``[B, T]`` or
    ``[B, T-1]``) with the RLG016 row-independence check.

    ``ids`` / ``mask``: the token ids and attention mask (a parameter, or ``"batch['input_ids']"`` for a key of a
    dict parameter; ``mask=None``: there is none). ``pad_id``: what padding ids hold. ``side``: ``"right"``
    (default: with causal attention right padding never changes earlier positions, so any change is a leak) or
    ``"left"`` (for left-padded layouts that pass position ids). ``tol``: ``(mean, max)`` absolute gaps allowed
    (default: by dtype). ``output``: the index of the tensor to compare when the function returns a tuple.
    """
    if side not in ("right", "left"):
        raise ContractDefinitionError(f"row_independent(side={side!r}): 'right' or 'left'")
    for name, v in (("every", every), ("extra", extra)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ContractDefinitionError(f"row_independent({name}={v!r}): a positive int")

    def apply(f: Callable) -> Callable:
        def make(r: "_Recheck") -> Callable[[dict, Any], Violation | None]:
            ids_path = _path(r.name, r.params, "ids", ids)
            mask_path = _path(r.name, r.params, "mask", mask)
            r.state["pad"] = True

            def check(values: dict, out: Any) -> Violation | None:
                x, idt = _pick(out, output), _get(values, ids_path)
                if not isinstance(x, torch.Tensor) or not isinstance(idt, torch.Tensor) or idt.dim() != 2:
                    return None
                b, t = idt.shape
                if x.dim() < 2 or x.shape[0] != b or x.shape[1] not in (t, t - 1):
                    r.note("layout", f"the return value {tuple(x.shape)} is not aligned to {ids} {tuple(idt.shape)} "
                                     "([B, T] or [B, T-1]): not checked")
                    return None
                modules = _modules(values)
                busy = [found for m in modules for found in active_dropout(m)]
                if busy:
                    r.note("dropout", f"not checked while dropout is on ({describe_dropout(busy)}): two passes differ")
                    return None
                row = (r.state["calls"] // every) % b
                rows = torch.tensor([row], device=idt.device)
                alone = {k: take_rows(v, rows, b) for k, v in values.items()}
                padded = dict(alone)
                for k, v in alone.items():  # every per-token argument gets the padding columns
                    if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] in (t, t - 1):
                        padded[k] = _pad(v, extra, side, 0)
                    elif isinstance(v, dict):
                        padded[k] = {kk: _pad(vv, extra, side, 0) if isinstance(vv, torch.Tensor) and vv.dim() >= 2
                                     and vv.shape[1] in (t, t - 1) else vv for kk, vv in v.items()}
                _set(padded, ids_path, _pad(_get(alone, ids_path), extra, side, pad_id))
                with r.quiet(values):
                    first = _pick(r.call(alone), output).detach()
                    second = None
                    if r.state["pad"]:
                        try:
                            second = _pick(r.call(padded), output).detach()
                        except Exception as exc:  # noqa: BLE001 - e.g. more positions than the model has
                            r.state["pad"] = False
                            r.note("pad", f"the re-call with {extra} more columns of padding failed "
                                          f"({type(exc).__name__}: {exc}); only the neighbour check runs")
                m = _get(values, mask_path)
                keep = (m[row] != 0) if isinstance(m, torch.Tensor) and m.shape == idt.shape else (idt[row] != pad_id)
                valid = keep if x.shape[1] == t else keep[1:] & keep[:-1]
                if second is not None:
                    second = second[:, extra:] if side == "left" else second[:, : x.shape[1]]
                mean_tol, max_tol = tol or row_tolerance(*compute_dtypes(x, *modules))
                for what, other in (("alone in its batch (its neighbours removed)", first),
                                    (f"with {extra} more columns of {side} padding", second)):
                    if other is None or other.shape[1:] != x.shape[1:]:
                        continue
                    mean, top, _ = gaps(other[0], x[row], valid)
                    if mean > mean_tol or top > max_tol:
                        problem = (f"row {row}'s values change when it is scored {what}: mean gap {mean:.3g}, max "
                                   f"{top:.3g} over {int(valid.sum())} valid positions (allowed {mean_tol:g} / "
                                   f"{max_tol:g})")
                        return Violation(PADDING_LEAK, r.name, "return", format_message(
                            PADDING_LEAK, r.name, "return", problem, got=f"{tuple(x.shape)} {x.dtype}",
                            hint=f"a forward on padded ids without the attention mask ({mask or 'none given'}) or "
                                 "the position ids its padding needs, or packed rows that attend to each other; "
                                 "see RLG016"))
                return None

            return check

        return _Recheck(f, "row_independent", every, make).wrapper

    return apply(fn) if fn is not None else apply


def permutation_invariant(fn: Callable | None = None, *, key: str = "input_ids", group_size: int | str | None = None,
                          every: int = 16, rtol: float | None = None, output: int | None = None) -> Callable:
    """Decorate a loss function with the RLG019 permutation check: on calls 1, ``every``+1, ..., it is called
    once more with the rows of every batch-shaped argument (tensors, lists and tuples whose first dim is the
    first dim of ``key``, and dicts of them) permuted by one permutation, and the loss must be the same within
    ``rtol`` (relative; default by dtype: float32 1e-4, half precision 2e-2). A field that is paired with other
    rows than the rest inside the function (a sort for the forward that the advantages do not follow) makes the
    loss depend on the order. ``group_size``: an int or a parameter's name: the permutation then keeps each group
    of contiguous rows together (groups shuffled, and rows within each group), for losses that compute group
    statistics. Like ``@row_independent``: the re-call runs under no_grad with the generators forked, skipped while
    dropout is on, and an error of the check itself switches it off (logged once).
    """
    for name, v in (("every", every),):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ContractDefinitionError(f"permutation_invariant({name}={v!r}): a positive int")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol >= 0):
        raise ContractDefinitionError(f"permutation_invariant(rtol={rtol!r}): a number >= 0")

    def apply(f: Callable) -> Callable:
        def make(r: _Recheck) -> Callable[[dict, Any], Violation | None]:
            key_path = _path(r.name, r.params, "key", key)
            if isinstance(group_size, str) and group_size not in r.params:
                raise ContractDefinitionError(
                    f"{r.name}(): permutation_invariant(group_size={group_size!r}): no such parameter "
                    f"(parameters: {', '.join(r.params)})")
            gen = torch.Generator().manual_seed(0x0BD3)  # its own: the global generators are never drawn from

            def check(values: dict, out: Any) -> Violation | None:
                x, k = _pick(out, output), _get(values, key_path)
                if not isinstance(x, torch.Tensor) or x.numel() != 1 or not isinstance(k, torch.Tensor) or k.dim() < 1:
                    return None
                modules = _modules(values)
                busy = [found for m in modules for found in active_dropout(m)]
                if busy:
                    r.note("dropout", f"not checked while dropout is on ({describe_dropout(busy)}): two passes differ")
                    return None
                b = k.shape[0]
                g = values.get(group_size) if isinstance(group_size, str) else group_size
                if g is not None and (not isinstance(g, int) or g < 1 or b % g):
                    r.note("groups", f"group size {g!r} does not divide the {b} rows: not checked")
                    return None
                perm = group_permutation(b, g or 1, gen).to(k.device)
                permuted = {name: take_rows(v, perm, b) for name, v in values.items()}
                with r.quiet(values):
                    again = _pick(r.call(permuted), output)
                if not isinstance(again, torch.Tensor) or again.numel() != 1:
                    return None
                a, c = float(x.detach().double()), float(again.detach().double())
                limit = rtol if rtol is not None else (1e-4 if row_tolerance(*compute_dtypes(x, *modules))[0] <= 1e-4
                                                       else 2e-2)
                err = abs(a - c) / max(abs(a), 1e-12)
                if err <= limit:
                    return None
                problem = (f"the loss is {a:.6g} for the batch and {c:.6g} for the same rows in another order "
                           f"(relative gap {err:.3g}, allowed {limit:g})"
                           + (f", groups of {g} kept together" if g else ""))
                return Violation(ROWS_OUT_OF_STEP, r.name, "return", format_message(
                    ROWS_OUT_OF_STEP, r.name, "return", problem, got=f"{tuple(x.shape)} {x.dtype}",
                    hint="some fields of the batch are paired with other rows than the rest inside the function (a "
                         "sort or filter applied to some fields only: the advantages left in the old order); or the "
                         "loss mixes rows on purpose (then give group_size, or leave this check off); see RLG019"))

            return check

        return _Recheck(f, "permutation_invariant", every, make).wrapper

    return apply(fn) if fn is not None else apply
