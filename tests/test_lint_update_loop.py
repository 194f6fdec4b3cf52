"""Update-loop / autograd rules (RLG002, RLG003, RLG006, RLG013) on realistic multi-function trainers.

The rules' own VALID/INVALID examples are short; these are whole classes and modules in the styles of open RL
code, where the facts the rules need are spread over several methods and helpers.
"""

from __future__ import annotations

import textwrap

import pytest

from rlguard.lint import all_rules, lint_source

CODES = ("RLG002", "RLG003", "RLG006", "RLG013")
RULES = [all_rules()[c] for c in CODES]


def findings(source: str, fix: bool = False):
    # preview on: several trainers name their targets only by variable (`ref_logps = ...`), which the stable
    # RLG003 leaves to its preview part; the update-loop facts judged here are the same in both modes
    return lint_source(textwrap.dedent(source), "trainer.py", rules=RULES, fix=fix, preview=True)


def flagged(source: str) -> set[tuple[int, str]]:
    return {(f.line, f.code) for f in findings(source).findings}


CLEAN = {
    "trl_grpo_compute_loss": """
        import torch

        class GRPOTrainer:
            def _get_per_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
                return selective_log_softmax(logits[:, -logits_to_keep:], input_ids[:, -logits_to_keep:])

            def _generate_and_score(self, inputs):
                ids = self.model.generate(inputs["prompt_ids"])
                with torch.no_grad():
                    if self.num_iterations > 1:
                        old_per_token_logps = self._get_per_token_logps(self.model, ids, inputs["mask"], 64)
                    else:
                        old_per_token_logps = None
                    ref_per_token_logps = self._get_per_token_logps(self.ref_model, ids, inputs["mask"], 64)
                return {"old_per_token_logps": old_per_token_logps, "ref_per_token_logps": ref_per_token_logps}

            def compute_loss(self, model, inputs):
                per_token_logps = self._get_per_token_logps(model, inputs["ids"], inputs["mask"], 64)
                old_per_token_logps = (inputs["old_per_token_logps"] if self.num_iterations > 1
                                       else per_token_logps.detach())
                coef_1 = torch.exp(per_token_logps - old_per_token_logps)
                advantages = inputs["advantages"]
                per_token_loss = -coef_1 * advantages.unsqueeze(1)
                mask = inputs["completion_mask"]
                return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    """,
    "openrlhf_experience_and_actor": """
        import torch

        class ExperienceMaker:
            @torch.no_grad()
            def make_experience(self, sequences, attention_mask, num_actions):
                action_log_probs = self.actor(sequences, num_actions, attention_mask)
                base_action_log_probs = self.initial_model(sequences, num_actions, attention_mask)
                value = self.critic(sequences, num_actions, attention_mask)
                advantages, returns = self.get_advantages_and_returns(value, self.reward)
                return action_log_probs, base_action_log_probs, advantages, returns

        class ActorPPOTrainer:
            def ppo_train(self):
                for epoch in range(self.max_epochs):
                    for experience in self.dataloader:
                        self.training_step(experience)

            def training_step(self, experience):
                action_log_probs = self.actor(experience.sequences, experience.num_actions)
                actor_loss = self.actor_loss_fn(action_log_probs, experience.action_log_probs,
                                                experience.advantages, action_mask=experience.action_mask)
                self.strategy.backward(actor_loss, self.actor, self.actor_optim)
                self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler)
    """,
    "cleanrl_ppo": """
        import torch

        for iteration in range(1, args.num_iterations + 1):
            for step in range(0, args.num_steps):
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                    values[step] = value.flatten()
                next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                logprobs[step] = logprob
            with torch.no_grad():
                next_value = agent.get_value(next_obs).reshape(1, -1)
                advantages = torch.zeros_like(rewards)
                lastgaelam = 0
                for t in reversed(range(args.num_steps)):
                    delta = rewards[t] + args.gamma * next_value * nextnonterminal - values[t]
                    advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * lastgaelam
                returns = advantages + values
            b_logprobs = logprobs.reshape(-1)
            b_advantages = advantages.reshape(-1)
            for epoch in range(args.update_epochs):
                for start in range(0, args.batch_size, args.minibatch_size):
                    mb_inds = b_inds[start:start + args.minibatch_size]
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds])
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()
                    mb_advantages = b_advantages[mb_inds]
                    pg_loss = torch.max(-mb_advantages * ratio, -mb_advantages * torch.clamp(ratio, 0.8, 1.2)).mean()
                    optimizer.zero_grad()
                    pg_loss.backward()
                    optimizer.step()
    """,
    "accumulation_with_global_count": """
        import torch

        def train_minibatch(policy, optimizer, minibatch, n_micro):
            total_tokens = minibatch["loss_mask"].sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            for mb in minibatch.chunk(n_micro):
                logp = token_logp(policy, mb["ids"])
                per_token = -(torch.exp(logp - mb["old_logp"]) * mb["adv"][:, None])
                loss_sum = (per_token * mb["loss_mask"]).sum()
                (loss_sum / total_tokens).backward()
            optimizer.step()
    """,
    "hf_accumulate": """
        for epoch in range(num_epochs):
            for step, batch in enumerate(train_dataloader):
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    loss = outputs.loss
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
    """,
    "verl_scaled_by_sequence_share": """
        def update_policy(self, data):
            for mini_batch in data.split(self.ppo_mini_batch_size):
                micro_batches = mini_batch.split(self.ppo_micro_batch_size)
                self.actor_optimizer.zero_grad()
                for micro in micro_batches:
                    response_mask = micro["response_mask"]
                    pg_loss = masked_mean(self.pg_losses(micro), response_mask)
                    loss = pg_loss * (response_mask.shape[0] / self.ppo_mini_batch_size)
                    loss.backward()
                self.actor_optimizer.step()
    """,
    "trl_ppo_update": """
        import torch
        import torch.nn.functional as F

        def train(self, model, ref_policy, optimizer, accelerator, args, data):
            with torch.no_grad():
                query_response, logits = batch_generation(model, data["input_ids"])
                all_logprob = F.log_softmax(logits, dim=-1)
                logprobs = torch.gather(all_logprob, 2, responses.unsqueeze(-1)).squeeze(-1)
                ref_output = forward(ref_policy, query_response, pad_token_id)
                ref_logprobs = F.log_softmax(ref_output.logits, dim=-1)
                full_value, _, _ = get_reward(model.value_model, query_response, pad_token_id)
                values = full_value[:, context_length - 1:-1].squeeze(-1)
                advantages = torch.stack(advantages_reversed[::-1], axis=1)
                returns = advantages + values
                advantages = masked_whiten(advantages, ~padding_mask)
            for ppo_epoch_idx in range(args.num_ppo_epochs):
                b_inds = np.random.permutation(args.local_batch_size)
                for mini_batch_start in range(0, args.local_batch_size, args.local_mini_batch_size):
                    mini_batch_inds = b_inds[mini_batch_start:mini_batch_start + args.local_mini_batch_size]
                    for micro_batch_start in range(0, args.local_mini_batch_size, args.per_device_train_batch_size):
                        with accelerator.accumulate(model):
                            micro_batch_inds = mini_batch_inds[micro_batch_start:micro_batch_start + 4]
                            mb_advantage = advantages[micro_batch_inds]
                            mb_logprobs = logprobs[micro_batch_inds]
                            output, vpred_temp = forward(model, query_responses[micro_batch_inds], pad_token_id)
                            new_all_logprobs = F.log_softmax(output.logits, dim=-1)
                            new_logprobs = torch.gather(new_all_logprobs, 2, mb_responses.unsqueeze(-1)).squeeze(-1)
                            logprobs_diff = new_logprobs - mb_logprobs
                            ratio = torch.exp(logprobs_diff)
                            pg_losses = -mb_advantage * ratio
                            pg_loss = masked_mean(pg_losses, ~padding_mask[micro_batch_inds])
                            loss = pg_loss + args.vf_coef * vf_loss
                            accelerator.backward(loss)
                            optimizer.step()
                            optimizer.zero_grad()
    """,
    "rloo_single_update_per_rollout": """
        import torch

        def train(policy, ref_policy, optimizer, loader, k):
            for batch in loader:
                ids = policy.generate(batch["prompt_ids"])
                with torch.no_grad():
                    ref_logprobs = token_logprobs(ref_policy, ids)
                    rewards = reward_model(ids) - 0.05 * (logprobs_of(policy, ids) - ref_logprobs).sum(1)
                    rewards = rewards.view(k, -1)
                    baseline = (rewards.sum(0) - rewards) / (k - 1)
                    advantages = (rewards - baseline).flatten()
                logp = token_logprobs(policy, ids)
                loss = -(advantages[:, None] * logp * ids.ne(0)).sum() / ids.ne(0).sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    """,
}

BUGGY = {
    "old_logp_per_minibatch_in_class": ("""
        import torch

        class PPO:
            def logp(self, model, ids):
                return model(ids).logits.log_softmax(-1)

            def update(self, rollout):
                for epoch in range(self.ppo_epochs):
                    for idx in torch.randperm(len(rollout)).split(self.mb_size):
                        with torch.no_grad():
                            old_logp = self.logp(self.policy, rollout.ids[idx])
                        new_logp = self.logp(self.policy, rollout.ids[idx])
                        self.optimizer.zero_grad()
                        self.loss(new_logp, old_logp, rollout.adv[idx]).backward()
                        self.optimizer.step()
    """, {(12, "RLG002")}),
    "td_target_with_grad": ("""
        class ActorCritic:
            def td_targets(self, rewards, next_obs, dones):
                next_v = self.critic(next_obs).squeeze(-1)
                returns = rewards + self.gamma * next_v * (1 - dones)
                return returns
    """, {(5, "RLG003")}),
    "verl_agg_loss_accumulation": ("""
        def masked_mean(values, mask, axis=None):
            return (values * mask).sum(axis=axis) / mask.sum(axis=axis)

        def agg_loss(loss_mat, loss_mask, loss_agg_mode):
            if loss_agg_mode == "token-mean":
                loss = masked_mean(loss_mat, loss_mask)
            else:
                loss = masked_mean(loss_mat, loss_mask, axis=-1).mean()
            return loss

        class Actor:
            def update_policy(self, data):
                for micro in data.split(self.micro_batch_size):
                    response_mask = micro["response_mask"]
                    policy_loss = agg_loss(self.pg_losses(micro), response_mask, "token-mean")
                    loss = policy_loss / self.gradient_accumulation
                    loss.backward()
                self.actor_optimizer.step()
                self.actor_optimizer.zero_grad()
    """, {(17, "RLG006")}),
    "step_without_zero_in_trainer": ("""
        import torch

        class Trainer:
            def __init__(self, model):
                self.model = model
                self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def fit(self, loader):
                self.opt.zero_grad()
                for epoch in range(3):
                    for batch in loader:
                        loss = self.model(**batch).loss
                        loss.backward()
                        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                        self.opt.step()
    """, {(16, "RLG013")}),
    "ref_logps_with_grad_in_dpo": ("""
        class DPO:
            def concatenated_forward(self, model, batch):
                logits = model(batch["ids"]).logits
                return logits.log_softmax(-1).sum(-1)

            def get_batch_loss(self, batch):
                policy_chosen_logps = self.concatenated_forward(self.model, batch)
                reference_chosen_logps = self.concatenated_forward(self.ref_model, batch)
                return -(policy_chosen_logps - reference_chosen_logps).mean()
    """, {(9, "RLG003")}),
}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_trainer_has_no_finding(name):
    result = findings(CLEAN[name])
    assert not result.findings, [(f.line, f.code, f.message) for f in result.findings]


@pytest.mark.parametrize("name", sorted(BUGGY))
def test_buggy_trainer_is_flagged_where_expected(name):
    source, expected = BUGGY[name]
    assert flagged(source) == expected


def test_detach_fix_keeps_comments_and_clears_the_finding():
    source = """
        def collect(policy, critic, ids, obs, returns):
            old_logp = compute_logp(policy, ids)  # behaviour log-probs
            advantages = returns - critic(obs)
            return old_logp, advantages
    """
    result = findings(source, fix=True)
    assert result.fixed_source is not None
    assert "old_logp = compute_logp(policy, ids).detach()  # behaviour log-probs" in result.fixed_source
    assert "advantages = (returns - critic(obs)).detach()" in result.fixed_source
    assert not [f for f in lint_source(result.fixed_source, "t.py", rules=RULES, preview=True).findings]


def test_rules_never_raise_on_odd_code():
    source = """
        for (a, b) in zip(x, y):
            opt.step(*args)
            (lambda: loss)().backward()
            old_logp, *rest = policy(ids)
            self.x[0].backward()
        while True:
            scaler.step()
            break
    """
    findings(source)
