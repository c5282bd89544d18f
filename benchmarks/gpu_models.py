"""The model of the GPU local-step and memory checks: a GPT-like decoder built in code from a config (plain torch;
``transformers`` is not needed), ~110M parameters at :data:`GPT_100M`."""

from __future__ import annotations

from typing import Any

import torch

GPT_100M = dict(vocab=16384, dim=768, layers=12, heads=12, seq=256, batch=16)  # 110M parameters
GPT_TINY = dict(vocab=256, dim=64, layers=2, heads=4, seq=32, batch=4)  # the CPU smoke version


class GPT(torch.nn.Module):
    """Token + position embeddings, pre-norm causal transformer blocks (torch's encoder layer), a linear head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int, **_: Any):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, dim)
        self.positions = torch.nn.Embedding(seq, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        x = self.tokens(idx) + self.positions(torch.arange(seq, device=idx.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=idx.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def make_gpt(config: dict[str, Any], device: str) -> GPT:
    torch.manual_seed(0)
    return GPT(**config).to(device)


def lm_batches(config: dict[str, Any], count: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` random (input, next-token target) batches on ``device``."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, config["vocab"], (config["batch"], config["seq"] + 1), generator=g)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
