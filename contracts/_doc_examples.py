"""The violation messages shown in ``docs/contracts.md``, produced by the code (never typed by hand).

``python -m rlguard.contracts._doc_examples`` prints them as Markdown; ``tests/test_contracts_docs.py`` checks
that every message in the docs equals what the code produces now.
"""

from __future__ import annotations

import copy
from typing import Annotated, Callable

import torch
from torch import nn

from rlguard.contracts import (
    ActionMask,
    Advantages,
    ContractDefinitionError,
    ContractViolation,
    Finite,
    Frozen,
    GroupCentred,
    GroupRewards,
    Guard,
    Logits,
    LogProbs,
    Loss,
    MatchesOwner,
    NoGrad,
    Owner,
    RowsInStep,
    SamplerConsistent,
    StopTokenInMask,
    TokenIds,
    contract,
    row_independent,
)

B, T, V = 4, 8, 16
PROMPT, POLICY, ENV = 0, 1, 2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(torch.cumsum(self.emb(ids), dim=1)))


@contract
def token_logprobs(logits: Logits, ids: TokenIds) -> Annotated[LogProbs, Finite()]:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


@contract
def policy_loss(
    logp: Annotated[LogProbs, Finite(), SamplerConsistent(sampler="old_logp", mask="mask")],
    old_logp: Annotated[LogProbs, NoGrad(), Frozen(current="logp", key="ids", mask="mask")],
    advantages: Annotated[Advantages, NoGrad()],
    mask: ActionMask,
    ids: TokenIds,
) -> Annotated[Loss, Finite()]:
    ratio = torch.exp(logp - old_logp)
    return -(ratio * advantages[:, None] * mask).sum() / mask.sum()


def _named(name: str, fn: Callable) -> Callable:
    """``contract(fn)`` under a plain name (the examples are nested functions)."""
    fn.__qualname__ = name
    return contract(fn)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    owner = torch.full((B, T), PROMPT)
    owner[:, 3:6] = POLICY
    owner[:, 6:] = ENV
    return {"ids": ids, "owner": owner}


def _models() -> tuple[TinyLM, TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(0)
    policy = TinyLM()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    return policy, ref, torch.optim.SGD(policy.parameters(), lr=0.5)


def ex_mask_not_shifted() -> None:
    b = _batch()
    policy, _, _ = _models()
    logp = token_logprobs(policy(b["ids"]), b["ids"])
    mask = (b["owner"] == POLICY).float()  # the bug: aligned to ids, [B, T]
    policy_loss(logp, logp.detach(), torch.zeros(B), mask, b["ids"])


def ex_unshifted_logprobs() -> None:
    def token_logprobs(logits: Logits, ids: TokenIds) -> LogProbs:
        logp = torch.log_softmax(logits, dim=-1)  # the bug: logits[:, t] against ids[:, t]
        return logp.gather(-1, ids[..., None]).squeeze(-1)

    b = _batch()
    _named("token_logprobs", token_logprobs)(torch.zeros(B, T, V), b["ids"])


def ex_dtype() -> None:
    b = _batch()
    token_logprobs(torch.zeros(B, T, V), b["ids"].float())


def ex_nograd() -> None:
    b = _batch()
    policy, _, _ = _models()
    logp = token_logprobs(policy(b["ids"]), b["ids"])
    mask = (b["owner"][:, 1:] == POLICY).float()
    old_logp = logp * 1.0  # the bug: computed with autograd on
    policy_loss(logp, old_logp, torch.zeros(B), mask, b["ids"])


def ex_finite() -> None:
    b = _batch()
    logits = torch.zeros(B, T, V)
    logits[1, 2, :] = float("nan")
    token_logprobs(logits, b["ids"])


def ex_group_centred() -> None:
    def compute_advantages(rewards: GroupRewards) -> Annotated[Advantages, NoGrad(), GroupCentred()]:
        r = rewards.reshape(-1)
        return (r - r.mean()) / (r.std() + 1e-6)  # the bug: whole-batch baseline

    _named("compute_advantages", compute_advantages)(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))


def ex_matches_owner() -> None:
    def action_mask(owner: Owner) -> Annotated[ActionMask, MatchesOwner(owner="owner")]:
        return (owner[:, :-1] == POLICY).float()  # the bug: sliced the wrong end

    _named("action_mask", action_mask)(_batch()["owner"])


def ex_sampler() -> None:
    b = _batch()
    ids = b["ids"]
    policy, ref, opt = _models()
    mask = (b["owner"][:, 1:] == POLICY).float()
    with torch.no_grad():
        old_logp = token_logprobs(policy(ids) / 0.7, ids)  # the bug: the sampler ran at temperature 0.7
    with Guard(policy=policy, reference=ref, optimizer=opt) as guard, guard.update():
        policy_loss(token_logprobs(policy(ids), ids), old_logp, torch.zeros(B), mask, ids)


def ex_frozen_ratio() -> None:
    b = _batch()
    ids = b["ids"]
    policy, ref, opt = _models()
    mask = (b["owner"][:, 1:] == POLICY).float()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    with Guard(policy=policy, reference=ref, optimizer=opt) as guard, guard.update():
        for mb in (slice(0, 2), slice(2, 4)):  # two minibatches of one epoch
            with torch.no_grad():  # the bug: old log-probs recomputed inside the update loop
                old_logp = token_logprobs(policy(ids[mb]), ids[mb])
            logp = token_logprobs(policy(ids[mb]), ids[mb])
            loss = policy_loss(logp, old_logp, adv[mb], mask[mb], ids[mb])
            opt.zero_grad()
            loss.backward()
            opt.step()


def ex_frozen_rows() -> None:
    b = _batch()
    ids = b["ids"]
    policy, ref, opt = _models()
    mask = (b["owner"][:, 1:] == POLICY).float()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    with torch.no_grad():
        old_logp = token_logprobs(policy(ids), ids)
    with Guard(policy=policy, reference=ref, optimizer=opt) as guard, guard.update():
        for epoch in range(2):
            loss = policy_loss(token_logprobs(policy(ids), ids), old_logp, adv, mask, ids)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():  # the bug: refreshed after each epoch from the new weights
                old_logp = 0.5 * (old_logp + token_logprobs(policy(ids), ids))


def ex_reference_alias() -> None:
    policy, _, opt = _models()
    Guard(policy=policy, reference=copy.copy(policy), optimizer=opt)


def ex_reference_in_optimizer() -> None:
    policy, ref, _ = _models()
    opt = torch.optim.AdamW(list(policy.parameters()) + list(ref.parameters()))
    Guard(policy=policy, reference=ref, optimizer=opt)


def ex_grad_not_zeroed() -> None:
    policy, _, opt = _models()
    ids = _batch()["ids"]
    with Guard(policy=policy, optimizer=opt):
        for _ in range(2):
            policy(ids).logsumexp(-1).mean().backward()  # the bug: no opt.zero_grad() between the steps
            opt.step()


def ex_frozen_trained() -> None:
    policy, _, _ = _models()
    opt = torch.optim.AdamW(policy.parameters())  # the bug: the embedding meant to stay frozen is still trainable
    Guard(policy=policy, optimizer=opt, frozen=["emb"])


def ex_stop_token() -> None:
    eos = 2
    ids = torch.tensor([[5, 6, 7, 8, eos, eos, eos, eos], [5, 6, 9, eos, eos, eos, eos, eos]])

    def completion_mask(ids: TokenIds, pad_token_id: int) -> Annotated[
            ActionMask, StopTokenInMask(ids="ids", stop_ids="pad_token_id")]:
        return (ids[:, 1:] != pad_token_id).float()  # the bug: the pad token is the EOS token

    _named("completion_mask", completion_mask)(ids, eos)


def ex_padding_leak() -> None:
    def token_logps(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids)
        logits = logits - logits.mean(0, keepdim=True)  # the bug: every row reads the batch
        return token_logprobs(logits, input_ids)

    token_logps.__qualname__ = "token_logps"
    ids = _batch()["ids"]
    row_independent(mask="attention_mask")(token_logps)(TinyLM(), ids, torch.ones_like(ids))


def ex_train_mode_scoring() -> None:
    policy = TinyLM()
    ref = nn.Sequential(copy.deepcopy(policy), nn.Dropout(0.1)).requires_grad_(False)  # never put in eval mode
    with Guard(policy=policy, reference=ref, optimizer=torch.optim.SGD(policy.parameters(), lr=0.1)), \
            torch.no_grad():
        ref(_batch()["ids"])


IN_STEP = RowsInStep(key="ids")


def ex_rows_out_of_step() -> None:
    def collate(ids: TokenIds, advantages: Annotated[Advantages, IN_STEP]) -> None:
        return None

    def loss(ids: TokenIds, advantages: Annotated[Advantages, IN_STEP]) -> None:
        return None

    ids = _batch()["ids"]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    policy = TinyLM()
    with Guard(policy=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.1)) as guard:
        _named("collate", collate)(ids, adv)
        order = torch.tensor([2, 0, 3, 1])
        with guard.update():
            _named("loss", loss)(ids[order], adv)  # the bug: the ids sorted, the advantages not


def ex_definition() -> None:
    def policy_loss(logp: LogProbs, old_logp: LogProbs) -> Loss:
        return (logp - old_logp).sum()

    policy_loss.__qualname__ = "policy_loss"
    contract(markers={"old_logprobs": NoGrad()})(policy_loss)


EXAMPLES: list[tuple[str, Callable[[], None]]] = [
    ("A [B, T] mask beside [B, T-1] log-probs (RLG001)", ex_mask_not_shifted),
    ("Log-probs without the one-token shift (RLG012)", ex_unshifted_logprobs),
    ("A wrong dtype (RLG000)", ex_dtype),
    ("NoGrad: old log-probs with autograd history (RLG003)", ex_nograd),
    ("Finite: a NaN (RLG000)", ex_finite),
    ("GroupCentred: a whole-batch baseline (RLG009)", ex_group_centred),
    ("MatchesOwner: a mask aligned to ids (RLG001)", ex_matches_owner),
    ("SamplerConsistent: a sampler at another temperature (RLG007)", ex_sampler),
    ("Frozen: old log-probs recomputed in the loop (RLG002)", ex_frozen_ratio),
    ("Frozen: old log-probs changed between epochs (RLG002)", ex_frozen_rows),
    ("Guard: a shallow copy as reference (RLG008)", ex_reference_alias),
    ("Guard: the reference in the optimizer (RLG008)", ex_reference_in_optimizer),
    ("Guard: gradients not zeroed between steps (RLG013)", ex_grad_not_zeroed),
    ("Guard: a frozen parameter left trainable in the optimizer (RLG014)", ex_frozen_trained),
    ("row_independent: rows that read their batch neighbours (RLG016)", ex_padding_leak),
    ("StopTokenInMask: pad = eos and a mask of ids != pad (RLG017)", ex_stop_token),
    ("Guard: a reference forward in train mode with dropout (RLG018)", ex_train_mode_scoring),
    ("RowsInStep: ids sorted, advantages not (RLG019)", ex_rows_out_of_step),
    ("A marker on a parameter that does not exist (at decoration)", ex_definition),
]


def messages() -> list[tuple[str, str]]:
    """(title, message) for every example; the message is what the code raises now."""
    out = []
    torch.set_num_threads(1)
    for title, fn in EXAMPLES:
        try:
            fn()
        except (ContractViolation, ContractDefinitionError) as e:
            out.append((title, f"{type(e).__name__}: {e}"))
        else:  # pragma: no cover - an example that no longer fails is a bug
            raise AssertionError(f"example {fn.__name__} raised nothing")
    return out


def markdown() -> str:
    return "\n".join(f"### {title}\n\n```text\n{msg}\n```\n" for title, msg in messages())


BEGIN, END = "<!-- generated: violation messages (begin) -->", "<!-- generated: violation messages (end) -->"


def write(path: str) -> None:
    """Replace the generated block of ``path`` (docs/contracts.md) with the messages of the code now."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n\n{markdown()}\n{END}{tail}")


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        write(sys.argv[2])
    else:
        print(markdown())
