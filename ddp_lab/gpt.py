"""The course's transformer: a small decoder-only GPT on byte-level tokens.

nanoGPT-sized code with one change of layout that the parallelism labs need: the attention's
query, key and value projections are three ``nn.Linear`` layers (nanoGPT fuses them into one
``c_attn``), so that tensor parallelism can split each of them by columns, a whole number of
heads per rank, and the forward pass reads the number of heads from the width it was given
(``q.shape[-1] // head_dim``). The attention is written out (scores, causal mask, softmax,
weighted sum) rather than ``scaled_dot_product_attention``: lab 5 looks at the scores where
fp16 overflows, and lab 7 counts the activations a block keeps for its backward pass. No
dropout (runs are bit-reproducible), no weight tying (the output head is its own layer).

Shapes: tokens ``(batch, seq)`` of ``int64`` in ``[0, vocab)`` give logits ``(batch, seq,
vocab)``; the loss of next-token prediction is the cross-entropy of ``logits[:, t]`` against
``tokens[:, t + 1]`` (``ddp_lab.text`` makes the pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """The transformer's size.

    Attributes:
        vocab: token ids ``0 .. vocab - 1`` (256: bytes).
        seq_len: the longest sequence (positions learned).
        width: the model (embedding) width, a multiple of ``heads``.
        heads: attention heads per block.
        layers: transformer blocks.
    """

    vocab: int = 256
    seq_len: int = 64
    width: int = 128
    heads: int = 4
    layers: int = 2

    def __post_init__(self) -> None:
        if min(self.vocab, self.seq_len, self.width, self.heads, self.layers) <= 0:
            raise ValueError(f"every size must be positive: {self}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.width // self.heads


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` sees positions ``0 .. t`` only."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.width, cfg.width)
        self.k = nn.Linear(cfg.width, cfg.width)
        self.v = nn.Linear(cfg.width, cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, h*d) -> (B, h, T, d)
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        weights = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(batch, seq, -1)
        return self.proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward: width -> 4 x width -> GELU -> width."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.proj = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm, a linear head.

    Args:
        cfg: the sizes (:class:`GPTConfig`).

    Attributes:
        checkpoint_blocks: when True, every block runs under activation checkpointing
            (``torch.utils.checkpoint.checkpoint``, non-reentrant): it keeps only its input
            for the backward pass and runs its forward again there. Same results, less
            memory, more time (lab 7 measures both).

    Example:
        >>> model = GPT(GPTConfig(seq_len=8, width=16, heads=2, layers=1))
        >>> model(torch.zeros(3, 8, dtype=torch.long)).shape
        torch.Size([3, 8, 256])
    """

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.checkpoint_blocks = False
        self.apply(_init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual outputs
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(f"sequence of {seq} tokens, longer than seq_len {self.cfg.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        return self.head(self.ln_f(x))


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
