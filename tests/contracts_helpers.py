"""Tiny GRPO trainers decorated with rlguard contracts, shared by the contracts tests: a functional one
(``train``), a class-based one that passes dict batches (``DictGRPOTrainer``), and a host-sync counter."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Annotated, Optional

import torch
from torch import nn

from rlguard.contracts import (
    ActionMask,
    Advantages,
    Batch,
    DistinctReference,
    EvalMode,
    Finite,
    FollowsRewards,
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
    Rewards,
    RowsInStep,
    SamplerConsistent,
    StopTokenInMask,
    TokenIds,
    UpdateDirection,
    contract,
    row_independent,
)

V, P, G, T = 32, 2, 4, 12
B = P * G
PROMPT, POLICY, ENV = 0, 1, 2


class TinyLM(nn.Module):
    def __init__(self, vocab: int = V, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + torch.tanh(self.mix(torch.cumsum(h, dim=1) / torch.arange(1, ids.shape[1] + 1)[:, None]))
        return self.head(h)


@contract
def token_logprobs(logits: Logits, ids: TokenIds) -> Annotated[LogProbs, Finite()]:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


@contract
def action_mask(owner: Owner) -> Annotated[ActionMask, MatchesOwner(owner="owner")]:
    return (owner[:, 1:] == POLICY).float()


@contract
def compute_advantages(rewards: Annotated[GroupRewards, Finite()]) -> Annotated[
        Advantages, NoGrad(), Finite(), GroupCentred()]:
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return (centred / (rewards.std(dim=1, keepdim=True) + 1e-6)).reshape(-1)


@contract
def policy_loss(
    logp: Annotated[LogProbs, Finite(), SamplerConsistent(sampler="old_logp", mask="mask")],
    old_logp: Annotated[LogProbs, NoGrad(), Frozen(current="logp", mask="mask")],
    advantages: Annotated[Advantages, NoGrad()],
    mask: ActionMask,
    *,
    clip: float = 0.2,
) -> Annotated[Loss, Finite()]:
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    return -(surrogate * mask).sum() / mask.sum()


@contract
def kl_penalty(logp: LogProbs, ref_logp: Annotated[LogProbs, NoGrad()], mask: ActionMask) -> Annotated[
        Loss, Finite()]:
    d = ref_logp - logp
    return ((torch.exp(d) - d - 1) * mask).sum() / mask.sum()


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=gen)
    owner = torch.full((B, T), PROMPT)
    owner[:, 4:10] = POLICY
    owner[:, 10:] = ENV
    rewards = torch.randint(0, 2, (P, G), generator=gen).float()
    rewards[0] = torch.tensor([0.0, 1.0, 0.0, 1.0])  # never an all-equal first group
    return {"ids": ids, "owner": owner, "rewards": rewards}


def make_models(seed: int = 0) -> tuple[TinyLM, TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    policy = TinyLM()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    return policy, ref, opt


def train(updates: int = 2, epochs: int = 2, minibatches: int = 2, seed: int = 0,
          recompute_old: bool = False, guard: bool = True) -> TinyLM:
    """A few GRPO updates; ``recompute_old`` injects the RLG002 bug."""
    policy, ref, opt = make_models(seed)
    g = Guard(policy=policy, reference=ref, optimizer=opt) if guard else None
    for u in range(updates):
        batch = make_batch(seed + u)
        ids, owner = batch["ids"], batch["owner"]
        mask = action_mask(owner)
        with torch.no_grad():
            old_logp = token_logprobs(policy(ids), ids)
            ref_logp = token_logprobs(ref(ids), ids)
        adv = compute_advantages(batch["rewards"])
        ctx = g.update() if g is not None else _null()
        with ctx:
            for _ in range(epochs):
                for mb in torch.arange(B).chunk(minibatches):
                    logp = token_logprobs(policy(ids[mb]), ids[mb])
                    old = old_logp[mb]
                    if recompute_old:
                        with torch.no_grad():
                            old = token_logprobs(policy(ids[mb]), ids[mb])  # noqa: RLG002 - the recompute_old fault, injected on purpose
                    loss = policy_loss(logp, old, adv[mb], mask[mb]) + 0.01 * kl_penalty(
                        logp, ref_logp[mb], mask[mb])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    if g is not None:
        g.close()
    return policy


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


class HostSyncs:
    """Counts the calls that read tensor values on the host (each a device synchronisation on a GPU) while it is
    active: ``.item()``, ``.tolist()``, ``bool()``/``int()``/``float()``/index of a tensor, ``.cpu()``,
    ``.numpy()``, ``torch.equal``, ``nonzero``. A ``TorchFunctionMode``, so it counts them on CPU too."""

    NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "equal", "nonzero",
             "allclose", "is_nonzero"}

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode

        counter = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in HostSyncs.NAMES:
                    counter.calls.append(name)
                return func(*args, **(kwargs or {}))

        self.calls: list[str] = []
        self._mode = _Mode()

    @property
    def count(self) -> int:
        return len(self.calls)

    def __enter__(self) -> "HostSyncs":
        self.calls.clear()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


# -- a class-based GRPO trainer that keeps its tensors in dicts (TRL style), contracted with Batch specs --------

IN_STEP = RowsInStep(key="input_ids")  # the fields of an episode keep its rows from the rollout to the loss
ROLLOUT = Batch(
    input_ids=TokenIds,
    owner=Owner,
    # the stop token first: a mask that drops it differs from the owner's too, and RLG017 is the cause
    completion_mask=Annotated[ActionMask, StopTokenInMask(ids="input_ids", stop_ids="self.spec.stop_ids"),
                              MatchesOwner(owner="owner"), IN_STEP],
    sampler_logps=Annotated[LogProbs, NoGrad(), Finite(), IN_STEP],
    rewards=Annotated[Rewards, Finite(), IN_STEP],
    advantages=Annotated[Advantages, NoGrad(), Finite(), GroupCentred(group_size="self.args.num_generations"),
                         FollowsRewards(rewards="rewards", group_size="self.args.num_generations"), IN_STEP],
    old_per_token_logps=Optional[Annotated[LogProbs, NoGrad(), Finite(),
                                           Frozen(key="input_ids", mask="completion_mask"), IN_STEP]],
    ref_per_token_logps=Optional[Annotated[LogProbs, NoGrad(), Finite(), IN_STEP]],
)


@dataclass(frozen=True)
class DictArgs:
    num_generations: int = 4
    prompts: int = 4
    beta: float = 0.04
    epsilon: float = 0.2
    num_iterations: int = 2
    steps_per_generation: int = 2
    gradient_accumulation_steps: int = 2
    learning_rate: float = 3e-3
    frozen: tuple[str, ...] = ("pos_emb",)  # what the trainer keeps frozen (its model freezes it when built)
    fault: str | None = None  # None, or one of DICT_FAULTS


DICT_FAULTS = {  # fault -> the code its contract reports
    "mask_shift": "RLG001",  # completion mask from owner[:, :-1]
    "stale_old_logp": "RLG002",  # old log-probs recomputed from the current weights in every minibatch
    "old_logp_with_grad": "RLG003",  # old log-probs computed with autograd on
    "sampler_temp": "RLG007",  # the sampler runs at another temperature than the trainer
    "ref_is_policy": "RLG008",  # the KL reference is the policy itself
    "group_mean_batch": "RLG009",  # one baseline for the whole batch
    "label_shift": "RLG012",  # log-probs gathered at ids[:, t] from logits[:, t]
    "no_zero_grad": "RLG013",  # optimizer.zero_grad() skipped between steps
    "trains_frozen": "RLG014",  # the frozen position embedding made trainable and put in the optimizer
    "pack_no_mask": "RLG016",  # rows packed into one sequence for the forward, no mask to keep them apart
    "pad_is_eos": "RLG017",  # pad = eos and the completion mask drops pad ids: the EOS too
    "ref_train_mode": "RLG018",  # the reference rebuilt from the config, left in train mode (dropout on)
    "rows_out_of_step": "RLG019",  # microbatches length-sorted for the forward, advantages left unsorted
    "sign_flip_mid_run": "RLG005",  # advantages negated from the second update on: a fault that starts mid-run
    "surrogate_sign_mid_run": "RLG005",  # the surrogate's minus lost from the second update on
}


class DictGRPOTrainer:
    """GRPO with TRL-like names whose methods pass one ``inputs`` dict around; every method that sees tensors is
    contracted through its annotations (no function written for rlguard)."""

    def __init__(self, model: nn.Module, args: DictArgs, seed: int = 0) -> None:
        from rlguard.reference.task import TaskSpec, make_tasks

        from rlguard.reference.model import TinyCausalLM

        self.model, self.args = model, args
        self.ref_model = model if args.fault == "ref_is_policy" else copy.deepcopy(model).eval().requires_grad_(False)
        if args.fault == "ref_train_mode":  # rebuilt from the config: train mode, the config's dropout on
            self.ref_model = TinyCausalLM(model.cfg)
            self.ref_model.load_state_dict(model.state_dict())
            self.ref_model.requires_grad_(False)
        if args.fault == "trains_frozen":
            model.requires_grad_(True)  # the fault: "unfreeze everything", the frozen position embedding too
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
        self.generator = torch.Generator().manual_seed(seed)
        self.spec = TaskSpec(stop_token=True)
        self.tasks, _ = make_tasks(self.spec, n_train=32, n_heldout=0, seed=seed)

    @contract
    def _compute_advantages(self, rewards: Rewards) -> Annotated[
            Advantages, NoGrad(), GroupCentred(group_size="self.args.num_generations")]:
        grouped = rewards.view(-1, self.args.num_generations)
        if self.args.fault == "group_mean_batch":
            return (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # noqa: RLG009 - the group_mean_batch fault, injected on purpose
        return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)

    @contract
    @row_independent(ids="input_ids", mask=None, every=4)
    def _get_per_token_logps(self, model: Annotated[nn.Module, EvalMode(only_no_grad=True)],
                             input_ids: TokenIds) -> Annotated[LogProbs, Finite()]:
        if self.args.fault == "pack_no_mask":
            logits = _packed_forward(model, input_ids)
        else:
            logits = model(input_ids)
        if self.args.fault == "label_shift":
            return torch.log_softmax(logits, -1).gather(-1, input_ids[..., None]).squeeze(-1)  # noqa: RLG012 - the label_shift fault, injected on purpose
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)

    @contract(markers={"self": DistinctReference(reference="self.ref_model", policy="self.model",
                                                 optimizer="self.optimizer")})
    def generate_and_score(self, prompts: list) -> Annotated[dict, ROLLOUT]:
        from rlguard.reference.sampling import collate, sample_episodes
        from rlguard.reference.task import POLICY as PLAYER

        temperature = 0.7 if self.args.fault == "sampler_temp" else 1.0  # the trainer scores at 1.0
        episodes = sample_episodes(self.model, prompts, self.spec, self.args.num_generations,
                                   temperature=temperature, generator=self.generator)
        batch = collate(episodes, self.args.num_generations)
        owner = batch["owner"]
        shift = owner[:, :-1] if self.args.fault == "mask_shift" else owner[:, 1:]
        completion_mask = (shift == PLAYER).float()
        if self.args.fault == "pad_is_eos":  # the tokenizer's pad token set to its EOS: ids != pad drops the EOS
            completion_mask = completion_mask * (batch["ids"][:, 1:] != self.spec.eos_token())
        inputs = {"input_ids": batch["ids"], "owner": owner, "completion_mask": completion_mask,
                  "sampler_logps": batch["sampler_logp"], "rewards": batch["rewards"]}
        inputs["advantages"] = self._compute_advantages(inputs["rewards"])
        self.rollouts = getattr(self, "rollouts", 0) + 1
        if self.args.fault == "sign_flip_mid_run" and self.rollouts > 1:
            inputs["advantages"] = -inputs["advantages"]
        grad = torch.enable_grad() if self.args.fault == "old_logp_with_grad" else torch.no_grad()
        with grad:
            inputs["old_per_token_logps"] = self._get_per_token_logps(self.model, inputs["input_ids"])
        with torch.no_grad():
            inputs["ref_per_token_logps"] = self._get_per_token_logps(self.ref_model, inputs["input_ids"])
        return inputs

    @contract
    def _loss(self, per_token_logps: Annotated[LogProbs, SamplerConsistent(sampler="inputs.sampler_logps",
                                                                           mask="inputs.completion_mask"),
                                               UpdateDirection(advantages="inputs.advantages",
                                                               mask="inputs.completion_mask", key="inputs.input_ids")],
              inputs: Annotated[dict, Batch(
                  input_ids=TokenIds,
                  completion_mask=Annotated[ActionMask, IN_STEP], advantages=Annotated[Advantages, NoGrad(), IN_STEP],
                  old_per_token_logps=Annotated[LogProbs, NoGrad(), Frozen(current="per_token_logps",
                                                                           mask="completion_mask"), IN_STEP],
                  ref_per_token_logps=Annotated[LogProbs, NoGrad(), IN_STEP])],
              num_items: torch.Tensor) -> Annotated[Loss, Finite()]:
        mask = inputs["completion_mask"]
        coef_1 = torch.exp(per_token_logps - inputs["old_per_token_logps"])
        coef_2 = torch.clamp(coef_1, 1 - self.args.epsilon, 1 + self.args.epsilon)
        adv = inputs["advantages"][:, None]
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        if self.args.fault == "surrogate_sign_mid_run" and self.rollouts > 1:
            per_token = torch.min(coef_1 * adv, coef_2 * adv)  # noqa: RLG005 - the surrogate_sign_mid_run fault, injected on purpose
        d = inputs["ref_per_token_logps"] - per_token_logps
        per_token = per_token + self.args.beta * (torch.exp(d) - d - 1)
        return (per_token * mask).sum() / num_items

    def training_step(self, inputs: dict, guard: Guard | None) -> None:
        n = inputs["input_ids"].shape[0]
        ctx = guard.update() if guard is not None else _null()
        with ctx:
            for _ in range(self.args.num_iterations):
                for rows in torch.randperm(n, generator=self.generator).chunk(self.args.steps_per_generation):
                    if self.args.fault != "no_zero_grad":
                        self.optimizer.zero_grad()
                    num_items = inputs["completion_mask"][rows].sum().clamp(min=1)
                    for micro in rows.chunk(self.args.gradient_accumulation_steps):
                        sub = {k: v[micro] for k, v in inputs.items()}
                        if self.args.fault == "rows_out_of_step":  # sorted for the forward, advantages not
                            order = micro[inputs["completion_mask"][micro].sum(-1).argsort(stable=True)]
                            sub = {k: (v if k == "advantages" else inputs[k][order]) for k, v in sub.items()}
                        if self.args.fault == "stale_old_logp":
                            with torch.no_grad():
                                sub["old_per_token_logps"] = self._get_per_token_logps(self.model, sub["input_ids"])  # noqa: RLG002 - the stale_old_logp fault, injected on purpose
                        logps = self._get_per_token_logps(self.model, sub["input_ids"])
                        self._loss(logps, sub, num_items).backward()
                    self.optimizer.step()

    def train(self, steps: int, guard: bool = True) -> None:
        g = Guard(policy=self.model, reference=self.ref_model, optimizer=self.optimizer,
                  frozen=self.args.frozen) if guard else None
        try:
            for _ in range(steps):
                picks = torch.randperm(len(self.tasks), generator=self.generator)[: self.args.prompts]
                self.training_step(self.generate_and_score([self.tasks[i] for i in picks.tolist()]), g)
        finally:
            if g is not None:
                g.close()


def _packed_forward(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The pack_no_mask fault: the rows' tokens in one sequence, positions restarting per row, no block mask."""
    from rlguard.reference.task import PAD

    keep = input_ids != PAD
    lengths = keep.sum(-1)
    position_ids = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    logits = model(input_ids[keep][None], position_ids=position_ids)
    out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
    out[keep] = logits[0]
    return out


def dict_trainer(seed: int = 0, **args) -> DictGRPOTrainer:
    from rlguard.reference.model import ModelConfig, build_model, disable_dropout
    from rlguard.reference.task import TaskSpec

    # dropout modules in the model, disabled in the policy (as TRL does): a reference rebuilt from the config has
    # them on (the ref_train_mode fault)
    cfg = ModelConfig(vocab_size=TaskSpec(stop_token=True).vocab_size, d_model=32, n_layers=1, dropout=0.1)
    model = disable_dropout(build_model(cfg, seed=seed))
    model.pos_emb.requires_grad_(False)
    return DictGRPOTrainer(model, replace(DictArgs(), **args), seed=seed)


def padded_rows(side: str = "right", pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Four rows of 9 token ids (1..11) holding 9, 6, 4 and 7 real tokens, padded with ``pad`` on ``side``, and
    their attention mask: the batch the row-independence tests pad further and re-score."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 12, (4, 9), generator=gen)
    mask = torch.ones_like(ids)
    for r, n in enumerate((9, 6, 4, 7)):
        if side == "right":
            ids[r, n:], mask[r, n:] = pad, 0
        else:
            ids[r] = torch.cat([torch.full((9 - n,), pad), ids[r, :n]])
            mask[r] = torch.cat([torch.zeros(9 - n, dtype=mask.dtype), torch.ones(n, dtype=mask.dtype)])
    return ids, mask
