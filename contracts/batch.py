"""Batch specs: the tensors a container argument holds, checked like tensor arguments.

Trainers keep their tensors in containers: a dict (TRL's ``inputs``), a TypedDict, a dataclass, an object with
attributes, verl's ``DataProto`` whose ``.batch`` is a TensorDict. ``Batch(...)`` inside ``Annotated`` gives the
spec of its keys (or attributes), and each key becomes a checked argument of its own, named ``inputs['ids']``
(``inputs.ids`` for a dataclass or an object)::

    @contract
    def compute_loss(self, model, inputs: Annotated[dict, Batch(
            prompt_ids=Int[Tensor, "B P"], completion_ids=Int[Tensor, "B C"],
            completion_mask=Mask[Tensor, "B C"],
            old_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad()]],   # optional key
            advantages=Annotated[Advantages, NoGrad(), Finite()])]) -> Loss: ...

Dims bind across the keys and the function's other arguments; ``Optional[...]`` makes a key optional (absent or
``None``); a ``Batch`` (or ``Annotated[dict, Batch(...)]``) as a field's spec describes a nested container;
markers name sibling keys (``MatchesOwner(owner="owner")``). ``Annotated[MyTypedDict, Batch()]`` (no fields)
takes the spec from the TypedDict's or dataclass's own annotations. :func:`check_batch` applies a spec to a
value directly (a callback that receives a dict), through the same checks and violation path.

A key is looked up, in order: as a mapping key (dicts, TensorDicts, anything with ``keys()`` and
``__getitem__``); as an attribute (dataclasses, objects); then in the value's ``.batch`` container (verl's
``DataProto``), so ``Batch(input_ids=...)`` works on the ``DataProto`` itself.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from rlguard.contracts.errors import ContractDefinitionError

MISSING = object()  # a key that the container does not have


def _is_mapping(obj: Any) -> bool:
    return isinstance(obj, Mapping) or (hasattr(type(obj), "__getitem__") and callable(getattr(obj, "keys", None)))


def get_field(obj: Any, key: str) -> Any:
    """``obj[key]`` (mappings), else ``obj.key``, else the same in ``obj.batch``; :data:`MISSING` if none has it."""
    if obj is None:
        return MISSING
    if type(obj) is dict:  # the common case, first
        value = obj.get(key, MISSING)
    elif _is_mapping(obj):
        value = MISSING
        try:  # `key in obj.keys()`: TensorDict refuses `key in td`
            if key in obj.keys():
                value = obj[key]
        except Exception:  # noqa: BLE001 - a mapping-like object whose keys are not strings
            pass
    else:
        value = getattr(obj, key, MISSING)
    if value is not MISSING:
        return value
    inner = getattr(obj, "batch", None) if key != "batch" else None
    if inner is not None and inner is not obj and not callable(inner):
        return get_field(inner, key)
    return MISSING


def field_names(obj: Any, limit: int = 12) -> str:
    """The keys (or public attributes) of a container, for a message."""
    try:
        if _is_mapping(obj):
            names = [str(k) for k in obj.keys()]
        elif dataclasses.is_dataclass(obj):
            names = [f.name for f in dataclasses.fields(obj)]
        else:
            names = [k for k in getattr(obj, "__dict__", {}) if not k.startswith("_")]
        inner = getattr(obj, "batch", None)
        if inner is not None and inner is not obj and _is_mapping(inner):
            names += [f"batch[{k!r}]" for k in inner.keys()]
    except Exception:  # noqa: BLE001 - only a message; a foreign container may refuse
        return "?"
    if not names:
        return "none"
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


class Batch:
    """The spec of a container's keys or attributes; use it inside ``Annotated[...]`` (see the module docs).

    ``Batch(ids=TokenIds, response_mask=ActionMask)`` or ``Batch({"old-logp": LogProbs})`` for keys that are not
    identifiers. Each value is a field annotation: a jaxtyping tensor spec, ``Annotated[spec, markers...]``,
    ``Optional[...]`` (the key may be absent or None), a nested ``Batch`` / ``Annotated[dict, Batch(...)]``,
    ``typing.Any`` (the key must be present, any value), or a plain type (checked by the typechecker).
    """

    __slots__ = ("fields", "_plans")

    def __init__(self, fields: Mapping[str, Any] | None = None, /, **more: Any) -> None:
        merged: dict[str, Any] = {}
        if fields is not None:
            if not isinstance(fields, Mapping):
                raise ContractDefinitionError(
                    f"Batch(...): the positional argument must be a dict of key -> annotation, got {fields!r}")
            merged.update(fields)
        for key, value in more.items():
            if key in merged:
                raise ContractDefinitionError(f"Batch(...): key {key!r} given twice")
            merged[key] = value
        for key in merged:
            if not isinstance(key, str) or not key or "." in key:
                raise ContractDefinitionError(
                    f"Batch(...): keys must be non-empty strings without '.', got {key!r} ('.' separates a path "
                    "such as 'meta.group_size' in a marker's argument)")
        self.fields = merged
        self._plans: dict = {}  # check_batch's compiled plans, by `where`

    @classmethod
    def of(cls, tp: Any) -> Batch:
        """The spec a TypedDict or dataclass declares: its annotations, ``NotRequired`` keys optional."""
        if is_typeddict(tp):
            try:
                hints = typing.get_type_hints(tp, include_extras=True)
            except Exception as e:  # noqa: BLE001 - NameError etc. from string annotations
                raise ContractDefinitionError(
                    f"Batch.of({tp.__qualname__}): cannot resolve its annotations: {e}") from e
            optional = getattr(tp, "__optional_keys__", frozenset())
            return cls({k: (typing.Optional[_strip_required(h)] if k in optional else _strip_required(h))
                        for k, h in hints.items()})
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            try:
                hints = typing.get_type_hints(tp, include_extras=True)
            except Exception as e:  # noqa: BLE001
                raise ContractDefinitionError(
                    f"Batch.of({tp.__qualname__}): cannot resolve its annotations: {e}") from e
            return cls({f.name: hints.get(f.name, Any) for f in dataclasses.fields(tp)})
        raise ContractDefinitionError(
            f"Batch() with no keys takes its spec from a TypedDict or a dataclass; {tp!r} is neither: list the keys, "
            "e.g. Batch(ids=TokenIds, mask=ActionMask)")

    def __repr__(self) -> str:
        return f"Batch({', '.join(self.fields)})"


def _strip_required(hint: Any) -> Any:
    """``Required[X]`` / ``NotRequired[X]`` -> ``X`` (TypedDict markers, not annotations of the value)."""
    origin = typing.get_origin(hint)
    name = getattr(origin, "_name", None) or str(origin)
    if origin is not None and any(n in name for n in ("NotRequired", "Required")):
        return typing.get_args(hint)[0]
    return hint


def batch_of(hint: Any) -> tuple[Any, Batch | None, list]:
    """``Annotated[X, Batch(...), ...]`` -> (X, the Batch, the other metadata); (hint, None, []) otherwise.

    A bare ``Batch`` instance (as a nested field's spec) is ``(Any, batch, [])``; ``Batch()`` with no keys over a
    TypedDict or dataclass ``X`` is ``Batch.of(X)``.
    """
    if isinstance(hint, Batch):
        return Any, hint, []
    if typing.get_origin(hint) is not typing.Annotated:
        return hint, None, []
    base = typing.get_args(hint)[0]
    found = [m for m in hint.__metadata__ if isinstance(m, Batch) or m is Batch]
    if not found:
        return hint, None, []
    if len(found) > 1:
        raise ContractDefinitionError(f"{hint!r}: one Batch(...) per annotation")
    spec = found[0]
    if spec is Batch or not spec.fields:
        spec = Batch.of(base)
    rest = [m for m in hint.__metadata__ if not (isinstance(m, Batch) or m is Batch)]
    return base, spec, rest


def check_batch(spec: Batch, value: Any, where: str = "check_batch", *, name: str = "batch", check_every: int = 1,
                typechecker: Any = "typeguard") -> None:
    """Check ``value`` against ``spec`` now, as ``@contract`` checks an argument annotated with it.

    For code that receives a container instead of defining the function that takes it (a trainer callback, a
    hook on TRL's ``inputs``): ``check_batch(INPUTS, inputs, where="GRPOTrainer.compute_loss", name="inputs")``.
    ``where`` and ``name`` name the place and the value in messages (``GRPOTrainer.compute_loss(): argument
    "inputs['advantages']"``) and key this check's state: ``check_every`` counts the calls of one (spec,
    where, name), and stateful markers (``Frozen``) keep their rows per place. Dims bind within one call only.
    Violations go through the usual path (raise / warn / off, cross-rank sync); returns None.
    """
    from rlguard.contracts.decorator import batch_plan

    batch_plan(spec, where, name, check_every, typechecker).run_value(value)
