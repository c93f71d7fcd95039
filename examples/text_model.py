"""The model of ``examples/text_classifier.py``: word embeddings -> LSTM (or their mean) -> a
linear layer, in the pieces towers and stages need.
"""

from __future__ import annotations

import torch
from torch import nn


class Encoder(nn.Module):
    """Embedded words ``[B, T, dim]`` and their counts ``[B]`` to one vector per document."""

    def __init__(self, dim: int, hidden: int, *, kind: str, pool: str):
        super().__init__()
        self.pool = pool
        self.lstm = nn.LSTM(dim, hidden, batch_first=True) if kind == "lstm" else None
        self.size = dim if self.lstm is None else hidden

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        lengths = lengths.to(x.device)
        mask = (torch.arange(x.shape[1], device=x.device) < lengths.unsqueeze(1)).unsqueeze(2)
        if self.lstm is None:  # a bag of words: the mean of the embeddings
            return (x * mask).sum(1) / lengths.unsqueeze(1)
        # Over the padded batch: packing skips the padding, but costs far more on a CPU than
        # the steps it saves. The padding comes after each document's words, so the output at
        # its last word is the one a document of its own would end with.
        out, _ = self.lstm(x)
        if self.pool == "last":
            return out[torch.arange(len(x), device=x.device), lengths - 1]
        return (out * mask).sum(1) / lengths.unsqueeze(1)


class Dense(nn.Module):
    """The layers after the embedding (what towers replicate): the encoder, then a classifier."""

    def __init__(self, encoder: Encoder, classes: int):
        super().__init__()
        self.encoder, self.classifier = encoder, nn.Linear(encoder.size, classes)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x, lengths))


class Embedded(nn.Module):
    """``rest(embedding(ids), lengths)``: the whole model, or with the encoder the first stage."""

    def __init__(self, embedding: nn.Module, rest: nn.Module):
        super().__init__()
        self.embedding, self.rest = embedding, rest

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.rest(self.embedding(ids), lengths)
