"""The shared half of every fine-tuning data module: splits, encoding, packing, loaders.

Subclasses only say where the conversations come from (`load_conversations`, or `load_pairs` for plain
question/answer pairs). Training batches carry the loss mask (and, packed, the per-sample positions);
validation batches carry prompts and targets for decoding, and the samples for the validation loss (see
`sft_batch`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader
from typing_extensions import override

from megatrain_lightning.data.chat import ChatEncoder, EncodedSample
from megatrain_lightning.data.packing import pack
from megatrain_lightning.data.records import Conversation
from megatrain_lightning.data.sft_batch import collate_eval, collate_packed, collate_train, pad_id
from megatrain_lightning.data.tokenizer import ByteTokenizer
from megatrain_lightning.errors import ConfigError

log = logging.getLogger(__name__)

# (where, conversation): `where` names the record in messages (`file:line`, or "" for generated data)
Located = tuple[str, Conversation]


def check_positive(**values: Any) -> None:
    """A ConfigError naming `data.<key>` for any value that is not a positive integer."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"data.{key}={value!r}: expected a positive integer (e.g. data.{key}=8)")


class QADataModule(pl.LightningDataModule):
    """Base for supervised fine-tuning on conversations (a question and its answer is the one-turn case).

    Args:
        tokenizer: anything with the HF `encode`/`decode` interface; None uses the byte tokenizer.
        batch_size: training micro-batch (rows); memory grows linearly with it.
        val_batch_size: rows per greedy-decoding batch in validation.
        max_length: longest training row in tokens; longer samples are cut (the answer, never the prompt
            of the first assistant turn: a sample whose prompt leaves no room is left out, with a warning).
        prompt_template: without a chat template, how a question becomes the prompt (`{query}` is replaced).
        use_chat_template: None: the tokenizer's chat template when it has one, else `prompt_template`;
            False: `prompt_template` always; True: the chat template (an error without one).
        packing: pack several samples into each row of `max_length` tokens (no attention across samples;
            see `packing.py`): far fewer padding tokens when lengths vary, at the memory of full rows.
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
        use_chat_template: bool | None = None,
        packing: bool = False,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_positive(batch_size=batch_size, val_batch_size=val_batch_size, max_length=max_length)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers!r}: expected 0 or a positive integer")
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.encoder = ChatEncoder(self.tokenizer, prompt_template, use_chat_template)
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.max_length = max_length
        self.prompt_template = prompt_template
        self.packing = packing
        self.num_workers = num_workers
        self.train_samples: list[EncodedSample] = []
        self.val_samples: list[EncodedSample] = []
        self.train_rows: list[list[EncodedSample]] = []  # packed rows, when packing

    def load_pairs(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(train, validation) lists of (question, answer) strings."""
        raise NotImplementedError

    def load_conversations(self) -> tuple[list[Located], list[Located]]:
        """(train, validation) lists of (where, conversation); by default the pairs of `load_pairs`."""
        def conv(pairs: list[tuple[str, str]]) -> list[Located]:
            return [("", [{"role": "user", "content": q}, {"role": "assistant", "content": a}]) for q, a in pairs]

        train, val = self.load_pairs()
        return conv(train), conv(val)

    def encode(self, convs: list[Located], split: str) -> list[EncodedSample]:
        """Encoded samples; those whose prompt leaves no room in `max_length` are left out, with a warning."""
        samples, dropped = [], []
        for where, c in convs:
            s = self.encoder.encode(c, self.max_length, where or f"{split} sample {len(samples) + len(dropped)}")
            (samples if s is not None else dropped).append(s if s is not None else where)
        if dropped:
            log.warning("%d of %d %s samples left out: their prompt leaves no answer token within data.max_length=%d "
                        "(first: %s)", len(dropped), len(convs), split, self.max_length, dropped[0] or "generated")
        if convs and not samples:
            raise ConfigError(f"no {split} sample fits data.max_length={self.max_length} (every prompt is longer): "
                              "raise data.max_length")
        return samples

    @override
    def setup(self, stage: str) -> None:
        if self.train_samples or self.val_samples:  # validate-then-fit calls setup twice; tokenise once
            return
        train, val = self.load_conversations()
        self.train_samples, self.val_samples = self.encode(train, "training"), self.encode(val, "validation")
        if self.packing:
            self.train_rows = [[self.train_samples[i] for i in row]
                               for row in pack([len(s) for s in self.train_samples], self.max_length)]
            real = sum(len(s) for s in self.train_samples)
            log.info("packed %d samples into %d rows of %d tokens (%.0f%% full)", len(self.train_samples),
                     len(self.train_rows), self.max_length, 100 * real / max(len(self.train_rows) * self.max_length, 1))
        rows = len(self.train_rows) if self.packing else len(self.train_samples)
        if rows < self.batch_size:
            raise ConfigError(f"data.batch_size={self.batch_size} is more than the {rows} training "
                              f"{'packed rows' if self.packing else 'samples'}: not one full batch; use a smaller "
                              "data.batch_size or more data")

    @override
    def train_dataloader(self) -> DataLoader:
        if self.packing:
            data: list[Any] = self.train_rows
            collate: Any = functools.partial(collate_packed, pad=pad_id(self.tokenizer))
        else:
            data, collate = self.train_samples, functools.partial(collate_train, pad=pad_id(self.tokenizer))
        return DataLoader(data, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          collate_fn=collate, num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if not self.val_samples:
            return []
        collate = functools.partial(collate_eval, pad=pad_id(self.tokenizer))
        return DataLoader(self.val_samples, batch_size=self.val_batch_size, shuffle=False,
                          collate_fn=collate, num_workers=self.num_workers)
