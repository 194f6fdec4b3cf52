"""group_mean_batch (RLG009): the baseline is the whole batch's mean reward, not each group's (prompt's) own mean.

Easy prompts then get positive advantages for every sample and hard ones negative: the update learns which
prompts are easy instead of which answers are better.
"""


def group_advantages(rewards, group_size, eps=1e-4):
    advantages = rewards - rewards.mean()
    advantages = advantages / (rewards.std() + eps)
    return advantages
