"""Tensor specs: shapes, dtypes, dim bindings across arguments and return, decoration-time errors."""

from __future__ import annotations

from typing import Annotated, Optional

import pytest
import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from rlguard.contracts import (
    ActionMask,
    Advantages,
    ContractDefinitionError,
    ContractViolation,
    Frozen,
    GroupCentred,
    LogProbs,
    Loss,
    MatchesOwner,
    NoGrad,
    TokenIds,
    contract,
)

torch.set_num_threads(1)
B, T = 8, 12


@contract
def policy_loss(logp: LogProbs, old_logp: LogProbs, advantages: Advantages, mask: ActionMask) -> Loss:
    return -(torch.exp(logp - old_logp) * advantages[:, None] * mask).sum() / mask.sum()


def good() -> dict:
    return {"logp": torch.randn(B, T - 1), "old_logp": torch.randn(B, T - 1), "advantages": torch.randn(B),
            "mask": torch.ones(B, T - 1)}


def test_healthy_call_passes_and_returns():
    out = policy_loss(**good())
    assert out.shape == ()


def test_mask_aligned_to_ids_is_rlg001_with_full_message():
    kw = good() | {"mask": torch.ones(B, T)}
    with pytest.raises(ContractViolation) as ei:
        policy_loss(**kw)
    e = ei.value
    assert (e.code, e.function, e.argument, e.rank) == ("RLG001", "policy_loss", "mask", None)
    msg = str(e)
    for part in ("policy_loss()", "argument 'mask'", "'B T-1'", f"bindings so far: B={B}, T={T}",
                 f"shape ({B}, {T})", "dtype float32", "device cpu", "mask aligned to ids, not ids[:, 1:]",
                 "see RLG001"):
        assert part in msg, (part, msg)
    assert isinstance(e, AssertionError)


def test_parameter_order_does_not_matter():
    @contract
    def f(mask: ActionMask, logp: LogProbs, ids: TokenIds) -> LogProbs:
        return logp * mask

    f(torch.ones(B, T - 1), torch.randn(B, T - 1), torch.zeros(B, T, dtype=torch.long))
    with pytest.raises(ContractViolation) as ei:
        f(torch.ones(B, T), torch.randn(B, T - 1), torch.zeros(B, T, dtype=torch.long))
    assert (ei.value.code, ei.value.argument) == ("RLG001", "mask")

    @contract
    def g(mask: ActionMask, logp: LogProbs) -> None:  # no plain T anywhere: T-1 binds T
        return None

    g(torch.ones(B, T - 1), torch.randn(B, T - 1))
    with pytest.raises(ContractViolation) as ei:
        g(torch.ones(B, T), torch.randn(B, T - 1))
    assert (ei.value.code, ei.value.argument) == ("RLG001", "mask")


def test_unshifted_logprobs_is_rlg012():
    @contract
    def f(ids: TokenIds, logp: LogProbs) -> None:
        return None

    with pytest.raises(ContractViolation) as ei:
        f(torch.zeros(B, T, dtype=torch.long), torch.randn(B, T))
    assert (ei.value.code, ei.value.argument) == ("RLG012", "logp")
    assert "logits[:, :-1] against ids[:, 1:]" in str(ei.value)


def test_return_value_shares_bindings():
    @contract
    def token_logprobs(logits: Float[Tensor, "B T V"], ids: TokenIds) -> LogProbs:
        return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)  # no shift: bug

    with pytest.raises(ContractViolation) as ei:
        token_logprobs(torch.randn(B, T, 5), torch.zeros(B, T, dtype=torch.long))
    assert (ei.value.code, ei.value.argument) == ("RLG012", "return")
    assert "return value" in str(ei.value)


def test_wrong_dtype_rank_and_type():
    with pytest.raises(ContractViolation, match="dtype is int64, expected float") as ei:
        policy_loss(**good() | {"logp": torch.zeros(B, T - 1, dtype=torch.long)})
    assert ei.value.code == "RLG000" and ei.value.argument == "logp"
    with pytest.raises(ContractViolation, match="has 1 dims, expected 2"):
        policy_loss(**good() | {"old_logp": torch.zeros(B)})
    with pytest.raises(ContractViolation, match="expected a torch.Tensor, got list"):
        policy_loss(**good() | {"advantages": [1.0] * B})
    with pytest.raises(ContractViolation, match=r"dim 0 \(B\) is 9, but B=8") as ei:
        policy_loss(**good() | {"advantages": torch.randn(9)})
    assert ei.value.argument == "advantages" and "B from logp" in str(ei.value)


def test_fixed_anonymous_variadic_broadcast_dims():
    @contract
    def f(x: Float[Tensor, "*batch 3"], y: Float[Tensor, "*batch _"], z: Float[Tensor, "... #C"],
          w: Shaped[Tensor, "C"]) -> Float[Tensor, "*batch 3"]:
        return x

    f(torch.zeros(2, 5, 3), torch.zeros(2, 5, 7), torch.zeros(4, 1), torch.zeros(6))
    f(torch.zeros(3), torch.zeros(9), torch.zeros(6), torch.zeros(6))
    with pytest.raises(ContractViolation, match="dim 2 is 4, expected 3"):
        f(torch.zeros(2, 5, 4), torch.zeros(2, 5, 7), torch.zeros(1), torch.zeros(6))
    with pytest.raises(ContractViolation, match=r"\*batch are \(2, 6\), but \*batch=\(2, 5\)"):
        f(torch.zeros(2, 5, 3), torch.zeros(2, 6, 7), torch.zeros(1), torch.zeros(6))
    with pytest.raises(ContractViolation, match=r"dim 0 \(C\) is 6, but C=2"):
        f(torch.zeros(3), torch.zeros(1), torch.zeros(2), torch.zeros(6))


def test_symbolic_expressions_with_plain_names():
    @contract
    def f(a: Float[Tensor, "N"], b: Float[Tensor, "2*N+1"]) -> Float[Tensor, "N+1"]:
        return torch.zeros(a.shape[0] + 1)

    f(torch.zeros(3), torch.zeros(7))
    with pytest.raises(ContractViolation, match="2\\*N\\+1 = 7"):
        f(torch.zeros(3), torch.zeros(6))


def test_optional_default_kwonly_positional_only_and_methods():
    class Trainer:
        @contract
        def loss(self, logp: LogProbs, /, mask: Optional[ActionMask] = None, *,
                 advantages: Annotated[Advantages, NoGrad()], scale: float = 1.0) -> Loss:
            m = mask if mask is not None else torch.ones_like(logp)
            return -scale * (logp * m * advantages[:, None]).sum()  # REINFORCE: minimise -logp * A

        @staticmethod
        @contract
        def s(logp: LogProbs) -> Loss:
            return logp.sum()

        @contract
        @classmethod
        def c(cls, logp: LogProbs) -> Loss:
            return logp.sum()

    t = Trainer()
    lp, adv = torch.randn(B, T - 1), torch.randn(B)
    t.loss(lp, advantages=adv)  # default mask None, kw-only advantages
    t.loss(lp, torch.ones(B, T - 1), advantages=adv, scale=2.0)
    with pytest.raises(ContractViolation) as ei:
        t.loss(lp, advantages=adv.requires_grad_())
    assert (ei.value.code, ei.value.function, ei.value.argument) == ("RLG003", "test_optional_default_kwonly_positional_only_and_methods.<locals>.Trainer.loss", "advantages")
    with pytest.raises(ContractViolation) as ei:
        t.loss(lp, torch.ones(B, T), advantages=adv.detach())
    assert ei.value.code == "RLG001"
    Trainer.s(lp)
    t.c(lp)
    with pytest.raises(ContractViolation):
        Trainer.s(torch.randn(B))
    with pytest.raises(ContractViolation):
        Trainer.c(torch.randn(B))
    with pytest.raises(TypeError):  # a missing argument is Python's error, not ours
        t.loss(lp)


def test_tuple_return():
    @contract
    def f(x: Float[Tensor, "B"]) -> tuple[Float[Tensor, ""], Annotated[Float[Tensor, "B"], NoGrad()], dict]:
        return x.sum(), x * 2, {}

    f(torch.randn(4))
    with pytest.raises(ContractViolation) as ei:
        f(torch.randn(4, requires_grad=True))
    assert (ei.value.code, ei.value.argument) == ("RLG003", "return[1]")


@pytest.mark.parametrize("typechecker", ["typeguard", "beartype"])
def test_non_tensor_annotations_go_to_the_typechecker(typechecker):
    @contract(typechecker=typechecker)
    def f(x: Float[Tensor, "B"], clip: float, names: list[str], opt: Optional[torch.nn.Module] = None) -> None:
        return None

    f(torch.zeros(2), 0.2, ["a"])
    with pytest.raises(ContractViolation) as ei:
        f(torch.zeros(2), "0.2", ["a"])
    assert ei.value.argument == "clip" and ei.value.code == "RLG000"
    with pytest.raises(ContractViolation) as ei:
        f(torch.zeros(2), 0.2, [1])
    assert ei.value.argument == "names"
    with pytest.raises(ContractViolation) as ei:
        f(torch.zeros(2), 0.2, ["a"], opt=3)
    assert ei.value.argument == "opt"

    @contract(typechecker=None)
    def g(x: Float[Tensor, "B"], clip: float) -> None:
        return None

    g(torch.zeros(2), "not checked")


def test_definition_errors_at_decoration_time():
    with pytest.raises(ContractDefinitionError, match="no parameter 'oldlogp'"):
        @contract(markers={"oldlogp": NoGrad()})
        def f1(old_logp: LogProbs) -> None: ...

    with pytest.raises(ContractDefinitionError, match=r"f2\(\): MatchesOwner\(owner='owner'\) on 'mask'.*no parameter 'owner'"):
        @contract
        def f2(mask: Annotated[ActionMask, MatchesOwner()]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="unsupported operator Pow"):
        @contract
        def f3(x: Float[Tensor, "N N**2"]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="unknown dim syntax"):
        @contract
        def f4(x: Float[Tensor, "N f(N)"]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="dim 'K' in '2\\*K' is bound by no annotation"):
        @contract
        def f5(x: Float[Tensor, "2*K"]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="can't find the group size"):
        @contract
        def f6(advantages: Annotated[Advantages, GroupCentred()]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="'cfg' is neither a parameter"):
        @contract
        def f7(advantages: Annotated[Advantages, GroupCentred("cfg.group_size")]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="Frozen on 'old_logp' needs current="):
        @contract
        def f8(old_logp: Annotated[LogProbs, Frozen]) -> None: ...

    with pytest.raises(ContractDefinitionError, match="check_every must be a positive int"):
        @contract(check_every=0)
        def f9(x: LogProbs) -> None: ...

    with pytest.raises(ContractDefinitionError, match="not supported"):
        @contract
        def f10(*xs: LogProbs) -> None: ...

    with pytest.raises(ContractDefinitionError, match="typechecker must be"):
        @contract(typechecker="mypy")
        def f11(x: LogProbs) -> None: ...

    with pytest.raises(ContractDefinitionError, match="cannot resolve its annotations"):
        @contract
        def f12(x: "NoSuchType") -> None: ...  # noqa: F821

    with pytest.raises(ContractDefinitionError, match="Shaped"):
        @contract
        def f13(x: Float[Tensor, "B"] | Int[Tensor, "B"]) -> None: ...

    assert issubclass(ContractDefinitionError, TypeError)


def test_violation_is_small_and_picklable():
    import pickle

    with pytest.raises(ContractViolation) as ei:
        policy_loss(**good() | {"mask": torch.ones(B, T)})
    e2 = pickle.loads(pickle.dumps(ei.value))
    assert (e2.code, e2.function, e2.argument, e2.rank, str(e2)) == ("RLG001", "policy_loss", "mask", None,
                                                                     str(ei.value))
    assert not any(isinstance(v, torch.Tensor) for v in vars(e2.violations[0]).values())
