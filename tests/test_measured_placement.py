"""The placement the strategy chooses from a measured step (``plan/measured.py``, ``auto_placement.py``) and the
engine's change of placement between steps (``StreamingEngine.place``).

On the CPU the device is the host, so nothing is measured or chosen there (``EngineConfig()`` trains on the
streaming placement, exactly as before); what is checked here is that a placement taken between any two
micro-batches (mid-window too, with deferred updates running on) trains exactly as Lightning's default
strategy, the choice's arithmetic against the planner's models, and the trial: AutoPlacement wired as on a
GPU and handed the measurements a GPU's allocator would give, on a module whose blocks run out of memory (in
their forward or their backward) when more than one is kept, backs off and runs the step again, and the run
is exactly Lightning's. The real measurement and out-of-memory run on the GPU: ``tests/test_auto_placement_cuda.py``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import lightning.pytorch as pl
import pytest
import torch

from conftest import fit, megatrain, run_parity
from megatrain_lightning.config import STREAMING, EngineConfig
from megatrain_lightning.plan.measured import (
    Measured, after_out_of_memory, back_off, by_measurement, by_planner, clamp, matmuls_ratio,
)
from megatrain_lightning.plan.memory import GB
from zoo import ZOO

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

PLACEMENTS = [
    dict(slots=3, keep_activations=2, kept_saves="all", cache_weights=3, offload_inputs=False),
    dict(slots=2, keep_activations=99, kept_saves="matmuls", cache_weights=0, offload_inputs=True),
    dict(slots=2, keep_activations=1, kept_saves="all", cache_weights=0, offload_inputs=1),
    STREAMING,
]


class NewPlacements(pl.Callback):
    """After each given batch, the engine takes the next placement of PLACEMENTS (no-op on other strategies)."""

    megatrain_reads_weights = False  # it only moves device memory: deferred updates may run on

    def __init__(self, after: tuple[int, ...]) -> None:
        self.after, self.taken, self.batches = after, 0, 0

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        self.batches += 1
        if engine is not None and self.batches - 1 in self.after:
            engine.place(EngineConfig(**PLACEMENTS[self.taken % len(PLACEMENTS)]))
            self.taken += 1


@pytest.mark.parametrize("accumulate", [1, 2], ids=["each-step", "mid-window"])
def test_a_placement_taken_between_micro_batches_trains_exactly(accumulate: int) -> None:
    factory = partial(ZOO["llama"], optimizer="adamw", lr=3e-3, scheduler=True)
    callback = NewPlacements(after=(0, 1, 2, 4, 6))  # micro-batches, counted over the megatrain run
    run_parity(factory, megatrain(), max_steps=8 // accumulate, accumulate_grad_batches=accumulate,
               callbacks=[callback])
    assert callback.taken == 5  # every placement of PLACEMENTS was taken, the streaming one last


def test_on_the_cpu_nothing_is_measured_or_chosen() -> None:
    run = fit(partial(ZOO["llama"], optimizer="adamw", lr=3e-3), megatrain(), max_steps=2)
    strategy = run.trainer.strategy
    assert EngineConfig().unset == ("slots", "keep_activations", "kept_saves", "cache_weights", "offload_inputs")
    assert strategy.placement is None  # torn down, and never made on the CPU
    assert strategy.config == EngineConfig()


# ---------------------------------------------------------------------------------- the choice's arithmetic
def _qwen_3b():
    from test_placement import _setting

    return _setting("model=qwen2_5_3b", "data.batch_size=8", "hardware=h200_126g")


def _measured(shape, **kw) -> Measured:
    base = dict(peak=30 * GB, kept_graph=2.2 * GB, block_weights=0.16 * GB, budget=120 * GB, layers=shape.layers,
                matmuls_ratio=matmuls_ratio(shape))
    return Measured(**{**base, **kw})


def test_without_shapes_the_most_kept_blocks_then_the_most_cached_weights() -> None:
    m = Measured(peak=10 * GB, kept_graph=2 * GB, block_weights=1 * GB, budget=40 * GB, layers=36)
    e = by_measurement(m, EngineConfig())
    assert (e.keep_activations, e.cache_weights, e.slots, e.kept_saves) == (10, 10, 2, "all")  # 10 + 10 x 3 = 40
    assert m.fits(e) and not m.fits(dataclasses.replace(e, keep_activations=11, cache_weights=11))
    roomy = dataclasses.replace(m, kept_graph=0.5 * GB)
    e = by_measurement(roomy, EngineConfig())
    assert (e.keep_activations, e.cache_weights) == (20, 20)  # 10 + 20 x 1.5 = 40
    set_by_user = by_measurement(m, EngineConfig(keep_activations=4))
    assert set_by_user.keep_activations == 4 and set_by_user.cache_weights == 22  # 10 + 4 x 2 + 22 x 1 = 40
    nothing = by_measurement(dataclasses.replace(m, budget=9 * GB), EngineConfig())
    assert nothing == EngineConfig().filled()


def test_with_shapes_the_planners_choice_within_the_measured_budget() -> None:
    shape, work, hw = _qwen_3b()
    m = _measured(shape)
    chosen, step = by_planner(m, EngineConfig(), shape, work, hw)
    assert not chosen.unset and chosen.keep_activations > 0 and step > 0
    assert m.fits(chosen)
    tight = _measured(shape, budget=45 * GB)
    small, _ = by_planner(tight, EngineConfig(), shape, work, hw)
    assert tight.fits(small) and small.cached_blocks < chosen.cached_blocks
    # a user who set a field keeps it, however tight the budget
    fixed, _ = by_planner(tight, EngineConfig(keep_activations=30, kept_saves="all"), shape, work, hw)
    assert (fixed.keep_activations, fixed.kept_saves) == (30, "all")


def test_the_embeddings_device_update_chosen_where_it_is_the_faster_step() -> None:
    """7B on the H200 as measured there (2026-12-03, session 9 call 1: streaming peak 35.5 GB, a kept block
    8.56 GB): with the embedding's moments on the device (4.4 GB) the measured prediction keeps one block fewer,
    and the planner still times that faster than keeping it with the update on the host (whose AdamW and copies
    then lie between the backward and the next forward); where its moments do not fit at all, off."""
    from test_placement import _setting

    shape, work, hw = _setting("experiment=bench_7b", "hardware=h200_126g")
    moments = 8 * (shape.resident_params - shape.untied_head())
    m = Measured(peak=35.5 * GB, kept_graph=8.56 * GB, block_weights=2 * shape.largest_block, budget=137.5 * GB,
                 layers=shape.layers, matmuls_ratio=matmuls_ratio(shape), device_moments=moments)
    eager = EngineConfig(compile_blocks=False)  # as measured then (compiled, the device's part shrinks: N=4)
    chosen, step = by_planner(m, eager, shape, work, hw)
    assert chosen.update_on_device and m.fits(chosen)  # True, or N=2 (no block moments measured here)
    off, off_step = by_planner(m, EngineConfig(update_on_device=False, compile_blocks=False), shape, work, hw)
    assert off.keep_activations > chosen.keep_activations and off_step > step  # one block more, yet slower
    assert not m.fits(dataclasses.replace(off, update_on_device=True))
    # the streaming peak alone leaves no room for the moments: off (clamp takes them away last)
    full = dataclasses.replace(m, budget=35.5 * GB + moments / 2)
    assert by_planner(full, EngineConfig(), shape, work, hw)[0].update_on_device is False
    # one micro-batch per step only: with accumulation the host holds the gradients' sum
    acc, _ = by_planner(m, EngineConfig(), shape, dataclasses.replace(work, accumulate=2), hw)
    assert not acc.update_on_device


def test_cached_blocks_updated_on_the_device_chosen_where_the_host_adamw_bounds_the_step() -> None:
    """3B plain HF on the H200 as measured there (2026-12-03, session 11 call 1: streaming peak 40.1 GB, a kept
    block 2.47 GB at 16384 tokens): the host AdamW bounds the step (0.875 s with the first block on the device
    against 0.811 s with 8 blocks), so the choice updates N > 1 blocks on the device, each counted at 12 B/param
    in the measured prediction, and the planner times it faster than the first block alone or none."""
    from test_placement import _setting

    shape, work, hw = _setting("model=qwen2_5_3b", "data.batch_size=8", "hardware=h200_126g")
    work = dataclasses.replace(work, loss_chunk_tokens=None)  # the plain HF module: its own full-logit loss
    block = shape.block_params // shape.layers
    m = Measured(peak=40.1 * GB, kept_graph=2.47 * GB, block_weights=2 * shape.largest_block, budget=137.5 * GB,
                 layers=shape.layers, matmuls_ratio=matmuls_ratio(shape),
                 device_moments=8 * (shape.resident_params - shape.untied_head()) + 16 * block,
                 device_block_moments=12 * block)
    chosen, step = by_planner(m, EngineConfig(), shape, work, hw)
    assert chosen.update_on_device is not True and int(chosen.update_on_device) > 1 and m.fits(chosen)
    for other in (True, False):
        assert by_planner(m, EngineConfig(update_on_device=other), shape, work, hw)[1] > step
    # the measured prediction counts the first block and each cached one asked for, no more than are cached
    e = dataclasses.replace(chosen, update_on_device=3)
    assert m.predicted_peak(e) - m.predicted_peak(dataclasses.replace(e, update_on_device=False)) == pytest.approx(
        m.device_moments + 2 * m.device_block_moments)
    few = dataclasses.replace(e, keep_activations=1, cache_weights=1)
    assert m.predicted_peak(few) - m.predicted_peak(dataclasses.replace(few, update_on_device=False)) == pytest.approx(
        m.device_moments + m.device_block_moments)
    # a budget with room for the first block's state but not for the cached blocks' beside a kept block: fewer
    tight = dataclasses.replace(m, budget=40.1 * GB + 2.47 * GB + 2 * shape.largest_block + m.device_moments
                                + 0.5 * m.device_block_moments)
    small, _ = by_planner(tight, EngineConfig(), shape, work, hw)
    assert tight.fits(small) and (not small.update_on_device or int(small.update_on_device) < int(chosen.update_on_device))


def test_clamp_takes_slots_then_cached_weights_then_kept_blocks() -> None:
    m = Measured(peak=10 * GB, kept_graph=2 * GB, block_weights=1 * GB, budget=30 * GB, layers=36)
    e = EngineConfig(slots=3, keep_activations=5, kept_saves="all", cache_weights=12, offload_inputs=False)
    assert m.predicted_peak(e) == 10 * GB + 5 * 2 * GB + 13 * GB
    out = clamp(m, e, EngineConfig().unset)
    assert (out.slots, out.keep_activations, out.cache_weights) == (2, 5, 10)
    assert clamp(m, e, ()) == e  # nothing of it left open: nothing changed


def test_a_trial_above_the_budget_and_an_out_of_memory_back_off() -> None:
    m = Measured(peak=10 * GB, kept_graph=2 * GB, block_weights=1 * GB, budget=40 * GB, layers=36)
    e = by_measurement(m, EngineConfig())
    unset = EngineConfig().unset
    same_m, same = back_off(m, e, m.predicted_peak(e), unset)
    assert same == e and same_m == m  # the prediction held
    m2, smaller = back_off(m, e, m.predicted_peak(e) + 6 * GB, unset)
    assert m2.peak == 16 * GB and m2.predicted_peak(smaller) <= m.budget
    assert (smaller.keep_activations, smaller.cache_weights) == (8, 8)  # 16 + 8 x 3 = 40
    m3, after = after_out_of_memory(m, e, unset)
    assert m3.budget == 25 * GB and after.keep_activations == 5 and m3.capacity == 0  # half of the 30 GB it added
    # The allocator held 20 GB when it ran out: the device gives no more, so the budget is 92 % of that, and
    # stays so (a later back-off that saw more does not raise it)
    m4, after4 = after_out_of_memory(m, e, unset, held=20 * GB)
    assert m4.capacity == 20 * GB and m4.budget == pytest.approx(0.92 * 20 * GB)
    assert m4.predicted_peak(after4) <= m4.budget and after4.keep_activations == 2  # 10 + 2 x 3 = 16 <= 18.4
    m5, _ = after_out_of_memory(m4, after4, unset, held=30 * GB)
    assert m5.capacity == 20 * GB and m5.budget <= m4.budget
    tiny = Measured(peak=10 * GB, kept_graph=2 * GB, block_weights=1 * GB, budget=13.5 * GB, layers=36)
    one = by_measurement(tiny, EngineConfig())
    assert one.keep_activations == 1
    _, last = after_out_of_memory(tiny, one, unset)
    assert last == EngineConfig().filled()  # down to the streaming placement


# ---------------------------------------------------------------------------------- trying and backing off
class _Device:
    """A device that holds the activations of at most ``capacity`` kept blocks: a block call in a step that
    keeps more raises torch.OutOfMemoryError, in its forward or in its backward (``where``), as CUDA would.
    Only while ``engine`` is set (the megatrain run); the CPU has no device memory of its own to run out of."""

    engine = None
    capacity, where, raised = 1, "forward", 0

    @classmethod
    def full(cls) -> bool:
        return cls.engine is not None and len(cls.engine.keep) > cls.capacity

    @classmethod
    def out_of_memory(cls) -> None:
        cls.raised += 1
        raise torch.OutOfMemoryError(f"simulated: {len(cls.engine.keep)} kept blocks, room for {cls.capacity}")


class _RunsOutInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        if _Device.where == "backward" and _Device.full():
            _Device.out_of_memory()
        return g


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Device.where == "forward" and torch.is_grad_enabled() and _Device.full():
            _Device.out_of_memory()
        return _RunsOutInBackward.apply(x + self.down(torch.tanh(self.up(x))))


class _Net(pl.LightningModule):
    def __init__(self, d: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, 1)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(depth))

    def training_step(self, batch, _):
        x, y = batch
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        if _Device.where == "loss" and _Device.full():  # every block ran, the loss's logits do not fit
            _Device.out_of_memory()
        return torch.nn.functional.mse_loss(self.out(h).squeeze(-1), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 8, 16, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum((1, 2)).tanh().expand(8, 64).T),
                                           batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _Measurements(pl.Callback):
    """Wires AutoPlacement as the strategy does on a GPU, and hands it the measurements a GPU's allocator
    would give (the first step: 10 GB at its peak, 1 GB per kept block; the tried one: under the budget)."""

    megatrain_reads_weights = False

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        from megatrain_lightning.auto_placement import AutoPlacement
        from megatrain_lightning.hardware import detect

        strategy = trainer.strategy
        if getattr(strategy, "engine", None) is None:
            return
        _Device.engine = strategy.engine
        strategy.engine.meter.usable_bytes = 100 * GB
        strategy.placement = AutoPlacement(strategy.engine, strategy.config, None, 1, False, detect)
        strategy.precision_plugin.placement = strategy.placement

    def on_train_batch_end(self, trainer: pl.Trainer, module, outputs, batch, batch_idx: int) -> None:
        from megatrain_lightning.engine.device_memory import StepMemory

        placement = getattr(trainer.strategy, "placement", None)
        if placement is not None and placement.phase != "done":
            peak = 10 * GB if placement.phase == "measure" else 11 * GB
            trainer.strategy.engine.meter.measured = StepMemory(peak=peak, kept_graph=1 * GB, batch=8, seq=8)

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        _Device.engine = None


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_runs_out_of_memory_backs_off_and_runs_again_exactly(where: str) -> None:
    _Device.where, _Device.raised = where, 0
    _, got = run_parity(_Net, megatrain(), max_steps=6, callbacks=[_Measurements()])
    summary = got.trainer.strategy.placement_summary
    log = summary["log"]
    assert log[0].startswith("placement chosen from the first step") and "keep_activations=4" in log[0], log
    assert _Device.raised == summary["backed_off"] >= 1 and all("ran out of device memory" in m for m in log[1:-1])
    assert summary["phase"] == "done" and summary["keep_activations"] <= _Device.capacity
    assert log[-1].startswith("placement tried: peak 11.0 GB"), log


@pytest.mark.parametrize("where,module,precision", [("forward", "net", "32-true"), ("loss", "net", "32-true"),
                                                    ("backward", "net", "32-true"), ("loss", "hf", "bf16-mixed")])
def test_the_activations_of_a_step_that_ran_out_of_memory_are_freed(where: str, module: str, precision: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed attempt's kept blocks built graphs (their activations: on a GPU, device memory). When the
    strategy backs off, nothing may hold them, or the next attempt runs out of memory no one uses. Counted
    at each back-off (and after the fit) as the live tensors that still have a ``grad_fn``: between attempts
    no graph may exist. A node that saves its own output (attention's, tanh's) once held it through the
    block call's saved-tensor hooks, a cycle Python's collector cannot see: 12 to 96 such tensors here."""
    import gc

    from megatrain_lightning.auto_placement import AutoPlacement

    def live() -> list[torch.Tensor]:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None]

    before = {id(t) for t in live()}  # what earlier tests of this process left alive is not this run's

    def graphs() -> list[str]:
        return [t.grad_fn.name() for t in live() if id(t) not in before]

    seen: list[list[str]] = []
    out_of_memory = AutoPlacement.out_of_memory

    def counting(self: AutoPlacement) -> None:
        seen.append(graphs())
        out_of_memory(self)

    monkeypatch.setattr(AutoPlacement, "out_of_memory", counting)
    _Device.where, _Device.raised = where, 0
    got = fit(_Net if module == "net" else _HFNet, megatrain(), max_steps=3, callbacks=[_Measurements()],
              precision=precision)
    assert got.trainer.strategy.placement_summary["backed_off"] == len(seen) >= 1
    seen.append(graphs())
    assert not any(seen), f"tensors of a graph alive at each back-off and after the fit: {seen}"


class _HFNet(pl.LightningModule):
    """A tiny Hugging Face Qwen2 with its own loss, as in tests/test_auto_placement_cuda.py, whose loss
    function does not fit while more than ``_Device.capacity`` blocks are kept (inside ``ForCausalLMLoss``,
    at the logits' upcast, is where it ran out on the H200)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, Qwen2Config
        from transformers.loss.loss_utils import ForCausalLMLoss

        config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64, use_cache=False, tie_word_embeddings=False)
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

        def loss(logits, labels, vocab_size, **kwargs):
            if _Device.where == "loss" and _Device.full():
                _Device.out_of_memory()
            return ForCausalLMLoss(logits, labels, vocab_size, **kwargs)

        self.model.loss_function = loss

    def training_step(self, batch, _):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 64, (32, 16), generator=g)),
                                           batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
