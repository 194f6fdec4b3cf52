"""Misuse fails when the decorator is applied, with a message naming the place; odd tensors (meta, empty, two
devices) never end in a raw torch error from inside rlguard.

No `from __future__ import annotations` here: the annotations name the parametrised marker (a local variable).
"""


import functools
from typing import Annotated

import pytest
import torch
from jaxtyping import Float
from torch import Tensor, nn

import contracts_helpers as h
from rlguard.contracts import (
    ActionMask,
    Advantages,
    ContractDefinitionError,
    ContractViolation,
    DistinctReference,
    Finite,
    Frozen,
    GroupCentred,
    Guard,
    LogProbs,
    Loss,
    MatchesOwner,
    NoGrad,
    Owner,
    SamplerConsistent,
    TokenIds,
    contract,
    get_mode,
    set_mode,
)

torch.set_num_threads(1)


def test_a_class_is_refused_and_stays_a_class():
    class Trainer:
        def compute_loss(self, logp: LogProbs) -> Loss:
            return logp.sum()

    with pytest.raises(ContractDefinitionError, match="not to the class .*Trainer: decorating it would replace the "
                                                       "class by a function.*Decorate the methods"):
        contract(Trainer)
    with pytest.raises(ContractDefinitionError, match="not to the class"):
        contract(check_every=2)(Trainer)
    assert isinstance(Trainer(), Trainer)


@pytest.mark.parametrize("marker", [NoGrad(), Finite(), GroupCentred(group_size=2), MatchesOwner(owner="owner"),
                                    SamplerConsistent(sampler="owner"), Frozen(key="owner")])
def test_tensor_markers_on_non_tensor_annotations(marker):
    name = type(marker).__name__

    with pytest.raises(ContractDefinitionError, match=rf"f\(\): {name}\(.*\) on 'clip': {name} checks a torch "
                                                       r"tensor, but 'clip' is annotated float"):
        @contract
        def f(clip: Annotated[float, marker], owner: Owner) -> None: ...

    with pytest.raises(ContractDefinitionError, match=f"{name} checks a torch tensor, but 'names' is annotated"):
        contract(markers={"names": marker})(_names_fn)

    @contract(markers={"x": marker})  # no annotation: nothing to contradict
    def g(x, owner: Owner) -> None:
        return None


def _names_fn(names: list[str], owner: Owner) -> None:
    return None


def test_distinct_reference_on_a_tensor_annotation():
    with pytest.raises(ContractDefinitionError, match="DistinctReference checks a model object, but 'ref' is "
                                                       "annotated as a tensor"):
        @contract
        def f(ref: Annotated[LogProbs, DistinctReference(policy="policy")], policy: nn.Module) -> None: ...


@pytest.mark.parametrize("dims, message", [
    ("B -1", "invalid dim -1 in 'B -1': sizes are >= 0"),
    ("B T--1", "invalid dim 'T--1': a sign in front of a name or number"),
    ("B T+-1", "invalid dim 'T\\+-1'"),
    ("B -T", "invalid dim '-T'"),
])
def test_invalid_dim_strings(dims, message):
    with pytest.raises(ContractDefinitionError, match=message):
        @contract
        def f(x: Float[Tensor, dims], ids: TokenIds) -> None: ...


@pytest.mark.parametrize("make", [
    lambda: GroupCentred(group_size=2, tol=-1), lambda: GroupCentred(rtol=-0.1),
    lambda: SamplerConsistent(tol=-1e-4), lambda: SamplerConsistent(rtol=float("nan")),
    lambda: Frozen(key="ids", rtol=-1e-9), lambda: GroupCentred(tol=True),
])
def test_negative_or_invalid_tolerances(make):
    with pytest.raises(ContractDefinitionError, match="a tolerance is a finite number >= 0"):
        make()


def test_frozen_key_must_be_names():
    with pytest.raises(ContractDefinitionError, match="key is a name or a tuple of names"):
        @contract
        def f(old: Annotated[LogProbs, Frozen(key=["ids"])], ids: TokenIds) -> None: ...


def test_partials_are_unwrapped():
    def policy_loss(logp: LogProbs, old_logp: Annotated[LogProbs, NoGrad()], *, clip: float) -> Loss:
        return (logp - old_logp).sum() * clip

    checked = contract(functools.partial(policy_loss, clip=0.2))
    assert checked.__name__ == "policy_loss"
    checked(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ContractViolation) as ei:
        checked(torch.zeros(2, 3), torch.zeros(2, 3, requires_grad=True))
    assert (ei.value.function, ei.value.argument) == (policy_loss.__qualname__, "old_logp")
    bound_first = contract(functools.partial(policy_loss, torch.zeros(2, 3)))  # a bound positional argument
    with pytest.raises(ContractViolation):
        bound_first(torch.zeros(2, 3, requires_grad=True), clip=1.0)


def test_other_callables_are_refused():
    class Scorer:
        def __call__(self, logp: LogProbs) -> Loss:
            return logp.sum()

    with pytest.raises(ContractDefinitionError, match="got a .*Scorer instance.*decorate its class's __call__"):
        contract(Scorer())
    with pytest.raises(ContractDefinitionError, match="got a builtin_function_or_method"):
        contract(len)


def test_set_mode_accepts_what_the_environment_accepts():
    try:
        for given, expected in (("WARN", "warn"), (" Off ", "off"), ("on", "raise"), ("0", "off"),
                                ("true", "raise"), ("RAISE", "raise")):
            set_mode(given)
            assert get_mode() == expected
        with pytest.raises(ValueError, match="mode must be one of"):
            set_mode("loud")
        with pytest.raises(ValueError):
            set_mode(None)  # type: ignore[arg-type]
    finally:
        set_mode("raise")


# -- odd tensors: meta, empty, two devices ----------------------------------------------------------------
@contract
def centred(advantages: Annotated[Advantages, Finite(), GroupCentred(group_size=2)]) -> None:
    return None


@contract
def mask_of(mask: Annotated[ActionMask, MatchesOwner(owner="owner")], owner: Owner) -> None:
    return None


def _frozen_call(policy, ref, opt, x, logp, mask, ids):
    @contract
    def loss(logp: Annotated[LogProbs, SamplerConsistent(sampler="old_logp", mask="mask")],
             old_logp: Annotated[LogProbs, Frozen(current="logp", key="ids", mask="mask")],
             mask: ActionMask, ids: TokenIds) -> None:
        return None

    with Guard(policy=policy, reference=ref, optimizer=opt) as g, g.update():
        loss(logp, x, mask, ids)
        opt.step()
        loss(logp, x + 1, mask, ids)


def test_meta_tensors_skip_value_checks():
    centred(torch.empty(8, device="meta"))
    owner = torch.empty(4, 6, dtype=torch.long, device="meta")
    mask_of(torch.empty(4, 5, device="meta"), owner)
    policy, ref, opt = h.make_models()
    meta = torch.empty(4, 5, device="meta")
    _frozen_call(policy, ref, opt, meta, meta, meta, torch.empty(4, 6, dtype=torch.long, device="meta"))
    with pytest.raises(ContractViolation, match="dim 1 is 6"):  # shapes are still checked on meta tensors
        mask_of(torch.empty(4, 6, device="meta"), owner)


def test_empty_batches_pass_value_checks():
    centred(torch.zeros(0))
    mask_of(torch.zeros(0, 5), torch.zeros(0, 6, dtype=torch.long))
    policy, ref, opt = h.make_models()
    empty = torch.zeros(0, 5)
    _frozen_call(policy, ref, opt, empty, empty, empty, torch.zeros(0, 6, dtype=torch.long))
    with pytest.raises(ContractViolation, match="3 values are not a whole number of groups of G=2"):
        centred(torch.zeros(3))


def test_two_devices_are_a_violation_naming_both():
    owner = torch.zeros(4, 6, dtype=torch.long)
    with pytest.raises(ContractViolation) as ei:  # the meta device stands in for a second device on CPU-only CI
        mask_of(torch.zeros(4, 5, device="meta"), owner)
    e = ei.value
    assert e.code == "RLG000" and "mask is on meta but owner (owner) is on cpu" in str(e)
    assert "move both to one device" in str(e)
    policy, ref, opt = h.make_models()
    with pytest.raises(ContractViolation, match="is on meta but .* is on cpu"):
        _frozen_call(policy, ref, opt, torch.zeros(4, 5, device="meta"), torch.zeros(4, 5), torch.ones(4, 5),
                     torch.zeros(4, 6, dtype=torch.long))
