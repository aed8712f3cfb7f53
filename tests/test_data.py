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
    sample = encode_pair(tok, "q", "a" * 100, 10)
    assert len(sample.ids) == len(sample.labels) == 10 and sample.labels[2:] == [ord("a")] * 8  # cut to 10 for training
    assert len(sample.answer) == 101  # the reference of exact match stays whole
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
        assert len(dm.train_samples) == 15 and len(dm.val_samples) == 5
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
    # data.suffixes=.txt from the command line is a string: one ending (it was read as ".", "t", "x", "t")
    assert [Path(f).name for f in PackedTextDataModule(path=str(tmp_path / "docs"), suffixes=".txt").files] == ["a.txt"]
    dm.setup("fit")
    total = len("hello world " * 10) + len("second document " * 10) + 2  # + one <eos> per document
    assert dm.rows.shape == (total // 16, 16)
    assert int((dm.rows == ByteTokenizer.eos_token_id).sum()) >= 1
    batch = next(iter(dm.train_dataloader()))
    assert torch.equal(batch["input_ids"], batch["labels"]) and batch["input_ids"].shape == (2, 16)
    with pytest.raises(ConfigError, match="does not exist"):
        PackedTextDataModule(path=str(tmp_path / "nowhere"))
    # fewer rows than one batch: the loader dropped the partial batch and fit "succeeded" with no step (found by
    # a sweep of bad input, 2026-12-05)
    dm = PackedTextDataModule(path=str(tmp_path / "docs"), seq_len=16, batch_size=total // 16 + 1)
    with pytest.raises(ConfigError, match=rf"docs: {total} tokens in all make {total // 16} rows of data.seq_len=16, "
                                          rf"fewer than one batch of data.batch_size={total // 16 + 1}: give more text"):
        dm.setup("fit")


def test_text_files_that_are_not_utf8_are_read_with_one_warning_naming_the_first(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A corpus file with bytes that are not UTF-8 is read with U+FFFD in their place, as before, but said (it was
    silent), naming the file and line; line endings read as open() in text mode reads them."""
    (tmp_path / "a.txt").write_bytes(b"line one\r\nline two\r\ncaf\xe9 au lait\n" * 4)
    (tmp_path / "b.txt").write_text("all good here " * 8)
    dm = PackedTextDataModule(path=str(tmp_path), seq_len=8, batch_size=1)
    with caplog.at_level("WARNING", logger="megatrain_lightning.data.text"):
        dm.setup("fit")
    assert [r.getMessage() for r in caplog.records] == [
        f"1 of 2 files under data.path are not UTF-8 (first: {tmp_path / 'a.txt'}:3): their undecodable bytes are "
        "read as U+FFFD; save them as UTF-8 to train on their text"]
    text = bytes(t for t in dm.rows.flatten().tolist() if t < 256).decode("utf-8")
    assert text.startswith("line one\nline two\ncaf\ufffd au lait\n")


# ---------------------------------------------------------------------------------------------
# the formats fine-tuners bring, chat templates, packing, and bad files
# ---------------------------------------------------------------------------------------------
def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _supervised(tok, sample) -> str:
    return tok.decode([t for t in sample.labels if t != IGNORE_INDEX], skip_special_tokens=False)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "The answer is: 4"},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": "12"},
]


def test_chat_template_supervises_every_assistant_turn_and_nothing_else() -> None:
    from megatrain_lightning.data.chat import ChatEncoder
    from megatrain_lightning.models.demo_checkpoint import byte_level_tokenizer

    tok = byte_level_tokenizer(chat=True)
    sample = ChatEncoder(tok).encode(CONVERSATION, max_length=512)
    assert tok.decode(sample.ids, skip_special_tokens=False) == tok.apply_chat_template(CONVERSATION, tokenize=False).rstrip()
    assert _supervised(tok, sample) == "The answer is: 4<|im_end|>12<|im_end|>"  # both turns, with their end-of-turn
    # validation starts from the template's own generation prompt, and must reproduce the last turn
    assert tok.decode(sample.prompt, skip_special_tokens=False) == tok.apply_chat_template(
        CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    assert tok.decode(sample.answer, skip_special_tokens=False) == "12<|im_end|>"
    # without the template (or with a tokenizer that has none): the prompt template and <eos>
    plain = ChatEncoder(tok, "Q: {query}\nA: ", use_chat_template=False).encode(CONVERSATION, max_length=512)
    assert tok.decode(plain.ids, skip_special_tokens=False) == (
        "<bos>Be brief.\n\nQ: What is 2+2?\nA: The answer is: 4<eos>Q: And times 3?\nA: 12<eos>")
    assert _supervised(tok, plain) == "The answer is: 4<eos>12<eos>"
    with pytest.raises(ConfigError, match="data.use_chat_template=true, but the tokenizer has no chat template"):
        ChatEncoder(ByteTokenizer(), use_chat_template=True)


def test_alpaca_sharegpt_and_messages_files_become_the_same_conversations(tmp_path: Path) -> None:
    from megatrain_lightning.models.demo_checkpoint import byte_level_tokenizer

    tok = byte_level_tokenizer(chat=True)
    sharegpt = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                   "value": m["content"]} for m in CONVERSATION]}
    files = {
        "messages": _write_jsonl(tmp_path / "m.jsonl", [{"messages": CONVERSATION}] * 3),
        "sharegpt": _write_jsonl(tmp_path / "s.jsonl", [sharegpt] * 3),
    }
    encoded = {}
    for fmt, path in files.items():
        dm = JsonSFTDataModule(path=str(path), val_size=1, batch_size=2, max_length=512, tokenizer=tok)
        dm.setup("fit")
        assert dm.encoder.uses_chat_template and len(dm.train_samples) == 2 and len(dm.val_samples) == 1
        encoded[fmt] = dm.train_samples[0]
    assert encoded["messages"] == encoded["sharegpt"]
    alpaca = [{"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"},
              {"instruction": "Say hi.", "input": "", "output": "hi"}]
    dm = JsonSFTDataModule(path=str(_write_jsonl(tmp_path / "a.jsonl", alpaca)), val_size=0, batch_size=1, max_length=512)
    dm.setup("fit")  # the byte tokenizer has no chat template: the Alpaca/MetaMathQA prompt
    with_input, without = (dm.tokenizer.decode(s.ids) for s in dm.train_samples)
    assert "### Instruction:\nAdd the numbers.\n\n2 and 2\n\n### Response:\n4" in with_input
    assert "### Instruction:\nSay hi.\n\n### Response:\nhi" in without
    assert [_supervised(dm.tokenizer, s) for s in dm.train_samples] == ["4<eos>", "hi<eos>"]


# name → (file text, fragments of the one-line ConfigError)
BAD_FILES = {
    "malformed line": ('{"query": "q", "response": "a"}\n{"query": "q2", "response": \n',
                       ["bad.jsonl:2: not valid JSON", "fix or remove that line"]),
    "unknown format": ('{"question": "q", "answer": "a"}\n',
                       ["bad.jsonl:1: a record with keys [question, answer] matches none of the data formats",
                        "metamath (query, response", "alpaca (instruction, input, output)", "messages (messages:",
                        "sharegpt (conversations:", "data.query_key"]),
    "format changes": ('{"query": "q", "response": "a"}\n\n{"instruction": "i", "output": "o"}\n',
                       ["bad.jsonl:3: a record with keys [instruction, output] is not in the metamath"]),
    "unknown role": ('{"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]}\n',
                     ["bad.jsonl:1: turn 1 has role='tool'"]),
    "no assistant turn": ('{"messages": [{"role": "user", "content": "q"}]}\n', ["bad.jsonl:1: the conversation has no assistant turn"]),
    "broken array": ('[\n {"query": "q", "response": "a"},\n {"query": "q2" "response": "a"}\n]\n', ["bad.jsonl:3: not valid JSON"]),
    "empty file": ("\n", ["holds no records"]),
    # found by a sweep of bad input (2026-12-05): the first four trained on something else, silently
    "two arrays": ('[{"query": "q", "response": "a"}]\n[{"query": "q2", "response": "b"}]\n',
                   ["bad.jsonl:2: more text after the JSON array that closed on line 1", "one object per line"]),
    "null response": ('{"query": "q", "response": "a"}\n{"query": "q", "response": null}\n',
                      ["bad.jsonl:2: 'response' is null, not text", "drop the record"]),
    "image part": ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, '
                   '{"role": "assistant", "content": "a"}]}\n',
                   ["bad.jsonl:1: turn 0's 'content' holds content parts of types ['image_url']"]),
    "content object": ('{"messages": [{"role": "user", "content": {"q": 1}}, {"role": "assistant", "content": "a"}]}\n',
                       ["bad.jsonl:1: turn 0's 'content' is a JSON dict, not text"]),
    "content under another key": ('{"messages": [{"role": "user", "text": "q"}, {"role": "assistant", "content": "a"}]}\n',
                                  ["bad.jsonl:1: turn 0 is not an object with 'role' and 'content' (it has keys [role, text])"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_name_the_file_line_and_fix(tmp_path: Path, case: str) -> None:
    text, fragments = BAD_FILES[case]
    (tmp_path / "bad.jsonl").write_text(text)
    dm = JsonSFTDataModule(path=str(tmp_path / "bad.jsonl"), val_size=0)
    with pytest.raises(ConfigError) as err:
        dm.setup("fit")
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_openai_text_parts_a_byte_order_mark_and_numbers_are_read_and_other_encodings_named(tmp_path: Path) -> None:
    from megatrain_lightning.data.records import load_conversations

    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Add"}, {"type": "text", "text": "2+2"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}
    path = tmp_path / "a.jsonl"
    path.write_text("\ufeff" + json.dumps(parts) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "1+1"}, {"role": "assistant", "content": 2}]}) + "\n", encoding="utf-8")
    (_, first), (_, second) = load_conversations(str(path))
    assert first == [{"role": "user", "content": "Add\n2+2"}, {"role": "assistant", "content": "4"}]
    assert second[1] == {"role": "assistant", "content": "2"}
    path.write_bytes(b'{"query": "q", "response": "a"}\n{"query": "caf\xe9", "response": "a"}\n')
    with pytest.raises(ConfigError, match=r"a.jsonl:2: not UTF-8 text .* save the file as UTF-8"):
        load_conversations(str(path))


def test_sizes_are_checked_with_the_key_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.batch_size=0: expected a positive integer"):
        ArithmeticDataModule(batch_size=0)
    with pytest.raises(ConfigError, match=r"data.max_length=-1"):
        ArithmeticDataModule(max_length=-1)
    path = _write_jsonl(tmp_path / "t.jsonl", [{"query": "q", "response": "a"}] * 3)
    dm = JsonSFTDataModule(path=str(path), val_size=0, batch_size=4)
    with pytest.raises(ConfigError, match=r"data.batch_size=4 is more than the 3 training samples"):
        dm.setup("fit")
    dm = JsonSFTDataModule(path=str(path), val_size=0, batch_size=1, max_length=4)  # <bos> + the prompt: 60+ tokens
    with pytest.raises(ConfigError, match=r"no training sample fits data.max_length=4"):
        dm.setup("fit")


def test_packing_fills_rows_restarts_positions_and_keeps_every_sample() -> None:
    from megatrain_lightning.data.packing import pack

    lengths = [9, 2, 7, 3, 5, 8, 1, 4]
    rows = pack(lengths, 10)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows) and len(rows) == 4  # 39 tokens: 4 rows is the least
    with pytest.raises(ValueError, match="more than a row"):
        pack([11], 10)

    dm = ArithmeticDataModule(max_operand=20, num_val=20, batch_size=4, max_length=64, packing=True)
    plain = ArithmeticDataModule(max_operand=20, num_val=20, batch_size=4, max_length=64)
    dm.setup("fit")
    plain.setup("fit")
    assert sum(len(r) for r in dm.train_rows) == len(dm.train_samples) == len(plain.train_samples)
    fill = [sum(len(s) for s in r) for r in dm.train_rows]
    assert sum(f < 64 - 11 for f in fill) <= 1  # every row full but for less than one question, the last apart
    batch = next(iter(dm.train_dataloader()))
    ids, labels, pos, mask = batch["input_ids"], batch["labels"], batch["position_ids"], batch["attention_mask"]
    width = ids.shape[1]  # the longest row of the batch, at most a row
    assert ids.shape == labels.shape == pos.shape == (4, width) and width <= 64
    tok = dm.tokenizer
    for row in range(4):
        starts = [int(i) for i in torch.nonzero(pos[row] == 0)]
        real = int(mask[row].sum())
        assert all(int(ids[row, s]) == tok.bos_token_id for s in starts if s < real)  # each sample from its <bos>
        assert bool((labels[row, starts] == IGNORE_INDEX).all())  # no sample predicts the next one's start
        questions = tok.decode(ids[row, :real].tolist())
        assert questions.count("=") == len(starts) - (real < width)  # a question per run of positions, padding apart
    assert sum(fill) / (len(fill) * 64) > 0.9


def test_final_answers_are_extracted_as_math_evaluations_do() -> None:
    from megatrain_lightning.data.answers import extract_answer, same_answer

    assert extract_answer("2 + 2 = 4. The answer is: 4") == "4"
    assert extract_answer("She has 1,200 apples.\n#### 1,200") == "1200"
    assert extract_answer("so $x = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert extract_answer("first 3, then 5, so 8.") == "8"
    assert extract_answer(" Paris. ") == "Paris"
    assert same_answer("The answer is: 18.0", "#### 18") and same_answer("x = -3", "-3")
    assert not same_answer("The answer is: 17", "18") and not same_answer("201", "20")


def test_a_home_relative_data_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`data.path='~/train.jsonl'` (quoted past the shell) names the file under $HOME, as checkpoint paths do."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _write_jsonl(tmp_path / "train.jsonl", [{"query": f"q{i}", "response": "a"} for i in range(4)])
    (tmp_path / "corpus.txt").write_text("hello world " * 20)
    dm = JsonSFTDataModule(path="~/train.jsonl", val_size=0, batch_size=2)
    dm.setup("fit")
    assert len(dm.train_samples) == 4
    assert PackedTextDataModule(path="~/corpus.txt", seq_len=16, batch_size=2).files == [str(tmp_path / "corpus.txt")]


def test_records_with_only_empty_answers_are_counted_in_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An empty answer trains the model to stop at once: said once, with the count and the first line (it was
    silent); a file whose answers all have text says nothing."""
    from megatrain_lightning.data.records import load_conversations

    path = tmp_path / "a.jsonl"
    path.write_text('{"query": "1+1", "response": "2"}\n{"query": "q", "response": "  "}\n{"query": "r", "response": ""}\n')
    with caplog.at_level("WARNING", logger="megatrain_lightning.data.records"):
        assert len(load_conversations(str(path))) == 3
        path.write_text('{"query": "1+1", "response": "2"}\n')
        load_conversations(str(path))
    assert [r.getMessage() for r in caplog.records] == [
        f"2 of 3 records have only empty answers (first: {path}:2): they teach the model to stop at once; "
        "drop them if that is not meant"]
