"""CleanRL-style PPO (Atari) whose old log-probs are recomputed from the current weights in every minibatch
(RLG002), with autograd on (RLG003); the rollout's stored ``b_logprobs`` go unused."""

import numpy as np
import torch
import torch.nn as nn


def ppo_update(agent, optimizer, args, b_obs, b_logprobs, b_actions, b_advantages, b_returns):
    b_inds = np.arange(args.batch_size)
    for epoch in range(args.update_epochs):
        np.random.shuffle(b_inds)
        for start in range(0, args.batch_size, args.minibatch_size):
            end = start + args.minibatch_size
            mb_inds = b_inds[start:end]

            _, oldlogprob, _, _ = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])  # expect: RLG002, RLG003
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
            logratio = newlogprob - oldlogprob
            ratio = logratio.exp()

            mb_advantages = b_advantages[mb_inds]
            if args.norm_adv:
                mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

            pg_loss1 = -mb_advantages * ratio
            pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()
            v_loss = 0.5 * ((newvalue.view(-1) - b_returns[mb_inds]) ** 2).mean()
            entropy_loss = entropy.mean()
            loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
