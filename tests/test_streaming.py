"""Proof that MegaTrainStrategy really streams: a strategy that trained natively could not pass these.

Host store views, optimizer state in the store, gradients arriving through the host accumulators, copy
counters (weights shipped for the forward and the recompute, gradients once), the engine's independence
from Lightning, and the clear refusals.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import megatrain_lightning
from megatrain_lightning import HostAdamW, MegaTrainStrategy
from megatrain_lightning.blocks import BlockDetectionError, find_blocks
from megatrain_lightning.engine import RESIDENT
from conftest import strategy_of


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class BlockNet(L.LightningModule):
    def __init__(self, depth: int = 4, width: int = 16, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)
        self.optimizer_kind = optimizer
        self.seen_grads: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.seen_grads.append({n: p.grad for n, p in self.named_parameters() if p.grad is not None})

    def configure_optimizers(self):
        if self.optimizer_kind == "host_adamw":
            return HostAdamW(self.parameters(), lr=1e-2)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader(n: int = 8, batch: int = 2) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def _trainer(strategy, **kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kw,
    )


def _shares_storage(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


class Probe(L.Callback):
    """Reads the engine's state while the fit is still running (teardown releases it)."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        engine = trainer.strategy.engine
        opt = trainer.optimizers[0]
        for block, store in zip(module.blocks, engine.stores):
            for p in block.parameters():
                assert p.device.type == "cpu" and p.dtype == torch.float32
                assert _shares_storage(p, store.master), "block parameter is not a view of the host store"
                assert p.grad is None or _shares_storage(p.grad, store.grad)
                st = opt.state[p]
                assert _shares_storage(st["exp_avg"], store.exp_avg)
                assert _shares_storage(st["exp_avg_sq"], store.exp_avg_sq)
        # resident parameters: the input layer in the part used before the blocks, the output layer in
        # the part used only after them (its gradients go home at the first block's backward)
        before, after = (part.store for part in engine.resident.parts)
        assert _shares_storage(module.inp.weight, before.master) and _shares_storage(module.out.bias, after.master)
        self.checked += 1


@pytest.mark.parametrize("optimizer", ["adamw", "host_adamw"])
def test_parameters_and_optimizer_state_live_in_the_host_store(optimizer: str) -> None:
    module = BlockNet(optimizer=optimizer)
    probe = Probe()
    _trainer("megatrain", max_steps=3, callbacks=[probe]).fit(module, _loader())
    assert probe.checked == 3
    # after teardown the module is an ordinary host module holding the trained values
    assert "forward" not in module.blocks[0].__dict__
    assert all(p.device.type == "cpu" for p in module.parameters())


def test_gradients_arrive_through_the_host_accumulators() -> None:
    module = BlockNet()
    _trainer(strategy_of(slots=2), max_steps=2).fit(module, _loader())
    assert len(module.seen_grads) == 2
    for grads in module.seen_grads:
        assert set(grads) == {n for n, _ in module.named_parameters()}
        assert all(g.device.type == "cpu" and g.dtype == torch.float32 for g in grads.values())


class CountingProbe(L.Callback):
    megatrain_reads_weights = False  # counts copies only: neither reads nor writes the weights
    def __init__(self) -> None:
        self.rows: list[tuple[dict, dict, dict]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        trainer.strategy.engine.stats.reset()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        c = trainer.strategy.engine.stats
        self.rows.append((dict(c.h2d), dict(c.reused), dict(c.d2h)))


@pytest.mark.parametrize("slots", [2, 3])
def test_copy_counters_show_two_weight_shipments_and_one_gradient_shipment(slots: int) -> None:
    depth = 5
    module = BlockNet(depth=depth)
    probe = CountingProbe()
    _trainer(strategy_of(slots=slots), max_steps=3, callbacks=[probe]).fit(module, _loader())
    assert len(probe.rows) == 3
    for h2d, reused, d2h in probe.rows:
        for i in range(depth):
            # forward + recompute: each use is a copy, or a reuse of the copy already in a slot
            assert h2d.get(i, 0) + reused.get(i, 0) == 2, (i, h2d, reused)
            assert d2h[i] == 1
        # only the blocks still in a slot when the forward turns into the backward are reused
        assert sum(reused.values()) <= slots
        assert sum(h2d.get(i, 0) for i in range(depth)) >= 2 * depth - slots
        assert h2d[RESIDENT] == 1 and d2h[RESIDENT] == 1


def test_accumulation_ships_each_micro_batch_and_adds_on_the_host() -> None:
    module = BlockNet(depth=3)
    probe = CountingProbe()
    _trainer("megatrain", max_steps=2, accumulate_grad_batches=2, callbacks=[probe]).fit(module, _loader())
    assert len(probe.rows) == 4
    assert all(row[2][i] == 1 for row in probe.rows for i in range(3))


# ---------------------------------------------------------------------- refusals


class Plain(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, _):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_module_without_blocks_is_refused_with_what_to_pass() -> None:
    with pytest.raises(BlockDetectionError, match="block_class"):
        _trainer("megatrain", max_steps=1).fit(Plain(), _loader())


@pytest.mark.parametrize("block_class", [123, [1]])
def test_a_block_class_of_the_wrong_type_is_refused_when_the_strategy_is_built(block_class: Any) -> None:
    with pytest.raises(TypeError, match=r"block_class=.*expected a module class, its name, or a list of them"):
        MegaTrainStrategy(block_class=block_class)


def test_blocks_sharing_parameters_are_refused() -> None:
    module = BlockNet(depth=3)
    module.blocks[2].fc1.weight = module.blocks[0].fc1.weight
    with pytest.raises(BlockDetectionError, match="share"):
        find_blocks(module)
    module = BlockNet(depth=3)
    module.blocks[1] = module.blocks[0]
    with pytest.raises(BlockDetectionError, match="same block object"):
        find_blocks(module)


def test_mixed_block_list_is_refused_and_block_class_resolves_it() -> None:
    class Other(Block):
        pass

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(8), Other(8), Block(8), Other(8)])

    with pytest.raises(BlockDetectionError, match="mixing classes"):
        find_blocks(Mixed())
    found = find_blocks(Mixed(), block_class=[Block, "Other"])
    assert [n for n, _ in found] == [f"layers.{i}" for i in range(4)]
    with pytest.raises(BlockDetectionError, match="matches no submodule"):
        find_blocks(Mixed(), block_class="NoSuchBlock")


def test_stages_of_layers_stream_the_layers_not_the_stage_lists() -> None:
    """A ModuleList of ModuleLists (stages iterated layer by layer; Funnel's encoder.blocks): the inner lists have no
    forward, so no block call would run (the layers ran on their host weights, never streamed)."""

    class Stages(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList([nn.ModuleList([Block(8), Block(8)]) for _ in range(2)])

    found = find_blocks(Stages())
    assert [n for n, _ in found] == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]


@pytest.mark.parametrize("precision, why", [("16-true", "fp16 would need a loss scaler"),
                                             ("bf16-true", "bf16-true would keep bf16 masters"),
                                             ("64-true", "fp64 weights are not streamed; use 32-true")])
def test_precision_outside_the_supported_set_is_refused(precision: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"got '{precision}': {why}"):
        L.Trainer(accelerator="cpu", devices=1, strategy="megatrain", precision=precision)


class ManualNet(BlockNet):
    """Manual optimisation: two forward/backward/step rounds inside one training_step."""

    def __init__(self) -> None:
        super().__init__(depth=3, optimizer="sgd")
        self.automatic_optimization = False
        self.losses: list[float] = []

    def training_step(self, batch, _):
        opt = self.optimizers()
        x, y = batch
        for _round in range(2):
            loss = torch.nn.functional.mse_loss(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.losses.append(loss.item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_manual_optimisation_matches_native() -> None:
    ref, got = ManualNet(), ManualNet()
    for module, strategy in ((ref, "auto"), (got, "megatrain")):
        L.seed_everything(0, verbose=False)
        _trainer(strategy, max_steps=6).fit(module, _loader())
    assert len(ref.losses) == len(got.losses) == 6
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    for (name, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        assert ((a - b).norm() / a.norm()).item() < 1e-5, name


class HooklessNet(BlockNet):
    on_before_optimizer_step = L.LightningModule.on_before_optimizer_step  # no user hook around the step


class EarlyUpdates(L.Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_train_end(self, trainer, module) -> None:
        self.count = trainer.strategy.precision_plugin.host_optimizers[id(trainer.optimizers[0])].early_updates


@pytest.mark.parametrize("clip, accumulate, expect_overlap", [(None, 1, True), (None, 2, True), (0.1, 1, False)])
def test_host_adam_overlaps_the_backward_only_when_exact(clip, accumulate, expect_overlap) -> None:
    """Blocks are updated as their gradients land (same result, tested by the parity suite), except when
    clipping needs every gradient first; with accumulation only the window's last backward overlaps."""
    depth, steps = 3, 2
    ref, got = HooklessNet(depth=depth), HooklessNet(depth=depth)
    probe = EarlyUpdates()
    kw = dict(max_steps=steps, gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    L.seed_everything(0, verbose=False)
    _trainer("auto", **kw).fit(ref, _loader())
    L.seed_everything(0, verbose=False)
    _trainer("megatrain", callbacks=[probe], **kw).fit(got, _loader())
    # every block store and both resident stores (input layer before the blocks, output layer after), once per step
    assert probe.count == ((depth + 2) * steps if expect_overlap else 0)
    for (name, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        assert ((a - b).norm() / a.norm()).item() < 1e-5, name


def test_fabric_is_refused_naming_the_trainer() -> None:
    """``Fabric(strategy="megatrain")`` read "invalid strategy name ... must be a string": now one sentence."""
    from lightning.fabric import Fabric

    with pytest.raises(TypeError, match=r"Lightning Fabric is not supported.*lightning.pytorch.Trainer\(strategy=\"megatrain\"\)"):
        Fabric(accelerator="cpu", devices=1, strategy="megatrain")
