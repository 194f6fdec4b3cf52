"""Batch specs: dict, TypedDict, dataclass, object and nested `.batch` containers; optional keys; markers naming
keys and `self` attributes; dims bound across keys and arguments; check_batch on a value; returned batches."""

from __future__ import annotations

import copy
import dataclasses
from typing import Annotated, Any, Optional, TypedDict

import pytest
import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

import contracts_helpers as h
from rlguard.contracts import (
    ActionMask,
    Advantages,
    Batch,
    ContractDefinitionError,
    ContractViolation,
    DistinctReference,
    Finite,
    Frozen,
    GroupCentred,
    Guard,
    LogProbs,
    Loss,
    Mask,
    MatchesOwner,
    NoGrad,
    Owner,
    SamplerConsistent,
    TokenIds,
    check_batch,
    contract,
)

torch.set_num_threads(1)
B, T = 8, 12


def batch(**over: Any) -> dict:
    b = h.make_batch()
    mask = (b["owner"][:, 1:] == h.POLICY).float()
    out = {"ids": b["ids"], "owner": b["owner"], "mask": mask, "old_logp": torch.randn(B, T - 1),
           "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 0.0])}
    out.update(over)
    return out


INPUTS = Batch(ids=TokenIds, owner=Owner, mask=Annotated[ActionMask, MatchesOwner(owner="owner")],
               old_logp=Annotated[LogProbs, NoGrad(), Finite()],
               advantages=Annotated[Advantages, NoGrad(), GroupCentred(group_size=2)])


@contract
def loss_on_dict(inputs: Annotated[dict, INPUTS], logp: LogProbs) -> Annotated[Loss, Finite()]:
    ratio = torch.exp(logp - inputs["old_logp"])
    return -(ratio * inputs["advantages"][:, None] * inputs["mask"]).sum() / inputs["mask"].sum()


def test_dict_batch_healthy_and_each_key_checked():
    loss_on_dict(batch(), torch.randn(B, T - 1))
    with pytest.raises(ContractViolation) as ei:  # a [B, T] mask beside [B, T-1] log-probs: the dims bind across
        loss_on_dict(batch(mask=torch.ones(B, T)), torch.randn(B, T - 1))
    assert (ei.value.code, ei.value.argument) == ("RLG001", "inputs['mask']")
    assert "bindings so far: B=8, T=12" in str(ei.value)
    with pytest.raises(ContractViolation) as ei:  # the other argument binds against the keys
        loss_on_dict(batch(), torch.randn(B, T))
    assert (ei.value.code, ei.value.argument) == ("RLG012", "logp")
    with pytest.raises(ContractViolation) as ei:
        loss_on_dict(batch(old_logp=torch.randn(B, T - 1, requires_grad=True)), torch.randn(B, T - 1))
    assert (ei.value.code, ei.value.argument) == ("RLG003", "inputs['old_logp']")
    with pytest.raises(ContractViolation) as ei:
        loss_on_dict(batch(advantages=torch.ones(B)), torch.randn(B, T - 1))
    assert (ei.value.code, ei.value.argument) == ("RLG009", "inputs['advantages']")
    with pytest.raises(ContractViolation) as ei:  # a marker naming a sibling key
        loss_on_dict(batch(mask=(batch()["owner"][:, :-1] == h.POLICY).float()), torch.randn(B, T - 1))
    assert (ei.value.code, ei.value.argument) == ("RLG001", "inputs['mask']")
    assert "mask aligned to ids" in str(ei.value)


def test_missing_required_key_names_the_keys_and_optional_keys_may_be_absent():
    with pytest.raises(ContractViolation) as ei:
        loss_on_dict({k: v for k, v in batch().items() if k != "advantages"}, torch.randn(B, T - 1))
    e = ei.value
    assert (e.code, e.argument) == ("RLG000", "inputs")
    assert "has no key 'advantages'" in str(e) and "keys ids, owner, mask, old_logp" in str(e)
    assert "Optional[...]" in str(e)

    @contract
    def f(inputs: Annotated[dict, Batch(ids=TokenIds, ref_logp=Optional[Annotated[LogProbs, NoGrad()]])]) -> None:
        return None

    f({"ids": batch()["ids"]})  # absent
    f({"ids": batch()["ids"], "ref_logp": None})  # None
    f({"ids": batch()["ids"], "ref_logp": torch.zeros(B, T - 1)})
    with pytest.raises(ContractViolation) as ei:  # present: checked like any key
        f({"ids": batch()["ids"], "ref_logp": torch.zeros(B, T)})
    assert ei.value.argument == "inputs['ref_logp']"


class RolloutTD(TypedDict, total=False):
    ids: TokenIds
    mask: ActionMask
    old_logp: Annotated[LogProbs, NoGrad()]


class Required(TypedDict):
    ids: TokenIds


@dataclasses.dataclass
class Rollout:
    ids: TokenIds
    owner: Owner
    mask: Annotated[ActionMask, MatchesOwner()]
    values: Optional[Float[Tensor, "B"]] = None


def test_typeddict_and_dataclass_specs_come_from_their_annotations():
    @contract
    def f(r: Annotated[RolloutTD, Batch()], q: Annotated[Required, Batch()]) -> None:
        return None

    b = batch()
    f({"ids": b["ids"], "mask": b["mask"], "old_logp": b["old_logp"]}, {"ids": b["ids"]})
    f({"ids": b["ids"]}, {"ids": b["ids"]})  # total=False: every key optional
    with pytest.raises(ContractViolation) as ei:
        f({"ids": b["ids"], "old_logp": b["old_logp"].requires_grad_()}, {"ids": b["ids"]})
    assert (ei.value.code, ei.value.argument) == ("RLG003", "r['old_logp']")
    with pytest.raises(ContractViolation, match="has no key 'ids'"):
        f({}, {})

    @contract
    def g(r: Annotated[Rollout, Batch()]) -> None:
        return None

    g(Rollout(b["ids"], b["owner"], b["mask"]))
    with pytest.raises(ContractViolation) as ei:  # attribute style name, MatchesOwner finds the sibling field
        g(Rollout(b["ids"], b["owner"], (b["owner"][:, :-1] == h.POLICY).float()))
    assert (ei.value.code, ei.value.argument) == ("RLG001", "r.mask")
    with pytest.raises(ContractViolation) as ei:  # the container's own type is checked too
        g({"ids": b["ids"], "owner": b["owner"], "mask": b["mask"]})
    assert ei.value.argument == "r" and "expected Rollout, got dict" in str(ei.value)
    with pytest.raises(ContractViolation, match=r"dim 0 \(B\) is 3, but B=8"):
        g(Rollout(b["ids"], b["owner"], b["mask"], values=torch.zeros(3)))


class TensorDictLike:
    """Keys and __getitem__ like tensordict.TensorDict, which refuses `key in td`."""

    def __init__(self, **items: torch.Tensor) -> None:
        self._items = items

    def keys(self):
        return self._items.keys()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._items[key]

    def __contains__(self, key: str) -> bool:
        raise NotImplementedError("use key in td.keys()")


class DataProtoLike:
    """verl's DataProto: tensors in `.batch` (a TensorDict), the rest in `.meta_info` / `.non_tensor_batch`."""

    def __init__(self, batch: TensorDictLike, meta_info: dict) -> None:
        self.batch = batch
        self.meta_info = meta_info
        self.non_tensor_batch: dict = {}


def test_nested_batch_container_and_paths_into_meta_info():
    @contract
    def update_actor(data: Annotated[DataProtoLike, Batch(
            input_ids=TokenIds, response_mask=ActionMask,
            advantages=Annotated[Advantages, GroupCentred(group_size="data.meta_info.n")])]) -> None:
        return None

    b = batch()
    adv = torch.tensor([1.0, 2.0, -1.0, -2.0, 0.5, -0.5, 1.5, -1.5])  # centred in groups of 4, not of 2
    td = TensorDictLike(input_ids=b["ids"], response_mask=b["mask"], advantages=adv)
    update_actor(DataProtoLike(td, {"n": 4}))
    with pytest.raises(ContractViolation) as ei:
        update_actor(DataProtoLike(td, {"n": 2}))
    assert (ei.value.code, ei.value.argument) == ("RLG009", "data.advantages") and "G=2" in str(ei.value)
    with pytest.raises(ContractViolation) as ei:
        update_actor(DataProtoLike(TensorDictLike(input_ids=b["ids"]), {"n": 2}))
    assert "has no key 'response_mask'" in str(ei.value) and "batch['input_ids']" in str(ei.value)


def test_nested_batch_spec_inside_a_batch():
    @contract
    def f(x: Annotated[dict, Batch(ids=TokenIds, extra=Batch(mask=ActionMask,
                                                              old_logp=Annotated[LogProbs, Frozen(key="ids")]))]
          ) -> None:
        return None

    b = batch()
    f({"ids": b["ids"], "extra": {"mask": b["mask"], "old_logp": b["old_logp"]}})
    with pytest.raises(ContractViolation) as ei:  # dims bind into the nested container
        f({"ids": b["ids"], "extra": {"mask": torch.ones(B, T), "old_logp": b["old_logp"]}})
    assert ei.value.argument == "x['extra']['mask']"


def test_methods_name_attributes_of_self():
    class Trainer:
        def __init__(self, model: nn.Module, ref: nn.Module, n: int) -> None:
            self.model, self.ref_model = model, ref
            self.cfg = type("Cfg", (), {"num_generations": n})()

        @contract(markers={"self": DistinctReference(reference="self.ref_model", policy="self.model")})
        def score(self, advantages: Annotated[Advantages, GroupCentred(group_size="self.cfg.num_generations")]
                  ) -> None:
            return None

    policy, ref, _ = h.make_models()
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0])
    Trainer(policy, ref, 2).score(adv)
    with pytest.raises(ContractViolation) as ei:
        Trainer(policy, ref, 4).score(torch.tensor([1.0, 1.0, -1.0, 3.0]))
    assert ei.value.code == "RLG009" and "G=4" in str(ei.value)
    with pytest.raises(ContractViolation) as ei:
        Trainer(policy, policy, 2).score(adv)
    assert (ei.value.code, ei.value.argument) == ("RLG008", "self.ref_model")
    with pytest.raises(ContractViolation) as ei:
        Trainer(policy, copy.copy(policy), 2).score(adv)
    assert "share storage" in str(ei.value)


def test_check_batch_applies_a_spec_to_a_value():
    spec = Batch(completion_ids=Int[Tensor, "B C"], completion_mask=Mask[Tensor, "B C"],
                 advantages=Annotated[Float[Tensor, "B"], NoGrad(), Finite()],
                 old_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad()]])
    good = {"completion_ids": torch.zeros(4, 3, dtype=torch.long), "completion_mask": torch.ones(4, 3),
            "advantages": torch.zeros(4), "prompt_ids": torch.zeros(4, 2, dtype=torch.long)}
    assert check_batch(spec, good, where="GRPOTrainer.compute_loss", name="inputs") is None
    with pytest.raises(ContractViolation) as ei:
        check_batch(spec, good | {"completion_mask": torch.ones(4, 4)}, where="GRPOTrainer.compute_loss",
                    name="inputs")
    e = ei.value
    assert (e.function, e.argument) == ("GRPOTrainer.compute_loss", "inputs['completion_mask']")
    assert "dim 1 (C) is 4, but C=3" in str(e)
    nan = good | {"advantages": torch.tensor([0.0, float("nan"), 0.0, 0.0])}
    with pytest.raises(ContractViolation, match="1 NaN"):
        check_batch(spec, nan)
    with pytest.raises(ContractDefinitionError, match="spec must be a Batch"):
        check_batch({"a": 1}, good)


def test_check_batch_cadence():
    spec = Batch(advantages=Annotated[Float[Tensor, "B"], Finite()])
    nan = {"advantages": torch.tensor([float("nan")])}
    with pytest.raises(ContractViolation):
        check_batch(spec, nan, where="cadence-test", check_every=3)  # call 1
    check_batch(spec, nan, where="cadence-test", check_every=3)  # 2
    check_batch(spec, nan, where="cadence-test", check_every=3)  # 3
    with pytest.raises(ContractViolation):
        check_batch(spec, nan, where="cadence-test", check_every=3)  # 4
    with pytest.raises(ContractViolation):  # another place counts on its own
        check_batch(spec, nan, where="elsewhere", check_every=3)


def test_returned_batch_is_checked():
    @contract
    def generate(ids: TokenIds) -> Annotated[dict, Batch(old_logp=Annotated[LogProbs, NoGrad()],
                                                          mask=ActionMask)]:
        return {"old_logp": torch.zeros(ids.shape[0], ids.shape[1] - 1, requires_grad=True),
                "mask": torch.ones(ids.shape[0], ids.shape[1] - 1)}

    with pytest.raises(ContractViolation) as ei:
        generate(batch()["ids"])
    assert (ei.value.code, ei.value.argument) == ("RLG003", "return['old_logp']")


def test_frozen_with_a_key_of_several_tensors_inside_a_batch():
    @contract
    def loss(inputs: Annotated[dict, Batch(
            prompt_ids=Int[Tensor, "B P"], completion_ids=Int[Tensor, "B C"],
            old=Annotated[Float[Tensor, "B C"], Frozen(key=("prompt_ids", "completion_ids"))])]) -> None:
        return None

    policy, ref, opt = h.make_models()
    prompts = torch.tensor([[1, 2], [3, 4]])
    completions = torch.tensor([[5, 6, 7], [5, 6, 7]])  # the same completion after two different prompts
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    with Guard(policy=policy, reference=ref, optimizer=opt) as g, g.update():
        loss({"prompt_ids": prompts, "completion_ids": completions, "old": old})
        opt.step()
        loss({"prompt_ids": prompts.flip(0), "completion_ids": completions, "old": old.flip(0)})  # same rows
        with pytest.raises(ContractViolation) as ei:
            loss({"prompt_ids": prompts, "completion_ids": completions, "old": old + 0.1})
    assert ei.value.code == "RLG002" and "same inputs['prompt_ids'], inputs['completion_ids']" in str(ei.value)


def test_definition_errors_for_batches():
    with pytest.raises(ContractDefinitionError, match="MatchesOwner\\(owner='owner'\\) on \"x\\['mask'\\]\".*"
                                                       "its batch declares no such key \\(keys: mask\\)"):
        @contract
        def f1(x: Annotated[dict, Batch(mask=Annotated[ActionMask, MatchesOwner()])]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="markers on a batch container"):
        @contract
        def f2(x: Annotated[dict, Batch(ids=TokenIds), NoGrad()]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="takes its spec from a TypedDict or a dataclass"):
        @contract
        def f3(x: Annotated[dict, Batch()]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="keys must be non-empty strings without '.'"):
        Batch({"a.b": TokenIds})

    with pytest.raises(ContractDefinitionError,
                       match="NoGrad checks a torch tensor, but \"x\\['n'\\]\" is annotated int"):
        @contract
        def f4(x: Annotated[dict, Batch(n=Annotated[int, NoGrad()])]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="SamplerConsistent\\(sampler='old'.*no parameter 'old'"):
        @contract
        def f5(x: Annotated[dict, Batch(logp=Annotated[LogProbs, SamplerConsistent(sampler="old")])]) -> None: ...
