"""The resident part before the blocks (the input embedding, a tied LM head), the first block and, asked
for, cached blocks updated on the device (``EngineConfig.update_on_device``, ``engine/device_update.py``), on
the CPU in fp32 (bf16: tests/test_bf16_mixed_parity.py; peft LoRA: tests/test_compat_frozen.py).

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
from megatrain_lightning.engine.device_update import DeviceUpdate
from zoo import ZOO

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LOOSE: dict[str, dict[str, float]] = {"qwen2": {"self_attn.k_proj.bias": 2e-4}}  # as tests/test_parity.py


@pytest.fixture
def device_updates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The part before the blocks' updates on the device (its trainable size, one entry per update)."""
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


def assert_same_training(on: Any, off: Any) -> None:
    """Losses, final weights and optimizer state (moments and step counts, read from the host) bit for bit."""
    assert on.losses == off.losses
    for key, value in off.state.items():
        assert torch.equal(on.state[key], value), key
    on_opt, off_opt = optimizer_state(on), optimizer_state(off)
    assert on_opt.keys() == off_opt.keys() and len(on_opt) > 0
    for key, value in off_opt.items():
        assert torch.equal(on_opt[key], value), key


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # an untied head (embedding alone), a tied one
def test_updated_on_the_device_as_under_the_default_strategy(name: str, device_updates: list[int],
                                                             block_updates: list[int]) -> None:
    ref = fit(adamw(name), None, max_steps=6)
    got = fit(adamw(name), megatrain(update_on_device=True), max_steps=6)
    assert len(device_updates) == 6 and device_updates[0] > 0, device_updates
    assert block_updates == [0] * 6
    assert_parity(ref, got, loose=LOOSE.get(name))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("cached", [0, 3])  # the first block in a rotating slot, in its fixed one (all 3 cached)
def test_the_same_step_bit_for_bit_as_the_host_update(name: str, cached: int, device_updates: list[int],
                                                      block_updates: list[int]) -> None:
    """Same weights, losses and optimizer state (moments and step counts read from the host, where the
    device updates' copies home put them) as with ``update_on_device=False``."""
    on = fit(adamw(name), megatrain(update_on_device=True, cache_weights=cached), max_steps=5)
    assert len(device_updates) == 5 and block_updates == [0] * 5
    off = fit(adamw(name), megatrain(update_on_device=False, cache_weights=cached), max_steps=5)
    assert len(device_updates) == 5 and len(block_updates) == 5  # the second run took the host path
    assert_same_training(on, off)


def test_off_by_default_where_nothing_chooses_it(device_updates: list[int], block_updates: list[int]) -> None:
    """A placement field: on the CPU (nothing chooses a placement) None is the streaming value, off."""
    fit(adamw("llama"), megatrain(), max_steps=2)
    assert device_updates == [] and block_updates == []


def test_a_first_block_with_frozen_weights(block_updates: list[int]) -> None:
    """The first block's frozen weights (a LoRA base, a frozen projection) stay in its slot as the backward
    read them; its trainable ones are updated on the device."""

    def freeze(module: Any) -> None:
        module.model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
        module.model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)

    def factory() -> Any:
        module = adamw("llama")()
        freeze(module)
        return module

    ref = fit(factory, None, max_steps=4)
    got = fit(factory, megatrain(update_on_device=True), max_steps=4)
    assert block_updates == [0] * 4
    assert_parity(ref, got)


def test_param_groups_and_weight_decay_per_group(device_updates: list[int]) -> None:
    """The embedding in a group of its own (no weight decay), the blocks in another: each group's
    hyperparameters reach the device kernel."""
    factory = partial(ZOO["llama"], param_groups=True, weight_decay=0.1)
    ref = fit(factory, None, max_steps=4)
    got = fit(factory, megatrain(update_on_device=True), max_steps=4)
    assert len(device_updates) == 4
    assert_parity(ref, got)


@pytest.mark.parametrize("kwargs", [dict(accumulate_grad_batches=2), dict(gradient_clip_val=0.5)],
                         ids=["accumulation", "clipping"])
def test_the_host_update_where_the_device_cannot_take_it(kwargs: dict, device_updates: list[int],
                                                         block_updates: list[int]) -> None:
    """Accumulation: the host holds the earlier micro-batches' gradients; clipping: no overlapped update."""
    ref = fit(adamw("llama"), None, max_steps=3, **kwargs)
    got = fit(adamw("llama"), megatrain(update_on_device=True), max_steps=3, **kwargs)
    assert device_updates == [] and block_updates == []
    assert_parity(ref, got)


def test_resume_refreshes_the_device_moments(tmp_path: Any, device_updates: list[int], block_updates: list[int]
                                             ) -> None:
    """A checkpoint holds the moments the device update sent home; a resumed run (a module built from
    another seed) copies them to the device before its first update and goes on as the uninterrupted run."""
    factory = partial(ZOO["llama"], n_train=12, batch_size=4, optimizer="adamw", scheduler=True)
    on = megatrain(update_on_device=True)
    full = fit(factory, on, max_epochs=2, max_steps=-1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    fit(factory, on, max_epochs=1, max_steps=-1, callbacks=[ckpt], enable_checkpointing=True)
    del device_updates[:]
    resumed = fit(factory, on, seed=1, max_epochs=2, max_steps=-1, ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    assert len(device_updates) == 3 and block_updates[-3:] == [0] * 3
    compare_losses(full.losses[3:], resumed.losses, rtol=0)
    compare_states(full.state, resumed.state, rtol=0, what="resumed vs uninterrupted")


def test_the_next_forward_reads_the_first_block_from_its_slot(monkeypatch: pytest.MonkeyPatch,
                                                              block_updates: list[int]) -> None:
    """What the update on the device is for: the next forward's first block is not copied from the host
    again (all blocks cached: it goes to the device once, at the first step; on the host path, every step)."""
    from megatrain_lightning.engine.prefetch import WeightStream

    loads: list[int] = []
    load = WeightStream._load

    def logged(self: WeightStream, block: int, *args: Any, **kwargs: Any) -> Any:
        s = load(self, block, *args, **kwargs)
        if s is not None:
            loads.append(block)
        return s

    monkeypatch.setattr(WeightStream, "_load", logged)
    fit(adamw("llama"), megatrain(update_on_device=True, cache_weights=3), max_steps=5)
    assert block_updates == [0] * 5 and loads.count(0) == 1, loads
    del loads[:]
    fit(adamw("llama"), megatrain(update_on_device=False, cache_weights=3), max_steps=5)
    assert loads.count(0) == 5, loads


@pytest.mark.parametrize(("cached", "want"), [(3, [2, 1, 0]), (1, [1, 0])], ids=["all-cached", "one-cached"])
def test_more_blocks_on_the_device_bit_for_bit(cached: int, want: list[int], block_updates: list[int]) -> None:
    """``update_on_device=3``: the first block and the cached ones (in backward order), as the host would;
    a streamed block other than the first stays on the host path. One block cached: block 1, the next
    forward's second (``EngineConfig.fixed_blocks``), so the host updates block 2, whose gradients land
    first. The planner names the same blocks (one rule, ``EngineConfig.device_updated``)."""
    from megatrain_lightning.config import EngineConfig
    from megatrain_lightning.plan.run import device_block_ids

    on = fit(adamw("qwen2"), megatrain(update_on_device=3, cache_weights=cached), max_steps=4)
    assert block_updates == want * 4, block_updates
    assert device_block_ids(EngineConfig(update_on_device=3, cache_weights=cached).for_blocks(3), 3) == want[::-1]
    off = fit(adamw("qwen2"), megatrain(update_on_device=False, cache_weights=cached), max_steps=4)
    assert_same_training(on, off)


def test_the_blocks_the_device_updates_are_cached_from_the_second_on() -> None:
    """Which blocks own a fixed slot: with ``update_on_device=N`` the cached blocks the device updates are the
    next forward's earliest (the host's are then those whose gradients land first); kept blocks stay the last;
    cached blocks left to the host stay the last (as without device updates)."""
    from megatrain_lightning.config import EngineConfig

    def fixed(**kwargs: Any) -> list[int]:
        return EngineConfig(**kwargs).for_blocks(10).fixed_blocks(10)

    assert fixed(cache_weights=4, update_on_device=8) == [1, 2, 3, 4]  # the H100 Qwen3 placement
    assert fixed(cache_weights=4, update_on_device=3) == [1, 2, 8, 9]
    assert fixed(cache_weights=4, update_on_device=True) == [6, 7, 8, 9]
    assert fixed(cache_weights=4, update_on_device=False) == [6, 7, 8, 9]
    assert fixed(cache_weights=3, keep_activations=1, update_on_device=2) == [1, 8, 9]
    assert fixed(cache_weights=1, keep_activations=1, update_on_device=2) == [9]
    assert fixed(cache_weights=10, update_on_device=10) == list(range(10))
    assert fixed(cache_weights=9, keep_activations=2, update_on_device=10) == list(range(1, 10))


def test_a_kept_block_and_an_early_cached_one_bit_for_bit(block_updates: list[int]) -> None:
    """Two cached blocks of three, the last kept (activations and weights through the backward) and block 1
    updated on the device in its fixed slot: the host path's result bit for bit."""
    from megatrain_lightning.config import EngineConfig
    from megatrain_lightning.plan.run import device_block_ids

    options = dict(cache_weights=2, keep_activations=1)
    on = fit(adamw("llama"), megatrain(update_on_device=2, **options), max_steps=4)
    assert block_updates == [1, 0] * 4, block_updates
    assert device_block_ids(EngineConfig(update_on_device=2, **options).for_blocks(3), 3) == [0, 1]  # the planner's
    off = fit(adamw("llama"), megatrain(update_on_device=False, **options), max_steps=4)
    assert_same_training(on, off)


def test_a_streamed_first_block_reloads_from_its_device_masters(monkeypatch: pytest.MonkeyPatch,
                                                                 block_updates: list[int]) -> None:
    """The first block streamed (none of three cached, two rotating slots) and updated on the device: its slot is
    refilled in the backward (the last block took it), from the masters the device holds, a step
    ahead of the host's; they stay there between steps (they went home and came back every step, 2.49 GB each way
    for a Qwen3-30B-A3B layer); the run is the host path's bit for bit."""
    import lightning.pytorch as pl

    from megatrain_lightning.engine.prefetch import WeightStream

    from_device: list[int] = []
    load = WeightStream._load

    def logged(self: WeightStream, block: int, *args: Any, **kwargs: Any) -> Any:
        newer = self.ahead(block) is not None
        s = load(self, block, *args, **kwargs)
        if s is not None and newer:
            from_device.append(block)
        return s

    class Look(pl.Callback):
        megatrain_reads_weights = False

        def __init__(self) -> None:
            self.held: list[bool] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            engine = trainer.strategy.engine
            if 0 in engine.device_update.blocks:
                self.held.append(id(engine.stores[0]) in engine.device_update.behind)

    monkeypatch.setattr(WeightStream, "_load", logged)
    look = Look()
    options = dict(slots=2, cache_weights=0)
    on = fit(adamw("llama"), megatrain(update_on_device=True, **options), max_steps=4, callbacks=[look])
    assert block_updates == [0] * 4, block_updates
    assert look.held == [True] * 3, look.held  # the host's masters of block 0 a step behind between steps
    assert from_device == [0] * 3, from_device  # steps 2-4: the backward's reload of block 0 from the device
    off = fit(adamw("llama"), megatrain(update_on_device=False, **options), max_steps=4)
    assert_same_training(on, off)


@pytest.mark.parametrize("value", [-1, 1.5, "2"])
def test_update_on_device_refuses_what_is_not_a_count(value: Any) -> None:
    from megatrain_lightning import EngineConfig

    with pytest.raises(ValueError, match="update_on_device="):
        EngineConfig(update_on_device=value)


def test_a_new_placement_gives_the_device_state_back_and_stays_exact(block_updates: list[int]) -> None:
    """Between steps the placement changes (as the strategy's chosen placement does): the updates' device
    state goes, the next updates refresh it from the host, and the run is the host path's bit for bit."""
    import lightning.pytorch as pl

    from megatrain_lightning import EngineConfig

    class Replace(pl.Callback):
        megatrain_reads_weights = False

        def __init__(self) -> None:
            self.released: list[int] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            if trainer.global_step == 2:
                engine = trainer.strategy.engine
                engine.place(EngineConfig(update_on_device=3, cache_weights=1))
                self.released.append(len(engine.device_update.blocks))

    replace = Replace()
    on = fit(adamw("llama"), megatrain(update_on_device=3, cache_weights=3), max_steps=5, callbacks=[replace])
    assert replace.released == [0]
    assert block_updates == [2, 1, 0] * 2 + [1, 0] * 3, block_updates  # then block 1 cached (EngineConfig.fixed_blocks)
    off = fit(adamw("llama"), megatrain(update_on_device=False, cache_weights=3), max_steps=5)
    assert on.losses == off.losses
    for key, value in off.state.items():
        assert torch.equal(on.state[key], value), key


def test_the_device_state_goes_home_only_when_read(block_updates: list[int]) -> None:
    """Between steps the newer masters and moments of what the device updates stay there (nothing reads the
    host's: ``megatrain_reads_weights = False``); the host's are a step behind until the run's end (or a
    checkpoint, an evaluation) sends them home, and then they are the host path's bit for bit."""
    import lightning.pytorch as pl

    class Look(pl.Callback):
        megatrain_reads_weights = False

        def __init__(self) -> None:
            self.seen: list[tuple[int, bool]] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            engine = trainer.strategy.engine
            part = engine.resident.before
            if part.moments is not None:
                ea, _ = part.store.moment_buffers()
                self.seen.append((len(engine.device_update.behind), torch.equal(ea, part.moments[0])))

    look = Look()
    on = fit(adamw("llama"), megatrain(update_on_device=3, cache_weights=3), max_steps=4, callbacks=[look])
    assert block_updates == [2, 1, 0] * 4, block_updates
    assert look.seen == [(4, False)] * 3, look.seen  # the embedding and three blocks, the host a step behind
    off = fit(adamw("llama"), megatrain(update_on_device=False, cache_weights=3), max_steps=4)
    assert_same_training(on, off)


def test_a_step_whose_end_reads_the_host_state_sends_each_update_home_as_it_runs(block_updates: list[int]) -> None:
    """A callback that may read the weights between steps (it does not say otherwise): the steps do not run on,
    so nothing is held on the device (each update's state goes home beside the backward), bit for bit the host
    path."""
    import lightning.pytorch as pl

    class Reads(pl.Callback):
        def __init__(self) -> None:
            self.behind: list[int] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            self.behind.append(len(trainer.strategy.engine.device_update.behind))

    reads = Reads()
    on = fit(adamw("llama"), megatrain(update_on_device=3, cache_weights=3), max_steps=4, callbacks=[reads])
    assert block_updates == [2, 1, 0] * 4 and reads.behind == [0] * 4, (block_updates, reads.behind)
    off = fit(adamw("llama"), megatrain(update_on_device=False, cache_weights=3), max_steps=4)
    assert_same_training(on, off)


@pytest.mark.parametrize("cached", [0, 3])
def test_a_store_the_device_stops_updating_goes_home_before_its_host_update(cached: int,
                                                                            block_updates: list[int]) -> None:
    """The updates on the device stop applying between steps without a settle (here the config is switched
    under a running engine): each store's newer device state goes home before its first host update."""
    import dataclasses

    import lightning.pytorch as pl

    class Switch(pl.Callback):
        megatrain_reads_weights = False

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            engine = trainer.strategy.engine
            if trainer.global_step == 2:
                assert engine.device_update.behind  # what steps 0-1 updated on the device is there only
                engine.config = dataclasses.replace(engine.config, update_on_device=False)

    on = fit(adamw("qwen2"), megatrain(update_on_device=3, cache_weights=cached), max_steps=5, callbacks=[Switch()])
    assert len(block_updates) == 2 * (3 if cached else 1), block_updates
    off = fit(adamw("qwen2"), megatrain(update_on_device=False, cache_weights=cached), max_steps=5)
    assert_same_training(on, off)


def test_optimizer_state_loaded_mid_run_replaces_the_device_moments(block_updates: list[int]) -> None:
    """A callback loads the optimizer state saved after step 1 into the run after step 3, through the strategy's
    own entry points (as a user's rollback would): the device's newer moments go home first and are then
    refreshed from the loaded ones, as Lightning's default strategy's moments are simply replaced."""
    import copy

    import lightning.pytorch as pl

    class Rollback(pl.Callback):
        megatrain_reads_weights = False  # it goes through the strategy's entry points, which settle themselves

        def __init__(self) -> None:
            self.saved: Any = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            if trainer.global_step == 1:
                self.saved = copy.deepcopy(trainer.strategy.optimizer_state(trainer.optimizers[0]))
            if trainer.global_step == 3:
                trainer.strategy.load_optimizer_state_dict({"optimizer_states": [self.saved]})

    ref = fit(adamw("llama"), None, max_steps=6, callbacks=[Rollback()])
    got = fit(adamw("llama"), megatrain(update_on_device=3, cache_weights=3), max_steps=6, callbacks=[Rollback()])
    assert block_updates and set(block_updates) == {0, 1, 2}, block_updates
    assert_parity(ref, got)
    ref_opt, got_opt = optimizer_state(ref), optimizer_state(got)
    assert ref_opt.keys() == got_opt.keys() and len(ref_opt) > 0
    for key, value in ref_opt.items():
        assert torch.allclose(got_opt[key], value, rtol=1e-5, atol=1e-8), key


def test_validation_between_steps_sees_the_state_the_device_holds() -> None:
    """Validation every 2 steps: the state held on the device goes home first, the validation losses are the
    default strategy's, and training goes on exactly as the host path's."""
    factory = adamw("llama", n_val=8)
    kwargs = dict(max_steps=6, limit_val_batches=2, val_check_interval=2)
    ref = fit(factory, None, **kwargs)
    on = fit(factory, megatrain(update_on_device=3, cache_weights=3), **kwargs)
    off = fit(factory, megatrain(update_on_device=False, cache_weights=3), **kwargs)
    assert len(ref.module.val_losses) == 6 and on.module.val_losses == off.module.val_losses
    compare_losses(ref.module.val_losses, on.module.val_losses, 1e-5, "validation loss")
    assert_same_training(on, off)
    assert_parity(ref, on)
