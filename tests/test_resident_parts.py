"""The resident parameters in two parts: those used before the blocks (embeddings) and those used only after
them (final norm, untied LM head), whose gradients go home at the first block's backward so that their
host update overlaps the backward.

Training stays exact (parity with Lightning's default strategy) in every case: the early send when the
model keeps to its registration order, the send at the end when it does not (a module registered after the
blocks but called before them), and with the overlap off (clipping).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from conftest import assert_parity, fit, megatrain
from megatrain_lightning.engine import RESIDENT, RESIDENT_AFTER, StreamingEngine
from megatrain_lightning.engine.resident import resident_names
from test_streaming import BlockNet, _loader, _trainer
from zoo import ZOO

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class SendLog:
    """Records the key of every store whose gradients the engine sends home, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[int] = []
        send = StreamingEngine._send

        def logged(engine: StreamingEngine, key: int, *args: Any, **kwargs: Any) -> None:
            self.keys.append(key)
            send(engine, key, *args, **kwargs)

        monkeypatch.setattr(StreamingEngine, "_send", logged)


def test_split_follows_registration_order_and_ties() -> None:
    untied = ZOO["llama"]().model  # Hugging Face Llama, untied head
    before, after = resident_names(untied, list(untied.model.layers))
    assert before == ["model.embed_tokens.weight"]
    assert after == ["model.norm.weight", "lm_head.weight"]
    tied = ZOO["qwen2"]().model
    assert tied.config.tie_word_embeddings
    before, after = resident_names(tied, list(tied.model.layers))
    assert before == ["model.embed_tokens.weight"] and after == ["model.norm.weight"]  # the tied head is "before"


@pytest.mark.parametrize("on_device", [False, True])
def test_after_part_goes_home_at_the_first_block_backward_exactly(monkeypatch: pytest.MonkeyPatch, on_device: bool
                                                                  ) -> None:
    """...from the second step on (the first backward watches that no gradient reaches it later, and sends it
    at the end), and the part before the blocks at the end, unless it is updated on the device, where its
    gradients stay, as the first block's do (tests/test_device_update.py)."""
    factory = partial(ZOO["llama"], optimizer="adamw", lr=3e-3, scheduler=True)
    ref = fit(factory, None, max_steps=3)
    log = SendLog(monkeypatch)
    got = fit(factory, megatrain(update_on_device=on_device), max_steps=3)
    assert_parity(ref, got)
    blocks = len(ref.module.model.model.layers)
    streamed = [*reversed(range(1 if on_device else 0, blocks)), *([] if on_device else [RESIDENT])]
    assert log.keys == [*streamed, RESIDENT_AFTER] + [RESIDENT_AFTER, *streamed] * 2, log.keys


def test_without_the_overlap_both_parts_go_home_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    factory = partial(ZOO["llama"], optimizer="adamw", lr=3e-3)
    ref = fit(factory, None, max_steps=2, gradient_clip_val=0.5)
    log = SendLog(monkeypatch)
    got = fit(factory, megatrain(), max_steps=2, gradient_clip_val=0.5)
    assert_parity(ref, got)
    n = len(log.keys) // 2
    assert log.keys[:n] == [*reversed(range(n - 2)), RESIDENT, RESIDENT_AFTER]


class LateRegisteredNet(BlockNet):
    """Its input layer is registered after the blocks, so it lands in the "after" part, yet runs first."""

    def __init__(self) -> None:
        super().__init__(depth=3)
        del self.inp
        self.late_inp = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.late_inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)

    on_before_optimizer_step = L.LightningModule.on_before_optimizer_step  # keep the overlap on


def test_a_step_out_of_registration_order_sends_the_after_part_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    module = LateRegisteredNet()
    before, after = resident_names(module, list(module.blocks))
    assert before == [] and after == ["out.weight", "out.bias", "late_inp.weight", "late_inp.bias"]
    log = SendLog(monkeypatch)
    ref_module = LateRegisteredNet()
    ref_module.load_state_dict(module.state_dict())
    L.seed_everything(0, verbose=False)
    _trainer("auto", max_steps=2).fit(ref_module, _loader())
    L.seed_everything(0, verbose=False)
    _trainer("megatrain", max_steps=2).fit(module, _loader())
    assert log.keys[:4] == [2, 1, 0, RESIDENT_AFTER]  # not early: its input layer ran before the blocks
    for (name, a), b in zip(ref_module.state_dict().items(), module.state_dict().values()):
        assert ((a - b).norm() / a.norm()).item() < 1e-5, name
