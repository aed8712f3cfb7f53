"""Local text files packed into fixed-length rows: continued pre-training without padding.

Documents are tokenised, joined with `<eos>` between them and cut into rows of exactly `seq_len`
tokens, so every token counts (no padding) and a document may span two rows, which is the usual
trade: no wasted compute, a little attention across document boundaries.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from megatrain_lightning.data.tokenizer import ByteTokenizer
from megatrain_lightning.errors import ConfigError

log = logging.getLogger(__name__)


def text_files(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """The files `path` names: one file, every file under a directory with a matching suffix, or a glob."""
    path = os.path.expanduser(path)  # '~/corpus'
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return sorted(
            os.path.join(root, f) for root, _, files in os.walk(path) for f in files if f.endswith(suffixes)
        )
    return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))


class PackedTextDataModule(pl.LightningDataModule):
    """Language modelling on local text, packed into `[num_rows, seq_len]` token rows.

    Args:
        path: a text file, a directory (searched recursively for `suffixes`), or a glob.
        seq_len: tokens per row.
        batch_size: rows per step.
        suffixes: file endings taken from a directory.
        tokenizer: None uses the byte tokenizer.
    """

    def __init__(
        self,
        path: str,
        seq_len: int = 512,
        batch_size: int = 8,
        suffixes: tuple[str, ...] = (".txt", ".md"),
        tokenizer: Any | None = None,
    ) -> None:
        super().__init__()
        suffixes = (suffixes,) if isinstance(suffixes, str) else tuple(suffixes)  # data.suffixes=.txt: one ending
        self.files = text_files(path, suffixes)
        if not self.files:
            raise ConfigError(f"data.path={path} does not exist or holds no {'/'.join(suffixes)} files")
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
        self.rows: torch.Tensor | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.rows is not None:
            return
        stream: list[int] = []
        not_utf8: list[str] = []  # file:line of each file's first byte that is not UTF-8
        for f in self.files:
            raw = Path(f).read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                line = raw.count(b"\n", 0, err.start) + 1
                not_utf8.append(f"{f}:{line}")
                text = raw.decode("utf-8", errors="replace")
            text = text.replace("\r\n", "\n").replace("\r", "\n")  # as open() in text mode reads it
            stream.extend(self.tokenizer.encode(text, add_special_tokens=False))
            stream.append(self.tokenizer.eos_token_id)
        if not_utf8:
            log.warning("%d of %d files under data.path are not UTF-8 (first: %s): their undecodable bytes are read "
                        "as U+FFFD; save them as UTF-8 to train on their text", len(not_utf8), len(self.files),
                        not_utf8[0])
        n = len(stream) // self.seq_len
        if n < self.batch_size:  # the loader drops a last partial batch: fewer rows would train no step at all
            raise ConfigError(
                f"data.path={self.path}: {len(stream):,} tokens in all make {n} rows of data.seq_len={self.seq_len}, "
                f"fewer than one batch of data.batch_size={self.batch_size}: give more text, or lower data.seq_len "
                "or data.batch_size"
            )
        self.rows = torch.tensor(stream[: n * self.seq_len]).view(n, self.seq_len)  # [rows, seq_len]

    @override
    def train_dataloader(self) -> DataLoader:
        assert self.rows is not None
        return DataLoader(self.rows, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=_lm_batch)


def _lm_batch(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.stack(rows)  # [batch, seq_len]; the model shifts labels itself
    return {"input_ids": ids, "labels": ids}
