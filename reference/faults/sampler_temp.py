"""sampler_temp (RLG007): the sampler runs at its own temperature, while the trainer divides logits by ``cfg.temperature``.

The sampler's log-probs (the update's old log-probs) come from another distribution than the trainer's, so
the ratio is not 1 before the first step and rare tokens look over-sampled.
"""

from rlguard.reference.sampling import collate, sample_episodes

SAMPLER_TEMPERATURE = 0.7


def rollout(model, tasks, cfg, generator):
    episodes = sample_episodes(model, tasks, cfg.spec, cfg.group_size, temperature=SAMPLER_TEMPERATURE,
                               generator=generator, reward=cfg.reward)
    return collate(episodes, cfg.group_size)
