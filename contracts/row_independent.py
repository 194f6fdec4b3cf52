"""``@row_independent`` (RLG016) and ``@permutation_invariant`` (RLG019): checks at the point of use that call the
decorated function once or twice more on a changed batch.

``@row_independent``: RLG016. A scoring function's values for a row must not depend on how
much padding the row carries or on which rows share its batch.

On a cadence (``every``-th call, the first included), after the real call, the function is called twice more on
one row of the batch (the last row first, then each row in turn): the row alone (its neighbours gone) and the row
alone with ``extra`` columns of padding (``pad_id`` in the ids, 0 in the mask and in every other per-token
argument, on ``side``: by default where the batch is padded; both sides, one more call, when it is padded on
both). Both must reproduce the row's values from the real call on its valid positions, within a tolerance
for the dtype (:func:`rlguard.contracts.invariance.row_tolerance`). A padded re-call that fails (more positions
than the model has) is logged once and dropped: the neighbour check goes on. The re-calls run under ``torch.no_grad()``
with the random number generators forked, their results are discarded, and the real call's return value is
returned untouched: training is not changed (a function with side effects, a cache or a counter, sees two more
calls). They are skipped while a module among the arguments (or a module attribute of ``self``) has dropout
on: two passes could not agree anyway (RLG018). An error inside the check itself is logged once and switches
the check off for that function; only a violation is reported (raised in ``raise`` mode).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import re
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlguard.catalog import PADDING_LEAK, ROWS_OUT_OF_STEP
from rlguard.contracts.batch import MISSING, get_field
from rlguard.contracts.errors import ContractDefinitionError, Violation
from rlguard.contracts.invariance import (
    active_dropout, compute_dtypes, describe_dropout, fields_of, gaps, group_permutation, order_tolerance, rebuild,
    row_tolerance, take_rows, with_fields,
)
from rlguard.contracts.settings import STATE, report
from rlguard.contracts.spec import format_message

_log = logging.getLogger("rlguard.contracts")
_PATH = re.compile(r"^([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*|\[['\"][^'\"]+['\"]\])*)$")
_SEG = re.compile(r"\.([A-Za-z_]\w*)|\[['\"]([^'\"]+)['\"]\]")

Path = tuple  # (parameter, (key or attribute, ...))


def _path(fn_name: str, params: list[str], what: str, text: str | None,
          decorator: str = "row_independent") -> Path | None:
    """``"input_ids"``, ``"batch['input_ids']"``, ``"batch.input_ids"``, ``"data.batch['responses']"`` ->
    (parameter, (keys and attributes ...)); a ContractDefinitionError naming the argument otherwise."""
    if text is None:
        return None
    m = _PATH.match(text) if isinstance(text, str) else None
    if m is None or m.group(1) not in params:
        raise ContractDefinitionError(
            f"{fn_name}(): {decorator}({what}={text!r}): {what} names a parameter, a key of a dict parameter or an "
            f"attribute of an object parameter (\"input_ids\", \"batch['input_ids']\", \"batch.input_ids\"); "
            f"parameters: {', '.join(params) or 'none'}")
    return m.group(1), tuple(a or b for a, b in _SEG.findall(m.group(2)))


def _get(values: dict, path: Path | None) -> Any:
    """The value at ``path`` (keys, attributes, or inside ``.batch``: :func:`rlguard.contracts.batch.get_field`),
    None where it is missing."""
    if path is None:
        return None
    v = values.get(path[0])
    for key in path[1]:
        v = get_field(v, key)
        if v is MISSING:
            return None
    return v


def _replace(container: Any, keys: tuple, new: Any) -> Any:
    """``container`` with the value at ``keys`` replaced by ``new``: copies along the path (dicts, mappings,
    dataclasses, objects, an object's ``.batch``), the original left as it is; TypeError where it cannot be."""
    if not keys:
        return new
    key, rest = keys[0], keys[1:]
    if isinstance(container, dict):
        return {**container, key: _replace(container[key], rest, new)}
    fields = fields_of(container)
    if fields is not None and key in fields:
        return with_fields(container, {key: _replace(fields[key], rest, new)})
    inner = getattr(container, "batch", None)
    if fields is not None and inner is not None and get_field(inner, key) is not MISSING:
        return with_fields(container, {"batch": _replace(inner, keys, new)})
    try:  # another mapping (a TensorDict): a shallow copy with the key set
        if key in container.keys():
            out = copy.copy(container)
            out[key] = _replace(container[key], rest, new)
            return out
    except Exception:  # noqa: BLE001 - not a mapping; said below
        pass
    raise TypeError(f"cannot set {key!r} in a {type(container).__name__}")


def _set(values: dict, path: Path, new: Any) -> None:
    values[path[0]] = _replace(values[path[0]], path[1], new)


def _split(values: dict, rows: torch.Tensor, n: int, root: str | None, select: Callable | None) -> dict:
    """Every argument with its rows taken (:func:`take_rows`): ``root`` (the parameter holding the ids) by
    ``select(batch, rows)`` when given, else as a container (dataclass or object fields too); other dataclass
    instances by their fields."""
    out = {}
    for k, v in values.items():
        if k == root and select is not None:
            out[k] = select(v, rows)
        else:
            objects = k == root or (dataclasses.is_dataclass(v) and not isinstance(v, type))
            out[k] = take_rows(v, rows, n, objects=objects)
    return out


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


def _what(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor {tuple(v.shape)}"
    return "missing" if v is None else f"a {type(v).__name__}"


def _sides(idt: torch.Tensor, m: Any, pad_id: int) -> tuple[str, ...]:
    """``side="auto"``: the sides this batch is padded on, read from the mask (else from ``pad_id`` in the ids).
    Left: some row starts with padding and another does not (a left-padding collate pads to the longest row; a
    first token every row shares is a BOS, not padding). Right otherwise, and besides left when some row also
    ends with padding (left-padded prompts before right-padded completions)."""
    pad = (m == 0) if isinstance(m, torch.Tensor) and m.shape == idt.shape else (idt == pad_id)
    real = ~pad.all(-1)
    first = pad[:, 0] & real
    left = bool(first.any()) and not bool(first[real].all())
    right = bool((pad[:, -1] & real).any())
    return ("left", "right") if left and right else ("left",) if left else ("right",)


def row_independent(fn: Callable | None = None, *, ids: str = "input_ids", mask: str | None = "attention_mask",
                    pad_id: int = 0, every: int = 16, extra: int = 8, side: str = "auto",
                    tol: tuple[float, float] | None = None, output: int | None = None,
                    select_rows: Callable[[Any, torch.Tensor], Any] | None = None) -> Callable:
    """Decorate a scoring function (``logps = f(model, input_ids, attention_mask)`` -> ``[B, T]`` or
    ``[B, T-1]``) with the RLG016 row-independence check.

    ``ids`` / ``mask``: the token ids and attention mask: a parameter, ``"batch['input_ids']"`` for a key of a
    dict parameter, or ``"batch.input_ids"`` for an attribute of an object or dataclass parameter (keys and
    attributes chain: ``"data.batch['input_ids']"``); ``mask=None``: there is none. The parameter that holds the
    ids is the batch: its rows are taken field by field (dicts, dataclasses, objects: shallow copies), or by
    ``select_rows(batch, rows)`` when given (the preflight adapter's ``select_rows`` contract), for a batch type
    that cannot be copied field by field. ``pad_id``: what padding ids hold. ``side``: where the re-call adds its
    padding: ``"auto"`` (default: the side(s) the batch is padded on, read from the mask, else from ``pad_id`` in
    the ids: right-padded batches get right padding, left-padded ones left padding, both for left-padded prompts
    before right-padded completions), ``"both"`` (always both: one more re-call), ``"right"`` or ``"left"``.
    ``tol``: ``(mean, max)`` absolute gaps allowed (default: by dtype). ``output``: the index of the tensor to
    compare when the function returns a tuple.
    """
    if side not in ("auto", "both", "right", "left"):
        raise ContractDefinitionError(f"row_independent(side={side!r}): 'auto', 'both', 'right' or 'left'")
    for name, v in (("every", every), ("extra", extra)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ContractDefinitionError(f"row_independent({name}={v!r}): a positive int")
    if select_rows is not None and not callable(select_rows):
        raise ContractDefinitionError(
            f"row_independent(select_rows={select_rows!r}): a function (batch, rows) -> batch")

    def apply(f: Callable) -> Callable:
        def make(r: "_Recheck") -> Callable[[dict, Any], Violation | None]:
            ids_path = _path(r.name, r.params, "ids", ids)
            mask_path = _path(r.name, r.params, "mask", mask)
            r.state["pad"] = True

            def check(values: dict, out: Any) -> Violation | None:
                x, idt = _pick(out, output), _get(values, ids_path)
                if not isinstance(idt, torch.Tensor) or idt.dim() != 2:
                    r.note("ids", f"{ids} is {_what(idt)}, not [B, T] token ids: not checked")
                    return None
                if not isinstance(x, torch.Tensor):
                    r.note("output", f"the return value is {_what(x)}"
                                     + (", give output=<index>" if isinstance(x, (tuple, list)) else "")
                                     + ": not checked")
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
                # the k-th checked call checks row B-1-k: the last row first (in a packed or concatenated layout
                # the first row has no neighbours before it to leak from), then each row in turn
                row = (b - 1 - (r.state["calls"] - 1) // every) % b
                rows = torch.tensor([row], device=idt.device)
                alone = _split(values, rows, b, ids_path[0], select_rows)
                one = _get(alone, ids_path)
                if not isinstance(one, torch.Tensor) or one.shape != (1, t):
                    r.note("split", f"the batch in {ids_path[0]!r} ({type(values[ids_path[0]]).__name__}) cannot be "
                                    f"split by row ({ids} of one row is {_what(one)}): not checked; give "
                                    "select_rows=(batch, rows) -> batch")
                    return None
                m = _get(values, mask_path)
                sides = (("left", "right") if side == "both" else _sides(idt, m, pad_id) if side == "auto"
                         else (side,))

                def padder(where: str) -> Callable[[Any], Any]:
                    def leaf(v: Any) -> Any:  # every per-token tensor gets the padding columns
                        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] in (t, t - 1):
                            return _pad(v, extra, where, 0)
                        return v
                    return leaf

                recalls = []
                for where in sides:
                    padded = {k: rebuild(v, padder(where), objects=k == ids_path[0] or (
                        dataclasses.is_dataclass(v) and not isinstance(v, type))) for k, v in alone.items()}
                    try:
                        _set(padded, ids_path, _pad(one, extra, where, pad_id))
                    except TypeError as exc:  # a batch type whose fields cannot be set: select_rows only
                        r.note("set", f"the padded batch cannot be built ({exc}); only the neighbour check runs")
                        break
                    recalls.append((where, padded))
                with r.quiet(values):
                    first = _pick(r.call(alone), output).detach()
                    seconds = []
                    for where, padded in recalls:
                        if not r.state["pad"]:
                            break
                        try:
                            seconds.append((where, _pick(r.call(padded), output).detach()))
                        except Exception as exc:  # noqa: BLE001 - e.g. more positions than the model has
                            r.state["pad"] = False
                            r.note("pad", f"the re-call with {extra} more columns of padding failed "
                                          f"({type(exc).__name__}: {exc}); only the neighbour check runs")
                keep = (m[row] != 0) if isinstance(m, torch.Tensor) and m.shape == idt.shape else (idt[row] != pad_id)
                valid = keep if x.shape[1] == t else keep[1:] & keep[:-1]
                compared = [("alone in its batch (its neighbours removed)", first)]
                for where, second in seconds:
                    second = second[:, extra:] if where == "left" else second[:, : x.shape[1]]
                    compared.append((f"with {extra} more columns of {where} padding", second))
                mean_tol, max_tol = tol or row_tolerance(*compute_dtypes(x, *modules))
                for what, other in compared:
                    if other.shape[1:] != x.shape[1:]:
                        r.note("shape", f"row {row} {what} returns {tuple(other.shape)} for {tuple(x.shape)}: "
                                        "not compared")
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
                          every: int = 16, rtol: float | None = None, output: int | None = None,
                          select_rows: Callable[[Any, torch.Tensor], Any] | None = None) -> Callable:
    """Decorate a loss function with the RLG019 permutation check: on calls 1, ``every``+1, ..., it is called
    once more with the rows of every batch-shaped argument (tensors, lists and tuples whose first dim is the
    first dim of ``key``, and dicts of them) permuted by one permutation, and the loss must be the same within
    ``rtol`` (relative; default by dtype: float32 1e-4, half precision 2e-2). A field that is paired with other
    rows than the rest inside the function (a sort for the forward that the advantages do not follow) makes the
    loss depend on the order. ``group_size``: an int or a parameter's name: the permutation then keeps each group
    of contiguous rows together (groups shuffled, and rows within each group), for losses that compute group
    statistics. ``key`` names a parameter, a dict key (``"batch['input_ids']"``) or an attribute
    (``"batch.input_ids"``); the parameter that holds it is permuted field by field (dicts, dataclasses, objects),
    or by ``select_rows(batch, rows)`` when given. Like ``@row_independent``: the re-call runs under no_grad with
    the generators forked, skipped while dropout is on, a batch that cannot be permuted is logged once and not
    checked, and an error of the check itself switches it off (logged once). Cost: one more call of the function
    (with autograd off) per checked call.
    """
    for name, v in (("every", every),):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ContractDefinitionError(f"permutation_invariant({name}={v!r}): a positive int")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol >= 0):
        raise ContractDefinitionError(f"permutation_invariant(rtol={rtol!r}): a number >= 0")
    if select_rows is not None and not callable(select_rows):
        raise ContractDefinitionError(
            f"permutation_invariant(select_rows={select_rows!r}): a function (batch, rows) -> batch")

    def apply(f: Callable) -> Callable:
        def make(r: _Recheck) -> Callable[[dict, Any], Violation | None]:
            key_path = _path(r.name, r.params, "key", key, "permutation_invariant")
            if isinstance(group_size, str) and group_size not in r.params:
                raise ContractDefinitionError(
                    f"{r.name}(): permutation_invariant(group_size={group_size!r}): no such parameter "
                    f"(parameters: {', '.join(r.params)})")
            gen = torch.Generator().manual_seed(0x0BD3)  # its own: the global generators are never drawn from

            def check(values: dict, out: Any) -> Violation | None:
                x, k = _pick(out, output), _get(values, key_path)
                if not isinstance(k, torch.Tensor) or k.dim() < 1:
                    r.note("key", f"{key} is {_what(k)}, not a tensor with a row dim: not checked")
                    return None
                if not isinstance(x, torch.Tensor) or x.numel() != 1:
                    r.note("output", f"the return value is {_what(x)}, not a scalar loss"
                                     + (" (give output=<index>)" if isinstance(x, (tuple, list)) else "")
                                     + ": not checked")
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
                permuted = _split(values, perm, b, key_path[0], select_rows)
                moved = _get(permuted, key_path)
                if moved is k or not isinstance(moved, torch.Tensor) or moved.shape != k.shape:
                    r.note("split", f"the batch in {key_path[0]!r} ({type(values[key_path[0]]).__name__}) cannot be "
                                    f"permuted by row ({key} after it is {_what(moved)}): not checked; give "
                                    "select_rows=(batch, rows) -> batch")
                    return None
                with r.quiet(values):
                    again = _pick(r.call(permuted), output)
                if not isinstance(again, torch.Tensor) or again.numel() != 1:
                    r.note("again", f"the re-call returned {_what(again)}: not checked")
                    return None
                a, c = float(x.detach().double()), float(again.detach().double())
                limit = rtol if rtol is not None else order_tolerance(*compute_dtypes(x, *modules))
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
