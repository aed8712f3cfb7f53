"""Data modules: the embedded arithmetic task, synthetic tokens, JSON/JSONL fine-tuning, packed text."""

from megatrain_lightning.data.arithmetic import ArithmeticDataModule
from megatrain_lightning.data.jsonl import JsonSFTDataModule
from megatrain_lightning.data.synthetic import SyntheticDataModule
from megatrain_lightning.data.text import PackedTextDataModule
from megatrain_lightning.data.tokenizer import ByteTokenizer

__all__ = ["ArithmeticDataModule", "ByteTokenizer", "JsonSFTDataModule", "PackedTextDataModule", "SyntheticDataModule"]
