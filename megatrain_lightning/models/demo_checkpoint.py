"""A tiny local Hugging Face checkpoint (weights + tokenizer), made offline.

For the fine-tuning recipe and the tests: `model.pretrained=` needs a directory that
`from_pretrained` can read, and nothing may be downloaded. The tokenizer is a real
`PreTrainedTokenizerFast` (byte-level, one token per byte, no merges) so the code path is exactly
the one a downloaded checkpoint takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


# ChatML, as Qwen's instruct models use it (without their default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_level_tokenizer(chat: bool = False) -> Any:
    """A Hugging Face fast tokenizer over bytes, with `<pad>`, `<bos>`, `<eos>` specials; with `chat`, also
    `<|im_start|>` / `<|im_end|>` and a ChatML chat template (an instruct model's tokenizer in miniature)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<pad>", "<bos>", "<eos>"] + (["<|im_start|>", "<|im_end|>"] if chat else [])
    for special in specials:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   additional_special_tokens=specials[3:])
    if chat:
        fast.chat_template = CHATML_TEMPLATE
    return fast


def write_demo_checkpoint(path: str | Path, hidden_size: int = 64, layers: int = 2, seed: int = 0,
                          chat: bool = False) -> Path:
    """Save a randomly initialised Llama-shaped model and its tokenizer (`chat`: with a ChatML template) to
    `path`; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = byte_level_tokenizer(chat)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
