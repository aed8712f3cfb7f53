"""Turning encoded samples into training and evaluation batches.

Training rows are one sample each, right-padded, with everything but the assistant tokens masked out of
the loss (label -100): the model learns to answer, not to repeat questions. Packed training rows hold
several samples each (``packing.py``): ``position_ids`` restart at 0 for every sample, and the model's
attention is confined to each sample by them (see ``collate_packed``). Evaluation rows keep the prompt
alone, left-padded so that every row's next token sits in the last column and greedy decoding can run on
the whole batch at once; the target is the answer with its ``<eos>`` (or end-of-turn token), so that
decoding knows where to stop. They also carry the whole sample as a training row, for the validation loss.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain_lightning.data.chat import IGNORE_INDEX, EncodedSample

__all__ = ["IGNORE_INDEX", "EncodedSample", "collate_eval", "collate_packed", "collate_train", "encode_pair", "pad_id"]


def encode_pair(tokenizer: Any, prompt: str, answer: str, max_length: int) -> EncodedSample:
    """One question/answer pair, ``<bos>`` (if any) + prompt + answer + ``<eos>``, at most ``max_length``
    tokens for training (the answer is cut, the prompt never; the eval answer stays whole).

    A prompt that leaves no room for one answer token in ``max_length`` raises ValueError.
    """
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    prompt_ids = bos + list(tokenizer.encode(prompt, add_special_tokens=False))
    answer_ids = list(tokenizer.encode(answer, add_special_tokens=False)) + [tokenizer.eos_token_id]
    room = max_length - len(prompt_ids)
    if room < 1:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_length={max_length}")
    kept = answer_ids[:room]
    return EncodedSample(prompt_ids + kept, [IGNORE_INDEX] * len(prompt_ids) + kept, prompt_ids, answer_ids)


def pad_id(tokenizer: Any) -> int:
    """The padding id: the tokenizer's own, else `<eos>` (many causal-LM tokenizers define no pad)."""
    pid = getattr(tokenizer, "pad_token_id", None)
    return tokenizer.eos_token_id if pid is None else pid


def collate_train(samples: list[EncodedSample], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` ([batch, longest row])."""
    width = max(len(s) for s in samples)
    input_ids = torch.full((len(samples), width), pad, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        input_ids[i, : len(s)] = torch.tensor(s.ids)
        labels[i, : len(s)] = torch.tensor(s.labels)
        attention_mask[i, : len(s)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def collate_packed(rows: list[list[EncodedSample]], pad: int) -> dict[str, torch.Tensor]:
    """Packed rows ([batch, longest row]): `input_ids`, `labels`, `position_ids` and `attention_mask`.

    `position_ids` count from 0 in every sample (and in the padding at a row's end); Hugging Face models
    confine attention to each such run (transformers builds a block-diagonal causal mask from them when no
    attention mask is passed: 4-D for SDPA and eager, varlen for flash-attention). The first label of each
    sample is -100, so that no sample is asked to predict the next one's first token. `attention_mask` marks
    the real tokens (for counting them: the model is not given it).
    """
    width = max(sum(len(s) for s in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        pos = 0
        for s in row:
            n = len(s)
            input_ids[i, pos : pos + n] = torch.tensor(s.ids)
            labels[i, pos : pos + n] = torch.tensor(s.labels)
            labels[i, pos] = IGNORE_INDEX
            position_ids[i, pos : pos + n] = torch.arange(n)
            pos += n
        attention_mask[i, :pos] = 1
        position_ids[i, pos:] = torch.arange(width - pos)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "attention_mask": attention_mask}


def collate_eval(samples: list[EncodedSample], pad: int) -> dict[str, torch.Tensor]:
    """Left-padded `prompt_ids` / `prompt_mask`, right-padded `target_ids` (-100 past the end), and the
    samples as training rows (`input_ids`, `attention_mask`, `labels`) for the validation loss."""
    pw = max(len(s.prompt) for s in samples)
    tw = max(len(s.answer) for s in samples)
    prompt_ids = torch.full((len(samples), pw), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(samples), pw), dtype=torch.long)
    target_ids = torch.full((len(samples), tw), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(samples):
        prompt_ids[i, pw - len(s.prompt) :] = torch.tensor(s.prompt)
        prompt_mask[i, pw - len(s.prompt) :] = 1
        target_ids[i, : len(s.answer)] = torch.tensor(s.answer)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "target_ids": target_ids, **collate_train(samples, pad)}
