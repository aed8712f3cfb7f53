"""The embedded default task: two-number addition, generated, so `python train.py` needs no files.

It has the shape of MetaMathQA fine-tuning (a question, an answer, the question masked out of the
loss) at a size a 2-core CPU learns in about a minute: every pair `a+b=` with operands up to
`max_operand`, a fixed seeded slice of them held out for exact-match validation. Held-out questions
are never trained on, so exact match measures arithmetic learned, not memorised.
"""

from __future__ import annotations

import random
from typing import Any

from typing_extensions import override

from megatrain_lightning.data.qa_datamodule import QADataModule
from megatrain_lightning.errors import ConfigError


class ArithmeticDataModule(QADataModule):
    """Addition questions `"a+b="` → answers `"c"`, tokenised with the model's tokenizer.

    Args:
        tokenizer: None uses the byte tokenizer (one token per character).
        max_operand: largest operand; the task has `(max_operand + 1) ** 2` questions. Larger is
            harder (more carries, longer answers) and needs a longer run.
        num_val: held-out questions for exact match; each costs one greedy decode per answer token.
        seed: which questions are held out (independent of the training seed).
        batch_size: training rows per step; rows are about 10 tokens.
        val_batch_size: rows per greedy-decoding batch.
        max_length: longest row in tokens (the task's rows are shorter).
        packing: several questions per row of `max_length` tokens (see `QADataModule`).
        num_workers: DataLoader workers; 0 is fastest for data this small.
    """

    def __init__(
        self,
        tokenizer: Any | None = None,
        max_operand: int = 99,
        num_val: int = 200,
        seed: int = 1234,
        batch_size: int = 64,
        val_batch_size: int = 200,
        max_length: int = 16,
        packing: bool = False,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            tokenizer=tokenizer, batch_size=batch_size, val_batch_size=val_batch_size, max_length=max_length,
            prompt_template="{query}", use_chat_template=False, packing=packing, num_workers=num_workers,
        )
        if isinstance(max_operand, bool) or not isinstance(max_operand, int) or max_operand < 1:
            raise ConfigError(f"data.max_operand={max_operand!r}: expected a positive integer (the task's questions are "
                              "a+b for a, b up to it), e.g. data.max_operand=99")
        n = (max_operand + 1) ** 2
        if not 0 < num_val < n:
            raise ConfigError(f"data.num_val={num_val} must be between 1 and {n - 1} for data.max_operand={max_operand}")
        self.max_operand = max_operand
        self.num_val = num_val
        self.seed = seed

    @override
    def load_pairs(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        pairs = [(f"{a}+{b}=", str(a + b)) for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)]
        random.Random(self.seed).shuffle(pairs)
        return pairs[self.num_val :], pairs[: self.num_val]
