"""Data modules: what the loss sees (masks), what validation sees (prompts, targets), no leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatrain_lightning.data import (
    ArithmeticDataModule,
    ByteTokenizer,
    JsonSFTDataModule,
    PackedTextDataModule,
    SyntheticDataModule,
)
from megatrain_lightning.data.sft_batch import IGNORE_INDEX, collate_eval, collate_train, encode_pair
from megatrain_lightning.errors import ConfigError


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer()
    text = "12+7=19 ∑ é"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("a", add_special_tokens=True) == [tok.bos_token_id, 97]
    assert tok.decode([97, tok.eos_token_id, tok.pad_token_id]) == "a"
    assert len(tok) == 259


def test_training_rows_mask_prompt_and_padding_out_of_the_loss() -> None:
    tok = ByteTokenizer()
    pairs = [encode_pair(tok, "1+1=", "2", 16), encode_pair(tok, "10+10=", "20", 16)]
    batch = collate_train(pairs, pad=tok.pad_token_id)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == mask.shape == (2, 1 + 6 + 2 + 1)
    # Row 0: <bos> 1 + 1 = | 2 <eos> | pad...: only the answer and <eos> are labelled.
    assert tok.decode(labels[0][labels[0] != IGNORE_INDEX].tolist()) == "2"
    assert labels[0][labels[0] != IGNORE_INDEX].tolist() == [ord("2"), tok.eos_token_id]
    assert labels[1][labels[1] != IGNORE_INDEX].tolist() == [ord("2"), ord("0"), tok.eos_token_id]
    assert int(mask[0].sum()) == 1 + 4 + 1 + 1 and bool((ids[0][mask[0] == 0] == tok.pad_token_id).all())
    assert bool((labels[mask == 0] == IGNORE_INDEX).all())


def test_eval_rows_are_left_padded_prompts_with_eos_terminated_targets() -> None:
    tok = ByteTokenizer()
    batch = collate_eval([encode_pair(tok, "1+1=", "2", 16), encode_pair(tok, "10+10=", "20", 16)], pad=tok.pad_token_id)
    assert batch["prompt_ids"][:, -1].tolist() == [ord("="), ord("=")]  # next token in the last column
    assert batch["prompt_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert batch["target_ids"].tolist() == [[ord("2"), tok.eos_token_id, IGNORE_INDEX], [ord("2"), ord("0"), tok.eos_token_id]]


def test_long_answers_are_truncated_but_prompts_never() -> None:
    tok = ByteTokenizer()
    assert len(encode_pair(tok, "q", "a" * 100, 10).answer) == 10 - 2
    with pytest.raises(ValueError, match="does not fit"):
        encode_pair(tok, "q" * 20, "a", 10)


def test_arithmetic_holds_out_questions_it_never_trains_on() -> None:
    dm = ArithmeticDataModule(max_operand=20, num_val=50, batch_size=8)
    train, val = dm.load_pairs()
    assert len(val) == 50 and len(train) + len(val) == 21 * 21
    assert not {q for q, _ in train} & {q for q, _ in val}
    assert all(int(a) == sum(int(x) for x in q[:-1].split("+")) for q, a in train + val)
    assert dm.load_pairs() == (train, val)  # the split depends on the data seed only
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8 and len(next(iter(dm.val_dataloader()))["prompt_ids"]) == 50


def test_jsonl_and_json_array_in_metamathqa_format(tmp_path: Path) -> None:
    records = [{"query": f"What is {i} plus {i}?", "response": f"It is {2 * i}. The answer is: {2 * i}", "type": "x"} for i in range(20)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "b.json").write_text(json.dumps(records))
    for name in ("a.jsonl", "b.json"):
        dm = JsonSFTDataModule(path=str(tmp_path / name), val_size=5, batch_size=4, max_length=512)
        dm.setup("fit")
        assert len(dm.train_pairs) == 15 and len(dm.val_pairs) == 5
        batch = next(iter(dm.train_dataloader()))
        row, labels = batch["input_ids"][0], batch["labels"][0]
        text = dm.tokenizer.decode(row.tolist())
        assert text.startswith("Below is an instruction") and "### Response:\n" in text
        answer = dm.tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())
        assert answer.startswith("It is ") and "The answer is:" in answer and "What is" not in answer


def test_jsonl_errors_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.path=.*does not exist"):
        JsonSFTDataModule(path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    dm = JsonSFTDataModule(path=str(tmp_path / "bad.jsonl"), val_size=0)
    with pytest.raises(ConfigError, match="data.query_key"):
        dm.setup("fit")


def test_synthetic_rows_are_fixed_length_and_unpadded() -> None:
    dm = SyntheticDataModule(seq_len=32, batch_size=3, vocab_size=100, num_samples=9)
    batches = list(dm.train_dataloader())
    assert len(batches) == 3
    assert batches[0]["input_ids"].shape == (3, 32) and "attention_mask" not in batches[0]
    assert int(batches[0]["input_ids"].max()) < 100
    assert torch.equal(next(iter(dm.train_dataloader()))["input_ids"], batches[0]["input_ids"])  # reproducible


def test_text_files_are_packed_into_full_rows(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world " * 10)
    (tmp_path / "docs" / "b.md").write_text("second document " * 10)
    (tmp_path / "docs" / "skip.bin").write_text("not text")
    dm = PackedTextDataModule(path=str(tmp_path / "docs"), seq_len=16, batch_size=2)
    assert [Path(f).name for f in dm.files] == ["a.txt", "b.md"]
    dm.setup("fit")
    total = len("hello world " * 10) + len("second document " * 10) + 2  # + one <eos> per document
    assert dm.rows.shape == (total // 16, 16)
    assert int((dm.rows == ByteTokenizer.eos_token_id).sum()) >= 1
    batch = next(iter(dm.train_dataloader()))
    assert torch.equal(batch["input_ids"], batch["labels"]) and batch["input_ids"].shape == (2, 16)
    with pytest.raises(ConfigError, match="does not exist"):
        PackedTextDataModule(path=str(tmp_path / "nowhere"))
