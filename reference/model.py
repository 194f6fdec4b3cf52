"""A tiny causal transformer language model, built in code (no downloads).

``model(ids)`` maps token ids [B, T] to next-token logits [B, T, V]: ``logits[:, t]`` predicts ``ids[:, t + 1]``.
Attention is causal, so right padding never changes the logits of earlier positions. ``attention_mask`` (a
[B, T] keep-mask, or a [B, T, T] bool mask of allowed query-key pairs, combined with the causal one) and
``position_ids`` [B, T] serve other layouts (left padding, rows packed into one sequence). ``dropout`` adds
dropout modules after attention and the MLP (none at 0, the default: the same modules and numbers as before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 64
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))
        # no module at all without dropout: a Dropout(p=0) in train mode would still be a module to keep in step
        self.attn_drop = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        self.mlp_drop = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()

    def forward(self, x: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if allowed is None:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        x = x + self.attn_drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp_drop(self.mlp(self.norm2(x)))


class TinyCausalLM(nn.Module):
    """Token and learned position embeddings, pre-norm blocks, a final norm and an untied output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        t = ids.shape[1]
        if position_ids is None:
            x = self.tok_emb(ids) + self.pos_emb(torch.arange(t, device=ids.device))[None]
        else:
            x = self.tok_emb(ids) + self.pos_emb(position_ids)
        allowed = None
        if attention_mask is not None:
            causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
            keys = attention_mask.bool()[:, None, :] if attention_mask.dim() == 2 else attention_mask.bool()
            allowed = causal & keys
            allowed = allowed | torch.eye(t, dtype=torch.bool, device=ids.device)  # a pad query attends to itself
        for block in self.blocks:
            x = block(x, allowed)
        return self.lm_head(self.norm(x))


def disable_dropout(model: nn.Module) -> nn.Module:
    """Every dropout module's p set to 0 (what TRL's ``disable_dropout`` does): the RL policy's forwards are
    deterministic in train mode too. Returns the model."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model


def build_model(cfg: ModelConfig, seed: int = 0) -> TinyCausalLM:
    """A freshly initialised model; the same seed gives bit-identical weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyCausalLM(cfg)
