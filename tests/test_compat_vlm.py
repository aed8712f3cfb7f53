"""Issue 13, case 9: a vision-language model, Hugging Face Qwen2-VL and Qwen2.5-VL, built from a tiny
config (2 vision blocks of width 32, 2 decoder layers of width 32, random weights), trained on random
pixel values and tokens: the vision blocks and the decoder layers both stream, and training matches the
default strategy.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from compat_zoo import EngineProbe, assert_blocks_streamed, assert_exact
from conftest import fit
from zoo import ZooModule, random_tokens

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
VOCAB_VL = 128
GRID = (1, 4, 4)  # one frame of 4 x 4 patches of 4 x 4 pixels -> 16 patches, 4 tokens after the 2 x 2 merge
PATCH_FEATURES = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch
SEQ = 12


def _config(family: str) -> Any:
    text = dict(
        vocab_size=VOCAB_VL, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, bos_token_id=124, eos_token_id=125, pad_token_id=126,
    )
    common = dict(patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, depth=2, num_heads=4, hidden_size=32)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
               attn_implementation="eager")
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        return Qwen2VLConfig(text_config=text, vision_config=dict(common, embed_dim=32, mlp_ratio=2), **ids)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        vision = dict(common, intermediate_size=64, out_hidden_size=32, window_size=8, fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    raise ValueError(family)


class TinyVLM(ZooModule):
    """One 16 x 16 image per row (16 patches, 4 image tokens between vision start/end) in 12 tokens; the
    loss is the causal LM loss on the text tokens (image positions masked out of the labels)."""

    def __init__(self, family: str = "qwen2_vl", **kwargs: Any) -> None:
        kwargs.setdefault("n_train", 8)
        kwargs.setdefault("batch_size", 2)
        kwargs.setdefault("scheduler", False)
        kwargs.setdefault("seq_len", SEQ)
        super().__init__(**kwargs)
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

        cls = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[family]
        self.model = cls(_config(family))
        g = torch.Generator().manual_seed(11)
        self.pixels = torch.randn(len(self.train_data), GRID[0] * GRID[1] * GRID[2], PATCH_FEATURES, generator=g)
        # transformers >= 5.2x wants the modality of each token for M-RoPE; earlier versions take no such argument
        self.pass_token_types = "mm_token_type_ids" in inspect.signature(self.model.forward).parameters

    def make_data(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        ids = random_tokens(n, seq_len, 100, seed)
        ids[:, 1] = VISION_START
        ids[:, 2:6] = IMAGE
        ids[:, 6] = VISION_END
        return ids

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.train_data, self.pixels), batch_size=self.hparams.batch_size)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        ids, pixels = batch
        labels = ids.masked_fill(ids == IMAGE, -100)
        kwargs: dict[str, Any] = {}
        if self.pass_token_types:
            kwargs["mm_token_type_ids"] = (ids == IMAGE).int()
        out = self.model(
            input_ids=ids, pixel_values=pixels.reshape(-1, PATCH_FEATURES),
            image_grid_thw=torch.tensor([GRID] * len(ids)), labels=labels, **kwargs,
        )
        return out.loss


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_streams_vision_and_decoder_blocks(family: str) -> None:
    """Both the 2 vision blocks and the 2 decoder layers stream (EngineProbe: the engine's blocks), every
    block's gradients come home through the engine, and 4 steps match the default strategy."""
    pytest.importorskip("transformers")
    factory = partial(TinyVLM, family=family)
    probe = EngineProbe()
    ref = fit(factory, None, max_steps=4)
    got = fit(factory, "megatrain", max_steps=4, callbacks=[probe])
    assert probe.block_classes is not None
    vision = [c for c in probe.block_classes if "Vision" in c]
    decoder = [c for c in probe.block_classes if "Decoder" in c]
    assert len(vision) == 2 and len(decoder) == 2, f"streamed blocks: {probe.block_classes}"
    assert_blocks_streamed(probe, 4, steps=4)
    # as in test_parity.py: Qwen2's key bias has a near-zero gradient, Adam turns rounding into lr-sized steps
    assert_exact(ref, got, loose={"k_proj.bias": 2e-4})
