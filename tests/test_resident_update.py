"""The resident part before the blocks (the input embedding, a tied LM head) updated on the device
(``EngineConfig.resident_on_device``, ``engine/resident_update.py``), on the CPU in fp32.

It must be the host's update bit for bit (the same fused AdamW on the same values, so on the CPU the same
kernel), land in the host masters and moments that checkpoints and ``optimizer.state_dict()`` read, resume
exactly, and step aside wherever the host holds part of the gradient (accumulation) or the update does not
overlap (clipping).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import assert_parity, compare_losses, compare_states, fit, megatrain
from megatrain_lightning.engine.resident_update import DeviceUpdate
from zoo import ZOO

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LOOSE: dict[str, dict[str, float]] = {"qwen2": {"self_attn.k_proj.bias": 2e-4}}  # as tests/test_parity.py


@pytest.fixture
def device_updates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many steps each run updated its part before the blocks on the device (one entry per call)."""
    calls: list[int] = []
    run = DeviceUpdate.run

    def counted(self: DeviceUpdate, part: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(part.store.train_numel)
        return run(self, part, *args, **kwargs)

    monkeypatch.setattr(DeviceUpdate, "run", counted)
    return calls


def adamw(name: str, **kwargs: Any) -> Any:
    return partial(ZOO[name], optimizer="adamw", lr=3e-3, scheduler=True, **kwargs)


def optimizer_state(run: Any) -> dict[str, torch.Tensor]:
    sd = run.trainer.optimizers[0].state_dict()
    return {f"{i}.{k}": v.clone() for i, st in sd["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # an untied head (embedding alone), a tied one
def test_updated_on_the_device_as_under_the_default_strategy(name: str, device_updates: list[int]) -> None:
    ref = fit(adamw(name), None, max_steps=6)
    got = fit(adamw(name), megatrain(resident_on_device=True), max_steps=6)
    assert len(device_updates) == 6 and device_updates[0] > 0, device_updates
    assert_parity(ref, got, loose=LOOSE.get(name))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_same_step_bit_for_bit_as_the_host_update(name: str, device_updates: list[int]) -> None:
    """Same weights, losses and optimizer state (moments and step counts read from the host, where the
    device update's copy home put them) as with ``resident_on_device=False``."""
    on = fit(adamw(name), megatrain(resident_on_device=True), max_steps=5)
    assert len(device_updates) == 5
    off = fit(adamw(name), megatrain(resident_on_device=False), max_steps=5)
    assert len(device_updates) == 5  # the second run took the host path
    assert on.losses == off.losses
    for key, value in off.state.items():
        assert torch.equal(on.state[key], value), key
    on_opt, off_opt = optimizer_state(on), optimizer_state(off)
    assert on_opt.keys() == off_opt.keys() and len(on_opt) > 0
    for key, value in off_opt.items():
        assert torch.equal(on_opt[key], value), key


def test_off_by_default_where_nothing_chooses_it(device_updates: list[int]) -> None:
    """A placement field: on the CPU (nothing chooses a placement) None is the streaming value, off."""
    fit(adamw("llama"), megatrain(), max_steps=2)
    assert device_updates == []


def test_param_groups_and_weight_decay_per_group(device_updates: list[int]) -> None:
    """The embedding in a group of its own (no weight decay), the blocks in another: each group's
    hyperparameters reach the device kernel."""
    factory = partial(ZOO["llama"], param_groups=True, weight_decay=0.1)
    ref = fit(factory, None, max_steps=4)
    got = fit(factory, megatrain(resident_on_device=True), max_steps=4)
    assert len(device_updates) == 4
    assert_parity(ref, got)


@pytest.mark.parametrize("kwargs", [dict(accumulate_grad_batches=2), dict(gradient_clip_val=0.5)],
                         ids=["accumulation", "clipping"])
def test_the_host_update_where_the_device_cannot_take_it(kwargs: dict, device_updates: list[int]) -> None:
    """Accumulation: the host holds the earlier micro-batches' gradients; clipping: no overlapped update."""
    ref = fit(adamw("llama"), None, max_steps=3, **kwargs)
    got = fit(adamw("llama"), megatrain(resident_on_device=True), max_steps=3, **kwargs)
    assert device_updates == []
    assert_parity(ref, got)


def test_resume_refreshes_the_device_moments(tmp_path: Any, device_updates: list[int]) -> None:
    """A checkpoint holds the moments the device update sent home; a resumed run (a module built from
    another seed) copies them to the device before its first update and goes on as the uninterrupted run."""
    factory = partial(ZOO["llama"], n_train=12, batch_size=4, optimizer="adamw", scheduler=True)
    on = megatrain(resident_on_device=True)
    full = fit(factory, on, max_epochs=2, max_steps=-1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    fit(factory, on, max_epochs=1, max_steps=-1, callbacks=[ckpt], enable_checkpointing=True)
    del device_updates[:]
    resumed = fit(factory, on, seed=1, max_epochs=2, max_steps=-1, ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    assert len(device_updates) == 3
    compare_losses(full.losses[3:], resumed.losses, rtol=0)
    compare_states(full.state, resumed.state, rtol=0, what="resumed vs uninterrupted")
