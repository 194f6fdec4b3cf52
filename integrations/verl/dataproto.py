"""Batch specs for verl's ``DataProto``: its ``batch`` TensorDict, its ``non_tensor_batch`` and its ``meta_info``.

A ``DataProto`` carries one batch of episodes between verl's driver and its workers: tensors in ``.batch`` (a
TensorDict: ``input_ids``, ``responses``, ``response_mask``, ``old_log_probs``, ``advantages``, ...), numpy
arrays with one entry per episode in ``.non_tensor_batch`` (``uid``: the prompt's group id, ``data_source``,
...), and scalars in ``.meta_info``. ``DataProtoSpec`` turns a description of the three into an
``rlguard.contracts.Batch``, for ``@contract`` on a function of your own that takes one::

    from rlguard.integrations.verl import DataProtoSpec

    SCORED = DataProtoSpec(
        batch={"responses": Int[Tensor, "B R"], "response_mask": Mask[Tensor, "B R"],
               "token_level_scores": Annotated[Float[Tensor, "B R"], Finite()]},
        non_tensor={"uid": np.ndarray})

    @contract
    def my_reward_shaping(data: Annotated[DataProto, SCORED]) -> ...: ...

Dims bind across the three parts and the function's other arguments; every ``non_tensor`` entry must hold one
value per episode (its length is the dim ``rows``, ``"B"`` by default: RLG019 when it is not, the fields of
one batch out of step). Works with ``check_batch(SCORED, data, where=...)`` as well. No verl import is needed:
the spec reads ``data.batch``, ``data.non_tensor_batch`` and ``data.meta_info`` by name.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Annotated, Any

from rlguard.catalog import ROWS_OUT_OF_STEP, TENSOR_CONTRACT
from rlguard.contracts import Batch
from rlguard.contracts.errors import ContractDefinitionError
from rlguard.contracts.markers import Marker
from rlguard.contracts.spec import unwrap_optional


class RowCount(Marker):
    """RLG019 on a ``non_tensor_batch`` entry: one value per episode, as many as the dim ``dim`` (bound by the
    batch's tensors). A uid array left unfiltered when the tensors were filtered (or the reverse) pairs each
    episode with another's group."""

    code = ROWS_OUT_OF_STEP
    applies_to = "any"

    def __init__(self, dim: str = "B") -> None:
        self.dim = dim

    def check(self, x: Any, call) -> Any:
        rows = call.bindings.get(self.dim)
        if x is None or rows is None:
            return None
        try:
            n = len(x)
        except TypeError:
            return self._fail(f"is a {type(x).__name__}, which has no length: a non_tensor_batch entry holds one "
                              "value per episode", x, call, None, TENSOR_CONTRACT)
        if n == rows:
            return None
        return self._fail(f"has {n} entries, but the batch's tensors have {self.dim}={rows} rows", x, call,
                          "the tensors and the non-tensor entries of one DataProto filtered, repeated or reordered "
                          "apart (DataProto.select/union/repeat keep them together); see RLG019")


def _per_episode(annotation: Any, dim: str) -> Any:
    """``annotation`` with ``RowCount(dim)`` added (inside ``Optional[...]`` for an optional entry)."""
    inner, optional = unwrap_optional(annotation)
    counted = Annotated[inner, RowCount(dim)]
    return typing.Optional[counted] if optional else counted


def _fields(part: str, fields: Mapping | None) -> dict:
    if fields is None:
        return {}
    if not isinstance(fields, Mapping):
        raise ContractDefinitionError(f"DataProtoSpec({part}=...): a dict of key -> annotation, got {fields!r}")
    return dict(fields)


def DataProtoSpec(batch: Mapping | None = None, non_tensor: Mapping | None = None,  # noqa: N802 - a spec maker
                  meta_info: Mapping | None = None, *, rows: str = "B") -> Batch:
    """The ``Batch`` spec of a ``DataProto``: ``batch`` (its TensorDict's keys -> tensor specs), ``non_tensor``
    (``non_tensor_batch``'s keys -> types, e.g. ``np.ndarray``; each checked to have one entry per row),
    ``meta_info`` (its keys -> types). ``rows``: the dim name of the episodes (default ``"B"``)."""
    fields: dict[str, Any] = {}
    tensors = _fields("batch", batch)
    if tensors:
        fields["batch"] = Batch(tensors)
    arrays = _fields("non_tensor", non_tensor)
    if arrays:
        if not tensors:
            raise ContractDefinitionError("DataProtoSpec(non_tensor=...): give batch=... too, whose tensors bind "
                                          f"the rows dim {rows!r} the non-tensor entries are counted against")
        fields["non_tensor_batch"] = Batch({k: _per_episode(v, rows) for k, v in arrays.items()})
    meta = _fields("meta_info", meta_info)
    if meta:
        fields["meta_info"] = Batch(meta)
    if not fields:
        raise ContractDefinitionError("DataProtoSpec(): give at least one of batch=, non_tensor=, meta_info=")
    return Batch(fields)
