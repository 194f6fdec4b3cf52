"""trains_frozen (RLG014): "make sure everything trains": the frozen position embedding ends up in the optimizer."""

import torch


def make_optimizer(model, cfg):
    model.requires_grad_(True)
    return torch.optim.Adam(model.parameters(), lr=cfg.lr)
