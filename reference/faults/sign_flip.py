"""sign_flip (RLG005): advantages negated, so the update makes good episodes less likely and bad ones more."""


def group_advantages(rewards, group_size, eps=1e-4):
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    advantages = centred / (grouped.std(dim=-1, keepdim=True) + eps)
    advantages = -advantages
    return advantages.view(-1)
