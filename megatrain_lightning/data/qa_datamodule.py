"""The shared half of every question → answer data module: splits, tokenising, loaders.

Subclasses only say where the pairs come from (`load_pairs`). Training batches carry the loss mask;
validation batches carry prompts and targets for exact-match decoding (see `sft_batch`).
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader
from typing_extensions import override

from megatrain_lightning.data.sft_batch import EncodedPair, collate_eval, collate_train, encode_pair, pad_id
from megatrain_lightning.data.tokenizer import ByteTokenizer


class QADataModule(pl.LightningDataModule):
    """Base for supervised fine-tuning on (question, answer) pairs.

    Args:
        tokenizer: anything with the HF `encode`/`decode` interface; None uses the byte tokenizer.
        batch_size: training micro-batch (rows); memory grows linearly with it.
        val_batch_size: rows per greedy-decoding batch in validation.
        max_length: longest training row in tokens; longer answers are truncated.
        prompt_template: how a question becomes the prompt (`{query}` is replaced).
        num_workers: DataLoader workers; 0 keeps tokenised data in the main process (fine: it is
            tokenised once, up front).
    """

    def __init__(
        self,
        tokenizer: Any | None = None,
        batch_size: int = 8,
        val_batch_size: int = 64,
        max_length: int = 512,
        prompt_template: str = "{query}",
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.max_length = max_length
        self.prompt_template = prompt_template
        self.num_workers = num_workers
        self.train_pairs: list[EncodedPair] = []
        self.val_pairs: list[EncodedPair] = []

    def load_pairs(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(train, validation) lists of (question, answer) strings."""
        raise NotImplementedError

    def encode(self, pairs: list[tuple[str, str]]) -> list[EncodedPair]:
        return [
            encode_pair(self.tokenizer, self.prompt_template.format(query=q), a, self.max_length)
            for q, a in pairs
        ]

    @override
    def setup(self, stage: str) -> None:
        if self.train_pairs or self.val_pairs:  # validate-then-fit calls setup twice; tokenise once
            return
        train, val = self.load_pairs()
        self.train_pairs, self.val_pairs = self.encode(train), self.encode(val)

    @override
    def train_dataloader(self) -> DataLoader:
        collate = functools.partial(collate_train, pad=pad_id(self.tokenizer))
        return DataLoader(
            self.train_pairs, batch_size=self.batch_size, shuffle=True, drop_last=True,
            collate_fn=collate, num_workers=self.num_workers,
        )

    @override
    def val_dataloader(self) -> DataLoader | list:
        if not self.val_pairs:
            return []
        collate = functools.partial(collate_eval, pad=pad_id(self.tokenizer))
        return DataLoader(
            self.val_pairs, batch_size=self.val_batch_size, shuffle=False,
            collate_fn=collate, num_workers=self.num_workers,
        )
