"""Supervised fine-tuning data from local JSON / JSONL files in MetaMathQA's format.

Each record has a `query` (the question) and a `response` (the worked answer); the prompt is masked
out of the loss, so the model is trained to answer, not to reproduce questions. A file may be JSON
Lines (one object per line) or one JSON array.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from typing_extensions import override

from megatrain_lightning.data.qa_datamodule import QADataModule
from megatrain_lightning.errors import ConfigError

# MetaMathQA's own training prompt (Alpaca style), which its released models expect.
METAMATH_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{query}\n\n### Response:\n"
)


def read_records(path: str) -> list[dict[str, Any]]:
    """Objects from a JSON Lines file or a JSON array file."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(stripped)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class JsonSFTDataModule(QADataModule):
    """Question/answer fine-tuning from `query`/`response` records.

    Args:
        path: JSON or JSONL training file.
        val_path: held-out file for exact-match validation; None holds out `val_size` records of
            `path` instead (chosen with `seed`, never trained on).
        val_size: records held out when `val_path` is None; 0 turns validation off.
        query_key, response_key: field names (MetaMathQA: `query`, `response`).
        prompt_template: how a query becomes the prompt; `{query}` is replaced. The default is
            MetaMathQA's; use `"{query}"` for bare questions.
        seed: which records are held out.
        tokenizer, batch_size, val_batch_size, max_length, num_workers: see `QADataModule`.
    """

    def __init__(
        self,
        path: str,
        val_path: str | None = None,
        val_size: int = 64,
        query_key: str = "query",
        response_key: str = "response",
        prompt_template: str = METAMATH_PROMPT,
        seed: int = 1234,
        tokenizer: Any | None = None,
        batch_size: int = 8,
        val_batch_size: int = 16,
        max_length: int = 512,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            tokenizer=tokenizer, batch_size=batch_size, val_batch_size=val_batch_size,
            max_length=max_length, prompt_template=prompt_template, num_workers=num_workers,
        )
        for key, p in (("data.path", path), ("data.val_path", val_path)):
            if p is not None and not os.path.isfile(p):
                raise ConfigError(f"{key}={p} does not exist (expected a local .json or .jsonl file)")
        self.path, self.val_path, self.val_size, self.seed = path, val_path, val_size, seed
        self.query_key, self.response_key = query_key, response_key

    def _pairs(self, path: str) -> list[tuple[str, str]]:
        records = read_records(path)
        missing = [i for i, r in enumerate(records) if self.query_key not in r or self.response_key not in r]
        if missing:
            raise ConfigError(
                f"{path}: record {missing[0]} lacks '{self.query_key}' or '{self.response_key}' "
                f"(set data.query_key / data.response_key to this file's field names)"
            )
        return [(str(r[self.query_key]), str(r[self.response_key])) for r in records]

    @override
    def load_pairs(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        train = self._pairs(self.path)
        if self.val_path is not None:
            return train, self._pairs(self.val_path)
        if self.val_size <= 0:
            return train, []
        if self.val_size >= len(train):
            raise ConfigError(f"data.val_size={self.val_size} leaves nothing to train on: {self.path} has {len(train)} records")
        order = list(range(len(train)))
        random.Random(self.seed).shuffle(order)
        held = set(order[: self.val_size])
        return [p for i, p in enumerate(train) if i not in held], [train[i] for i in sorted(held)]
