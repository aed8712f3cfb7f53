"""The tokenizer that goes with a model: the checkpoint's own, or bytes for random init."""

from __future__ import annotations

import os
from typing import Any

from megatrain_lightning.data.tokenizer import ByteTokenizer
from megatrain_lightning.errors import ConfigError


def load_tokenizer(pretrained: str | None) -> Any:
    """`AutoTokenizer` from a local checkpoint directory, else the built-in `ByteTokenizer`."""
    if pretrained is None:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(pretrained, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"model.pretrained={pretrained}: no tokenizer found there ({os.listdir(pretrained)}); "
            "save one next to the weights with tokenizer.save_pretrained()"
        ) from err
    if tok.eos_token_id is None:
        raise ConfigError(f"the tokenizer in {pretrained} has no eos token, which marks the end of an answer")
    return tok
