"""A GPT decoder, written so that it can be cut into pipeline stages.

The network is a sequence of layers: token+position embedding, ``n_layer`` pre-LayerNorm blocks,
final LayerNorm + head. :class:`GPTStage` holds a consecutive slice of it: the first stage owns the
embedding, the last the head (and computes the loss), every stage some blocks. Composing the stages
in order is the full model, exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int | None = None
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False
    init_std: float = 0.02

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)), p, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ff, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.dropout(self.wte(idx) + self.wpe(pos))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def init_weights(module: nn.Module, cfg: GPTConfig) -> None:
    """Small-std normal init (GPT-2): N(0, init_std) for linear and embedding weights, residual
    output projections scaled by 1/sqrt(2 n_layer), zero biases, unit LayerNorms."""
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            nn.init.zeros_(p)
        elif p.dim() == 1:  # LayerNorm weight
            nn.init.ones_(p)
        elif name.endswith("proj.weight"):
            nn.init.normal_(p, 0.0, cfg.init_std / math.sqrt(2 * cfg.n_layer))
        else:
            nn.init.normal_(p, 0.0, cfg.init_std)


class GPTStage(nn.Module):
    """Blocks ``[first_block, last_block)`` of the model, with the embedding if ``first`` and the
    head if ``last``. ``forward`` maps token ids (first stage) or hidden states to hidden states, or
    to logits on the last stage."""

    def __init__(self, cfg: GPTConfig, first_block: int, last_block: int, first: bool, last: bool):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        self.block_range = (first_block, last_block)
        self.embed = Embedding(cfg) if first else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(first_block, last_block))
        self.head = Head(cfg) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


def build_full_model(cfg: GPTConfig, seed: int) -> GPTStage:
    """The whole model as one stage, initialised from ``seed``."""
    return build_stages(cfg, [(0, cfg.n_layer)], seed)[0]


def build_stages(cfg: GPTConfig, bounds: list[tuple[int, int]], seed: int) -> list[GPTStage]:
    """Stages for the given block ranges. Initialisation does not depend on the cut: each layer's
    weights come from a generator seeded by (seed, layer index), so every partition of the same
    model starts from the same weights. With tied embeddings the head's weight starts as a copy of
    the token embedding (the same tensor when one stage holds both)."""
    stages = [GPTStage(cfg, a, b, i == 0, i == len(bounds) - 1) for i, (a, b) in enumerate(bounds)]
    for st in stages:
        _init_stage(st, cfg, seed)
    if cfg.tie_embeddings:
        first, last = stages[0], stages[-1]
        if first is last:
            last.head.lm_head.weight = first.embed.wte.weight
        else:
            with torch.no_grad():
                last.head.lm_head.weight.copy_(first.embed.wte.weight)
    return stages


def _init_stage(st: GPTStage, cfg: GPTConfig, seed: int) -> None:
    def init_from(mod: nn.Module, layer: int) -> None:
        g = torch.random.fork_rng(devices=[])
        with g:  # the CPU's generator, where the stages are built (torch.manual_seed would also queue
            # a seed for each accelerator, recording the call's stack each time: 2/3 of a tiny build)
            torch.default_generator.manual_seed(seed * 1000003 + layer)
            init_weights(mod, cfg)

    if st.embed is not None:
        init_from(st.embed, 0)
    for i, block in enumerate(st.blocks):
        init_from(block, 1 + st.block_range[0] + i)
    if st.head is not None:
        init_from(st.head, cfg.n_layer + 1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
