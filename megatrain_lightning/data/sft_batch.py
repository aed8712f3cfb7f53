"""Turning (question, answer) pairs into training and evaluation batches.

Training rows are `prompt + answer + <eos>`, right-padded, with the prompt and the padding masked out
of the loss (label -100): the model learns to answer, not to repeat questions. Evaluation rows keep
the prompt alone, left-padded so that every row's next token sits in the last column and greedy
decoding can run on the whole batch at once; the target is the answer plus `<eos>`, so an exact match
also requires the model to stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100  # the label value torch's cross-entropy skips


@dataclass(frozen=True)
class EncodedPair:
    """One example as token ids: `answer` ends with `<eos>`."""

    prompt: list[int]
    answer: list[int]


def encode_pair(tokenizer: Any, prompt: str, answer: str, max_length: int) -> EncodedPair:
    """Token ids of one pair, truncated to `max_length` (the answer is cut first, the prompt never).

    A prompt longer than `max_length` leaves no room to learn anything, so it raises ValueError.
    """
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    prompt_ids = bos + list(tokenizer.encode(prompt, add_special_tokens=False))
    answer_ids = list(tokenizer.encode(answer, add_special_tokens=False)) + [tokenizer.eos_token_id]
    room = max_length - len(prompt_ids)
    if room < 1:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_length={max_length}")
    return EncodedPair(prompt_ids, answer_ids[:room])


def pad_id(tokenizer: Any) -> int:
    """The padding id: the tokenizer's own, else `<eos>` (many causal-LM tokenizers define no pad)."""
    pid = getattr(tokenizer, "pad_token_id", None)
    return tokenizer.eos_token_id if pid is None else pid


def collate_train(pairs: list[EncodedPair], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` ([batch, longest row])."""
    rows = [p.prompt + p.answer for p in pairs]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, row) in enumerate(zip(pairs, rows)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(p.prompt) : len(row)] = torch.tensor(p.answer)
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def collate_eval(pairs: list[EncodedPair], pad: int) -> dict[str, torch.Tensor]:
    """Left-padded `prompt_ids` / `prompt_mask` and right-padded `target_ids` (-100 past the end)."""
    pw = max(len(p.prompt) for p in pairs)
    tw = max(len(p.answer) for p in pairs)
    prompt_ids = torch.full((len(pairs), pw), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(pairs), pw), dtype=torch.long)
    target_ids = torch.full((len(pairs), tw), IGNORE_INDEX, dtype=torch.long)
    for i, p in enumerate(pairs):
        prompt_ids[i, pw - len(p.prompt) :] = torch.tensor(p.prompt)
        prompt_mask[i, pw - len(p.prompt) :] = 1
        target_ids[i, : len(p.answer)] = torch.tensor(p.answer)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "target_ids": target_ids}
