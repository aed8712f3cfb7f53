"""Supervised fine-tuning data from local JSON / JSONL files: MetaMathQA, Alpaca, OpenAI messages, ShareGPT.

A file may be JSON Lines (one object per line) or one JSON array; its format is found from its first
record (``records.py`` lists them) or set with ``format``. Every record becomes a conversation, rendered
with the tokenizer's chat template when it has one, else with ``prompt_template`` (MetaMathQA's own
Alpaca-style prompt by default), and only the assistant's tokens are in the loss (``chat.py``).
"""

from __future__ import annotations

import os
import random

from typing_extensions import override

from megatrain_lightning.data.qa_datamodule import Located, QADataModule
from megatrain_lightning.data.records import load_conversations
from megatrain_lightning.errors import ConfigError

# MetaMathQA's own training prompt (Alpaca style), which its released models expect.
METAMATH_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{query}\n\n### Response:\n"
)


class JsonSFTDataModule(QADataModule):
    """Fine-tuning on a local JSON/JSONL file of question/answer records or conversations.

    Args:
        path: JSON or JSONL training file.
        val_path: held-out file for validation (loss and exact match); None holds out `val_size` records of
            `path` instead (chosen with `seed`, never trained on).
        val_size: records held out when `val_path` is None; 0 turns validation off.
        format: `auto` (by the first record's keys), `metamath`, `alpaca`, `messages` or `sharegpt`.
        query_key, response_key: field names of the `metamath` format (MetaMathQA: `query`, `response`).
        prompt_template: without a chat template, how a question becomes the prompt; `{query}` is replaced.
            The default is MetaMathQA's; use `"{query}"` for bare questions.
        use_chat_template: None: the tokenizer's chat template when it has one; False: `prompt_template`.
        packing: several samples per row of `max_length` tokens, no attention across them.
        seed: which records are held out.
        tokenizer, batch_size, val_batch_size, max_length, num_workers: see `QADataModule`.
    """

    def __init__(
        self,
        path: str,
        val_path: str | None = None,
        val_size: int = 64,
        format: str = "auto",
        query_key: str = "query",
        response_key: str = "response",
        prompt_template: str = METAMATH_PROMPT,
        use_chat_template: bool | None = None,
        packing: bool = False,
        seed: int = 1234,
        tokenizer: object | None = None,
        batch_size: int = 8,
        val_batch_size: int = 16,
        max_length: int = 512,
        num_workers: int = 0,
    ) -> None:
        path, val_path = (os.path.expanduser(p) if isinstance(p, str) else p for p in (path, val_path))  # '~/data.jsonl'
        for key, p in (("data.path", path), ("data.val_path", val_path)):
            if p is not None and not os.path.isfile(p):
                what = "is a directory, not a file" if os.path.isdir(p) else "does not exist"
                raise ConfigError(f"{key}={p} {what} (expected a local .json or .jsonl file)")
        if isinstance(val_size, bool) or not isinstance(val_size, int) or val_size < 0:
            raise ConfigError(f"data.val_size={val_size!r}: expected 0 (no validation) or a positive integer")
        super().__init__(
            tokenizer=tokenizer, batch_size=batch_size, val_batch_size=val_batch_size, max_length=max_length,
            prompt_template=prompt_template, use_chat_template=use_chat_template, packing=packing,
            num_workers=num_workers,
        )
        self.path, self.val_path, self.val_size, self.seed = path, val_path, val_size, seed
        self.format, self.query_key, self.response_key = format, query_key, response_key

    def _read(self, path: str) -> list[Located]:
        return load_conversations(path, self.format, self.query_key, self.response_key)

    @override
    def load_conversations(self) -> tuple[list[Located], list[Located]]:
        train = self._read(self.path)
        if self.val_path is not None:
            return train, self._read(self.val_path)
        if self.val_size == 0:
            return train, []
        if self.val_size >= len(train):
            raise ConfigError(f"data.val_size={self.val_size} leaves nothing to train on: {self.path} has {len(train)} "
                              "records (use a smaller data.val_size, or data.val_path)")
        order = list(range(len(train)))
        random.Random(self.seed).shuffle(order)
        held = set(order[: self.val_size])
        return [p for i, p in enumerate(train) if i not in held], [train[i] for i in sorted(held)]
