"""A byte-level tokenizer that needs no files: the default for randomly initialised models.

Every UTF-8 byte is its own token (ids 0-255), plus three special tokens. It has the slice of the
Hugging Face tokenizer interface that the data modules use (`encode`, `decode`, `pad_token_id`,
`eos_token_id`, `bos_token_id`, `len()`), so a pretrained model's own tokenizer can replace it.
The price of bytes: about 4x more tokens per English word than a BPE vocabulary; for short
arithmetic it is exact and tiny (a 259-row embedding).
"""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """UTF-8 bytes as token ids, with `<pad>`=256, `<bos>`=257, `<eos>`=258."""

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, prefixed by `<bos>` as HF tokenizers do."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped (or shown by name), invalid bytes replaced."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out.extend({256: b"<pad>", 257: b"<bos>", 258: b"<eos>"}.get(i, b"<unk>"))
        return out.decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size
