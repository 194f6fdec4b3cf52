"""OpenRLHF-style actor: the action mask is cut from the attention mask one token too early (RLG001; the
log-probs of the last ``num_actions`` tokens match ``attention_mask[:, -num_actions:]``), and the old
log-probs are recomputed from the current weights inside the training loop (RLG002)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def masked_mean(tensor, mask):
    return (tensor * mask).sum() / mask.sum()


class Actor(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, sequences, num_actions, attention_mask):
        logits = self.model(sequences, attention_mask=attention_mask).logits
        log_probs = F.log_softmax(logits[:, :-1, :], dim=-1)
        log_probs = log_probs.gather(-1, sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
        return log_probs[:, -num_actions:]


def response_action_mask(attention_mask, num_actions):
    action_mask = attention_mask[:, -num_actions - 1:-1]  # expect: RLG001
    return action_mask


def ppo_train(actor, actor_optim, dataloader, max_epochs=2, clip_eps=0.2):
    for epoch in range(max_epochs):
        for experience in dataloader:
            num_actions = experience.num_actions
            action_mask = response_action_mask(experience.attention_mask, num_actions)
            with torch.no_grad():
                old_log_probs = actor(experience.sequences, num_actions, experience.attention_mask)  # expect: RLG002
            log_probs = actor(experience.sequences, num_actions, experience.attention_mask)
            ratio = (log_probs - old_log_probs).exp()
            surr1 = ratio * experience.advantages
            surr2 = ratio.clamp(1 - clip_eps, 1 + clip_eps) * experience.advantages
            loss = masked_mean(-torch.min(surr1, surr2), action_mask)
            actor_optim.zero_grad()
            loss.backward()
            actor_optim.step()
