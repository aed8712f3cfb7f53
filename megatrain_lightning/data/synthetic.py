"""Random tokens of one fixed length: throughput runs that need no data and have no padding."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override


class _RandomTokens(Dataset):
    """`num_samples` rows of `seq_len` uniform token ids, generated per index (no storage)."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=g)
        return {"input_ids": ids, "labels": ids}


class SyntheticDataModule(pl.LightningDataModule):
    """Fixed-length random token rows, every token a real one (no padding, every label counted).

    The loss is meaningless; the point is a step whose cost is exactly `batch_size * seq_len`
    tokens, for tokens/s and TFLOPS that compare across strategies and models. No validation.

    Random tokens teach nothing, so `train.py` keeps no checkpoint and no Hugging Face export of a run on
    them (`saves_model`): a throughput run of a 7B model would otherwise write 120 GB of training state.

    Args:
        seq_len: tokens per row (the T of the FLOPs formula).
        batch_size: rows per step.
        vocab_size: ids are drawn from `[0, vocab_size)`; None uses the tokenizer's size (any id
            below the model's vocabulary costs the same).
        num_samples: rows per epoch.
        seed: the token stream.
        tokenizer: only consulted for its size when `vocab_size` is None.
    """

    saves_model = False  # read by train(): nothing worth keeping is learnt from random tokens

    def __init__(
        self,
        seq_len: int = 2048,
        batch_size: int = 4,
        vocab_size: int | None = None,
        num_samples: int = 100_000,
        seed: int = 0,
        tokenizer: object | None = None,
    ) -> None:
        super().__init__()
        if vocab_size is None:
            vocab_size = len(tokenizer) if tokenizer is not None else 256
        self.dataset = _RandomTokens(num_samples, seq_len, vocab_size, seed)
        self.batch_size = batch_size

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, drop_last=True)
