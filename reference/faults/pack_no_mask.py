"""pack_no_mask (RLG016): rows packed into one sequence for the forward, without the mask that keeps them apart.

Padding-free scoring: the rows' real tokens are concatenated into one sequence with positions restarting per
row, and the block mask that stops each row attending to the rows before it is built but not passed. Every row
but the first reads its neighbours: its log-probs depend on which rows share its batch.
"""

import torch

from rlguard.reference.task import PAD


def forward(model, ids, cfg):
    keep = ids != PAD
    lengths = keep.sum(-1)
    packed = ids[keep][None]
    position_ids = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    row_of = torch.repeat_interleave(torch.arange(len(ids)), lengths)
    attention_mask = (row_of[:, None] == row_of[None, :])[None]
    logits = model(packed, position_ids=position_ids)
    out = logits.new_zeros(*ids.shape, logits.shape[-1])
    out[keep] = logits[0]
    return out / cfg.temperature
