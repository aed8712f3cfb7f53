"""Kept activations, cached weights and offloaded block inputs: the options that trade device memory
for speed (``keep_activations``, ``cache_weights``) and link bytes for device memory (``offload_inputs``).

Each must leave training exactly as native (same CPU fp32 parity bar as test_parity.py), and each must
really change what moves: kept blocks are not recomputed and get one weight copy per micro-batch, cached
blocks one per optimizer step, offloaded inputs leave the device between forward and backward.
"""

from __future__ import annotations

import collections
from functools import partial
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from compat_zoo import assert_exact
from conftest import fit, megatrain, run_parity, strategy_of
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.config import EngineConfig
from megatrain_lightning.engine import RESIDENT, StreamingEngine
from test_streaming import BlockNet, CountingProbe, _loader, _trainer
from zoo import ZOO


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


OPTIONS = {
    "keep2": dict(keep_activations=2),
    "keep-all": dict(keep_activations=99),  # more than the blocks: every block kept
    "keep2-matmuls": dict(keep_activations=2, kept_saves="matmuls"),
    "keep-all-matmuls-offload": dict(keep_activations=99, kept_saves="matmuls", offload_inputs=True),
    "cache3-keep1": dict(cache_weights=3, keep_activations=1, slots=3),
    "offload": dict(offload_inputs=True),
    "offload-keep1-cache2": dict(offload_inputs=True, keep_activations=1, cache_weights=2),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_parity_llama_adamw(option: str) -> None:
    run_parity(partial(ZOO["llama"], optimizer="adamw", lr=3e-3, scheduler=True), megatrain(**OPTIONS[option]), max_steps=6)


@pytest.mark.parametrize("option", ["keep2", "offload-keep1-cache2", "keep2-matmuls"])
def test_parity_dropout_and_two_block_lists(option: str) -> None:
    """Dropout masks (encoder) and a second differentiable input per block (nn.Transformer's memory)."""
    for name in ("encoder", "transformer"):
        run_parity(partial(ZOO[name], optimizer="sgd", lr=0.05, momentum=0.9, scheduler=True), megatrain(**OPTIONS[option]), max_steps=5)


@pytest.mark.slow
def test_parity_cached_weights_across_accumulation_and_clipping() -> None:
    """Cached weights must be reloaded after every optimizer step, never within a window."""
    factory = partial(ZOO["llama"], optimizer="sgd", lr=0.5, scheduler=True)
    run_parity(factory, megatrain(cache_weights=3, keep_activations=1), max_steps=4, accumulate_grad_batches=2,
               gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class QuietNet(BlockNet):
    megatrain_reads_weights = False  # its on_before_optimizer_step reads gradients only


def test_kept_blocks_are_not_recomputed_and_cached_blocks_copied_once_per_step() -> None:
    depth = 5
    module = QuietNet(depth=depth)
    probe = CountingProbe()
    strategy = strategy_of(slots=2, keep_activations=2, cache_weights=3)
    _trainer(strategy, max_steps=2, accumulate_grad_batches=2, callbacks=[probe]).fit(module, _loader())
    assert len(probe.rows) == 4
    for micro, (h2d, reused, d2h) in enumerate(probe.rows):
        first_of_window = micro % 2 == 0
        for i in range(depth):
            uses = h2d.get(i, 0) + reused.get(i, 0)
            if i >= 3:  # kept (and cached): one use in the forward, none in the backward
                assert uses == 1, (i, h2d, reused)
            else:
                assert uses == 2, (i, h2d, reused)
            if i >= 2:  # cached: copied on the window's first micro-batch only
                assert h2d.get(i, 0) == (1 if first_of_window else 0), (micro, i, h2d)
            assert d2h[i] == 1
        assert d2h[RESIDENT] == 1


class InspectingNet(BlockNet):
    """Looks at the engine between its forward and its backward."""

    def __init__(self) -> None:
        super().__init__(depth=4)
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch, _):
        loss = super().training_step(batch, _)
        engine = self.trainer.strategy.engine
        offloaded = sum(1 for s in engine.offload.stashes if s.host and all(t is None for t in (s.tensors[i] for i in s.host)))
        self.seen.append((len(engine.offload.stashes), offloaded))
        return loss


def test_offloaded_inputs_leave_the_device_between_forward_and_backward() -> None:
    module = InspectingNet()
    _trainer(strategy_of(offload_inputs=True, keep_activations=1), max_steps=2).fit(module, _loader())
    # 4 blocks, the last one kept: three saved inputs went to host memory, none is held on the device
    assert module.seen == [(3, 3), (3, 3)]


def test_without_offload_inputs_stay_where_they_are() -> None:
    module = InspectingNet()
    _trainer(MegaTrainStrategy(), max_steps=1).fit(module, _loader())
    assert module.seen == [(0, 0)]


def test_counts_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="keep_activations"):
        strategy_of(keep_activations=-1)
    blocks = [torch.nn.Linear(2, 2) for _ in range(3)]
    root = torch.nn.Sequential(*blocks)
    with pytest.raises(ValueError, match="cache_weights=4"):
        StreamingEngine(root, blocks, torch.device("cpu"), config=EngineConfig(cache_weights=4))


def test_offloaded_inputs_are_not_held_by_the_graph() -> None:
    """Offloading frees device memory only if nothing else (the call spec, the graph) holds the input."""
    import gc
    import weakref

    from megatrain_lightning.config import EngineConfig
    from megatrain_lightning.engine import StreamingEngine

    torch.manual_seed(0)
    module = BlockNet(depth=3)
    engine = StreamingEngine(module, list(module.blocks), torch.device("cpu"), config=EngineConfig(offload_inputs=True))
    inputs: list[weakref.ref] = []
    hooks = [b.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0]))) for b in module.blocks]
    try:
        engine.open_step()
        loss = module(torch.randn(4, 8)).square().mean()
        gc.collect()
        # the first block's input is the resident layer's output, which autograd keeps for that layer's
        # own backward; the inputs of blocks 1 and 2 (outputs of streamed blocks) are held by nothing
        assert len(inputs) == 3 and [r() is None for r in inputs[1:]] == [True, True]
        loss.backward()
        engine.finish_backward()
        assert all(p.grad is not None for p in module.parameters())
    finally:
        for h in hooks:
            h.remove()
        engine.close()


class OpCounter(L.Callback):
    """Counts aten ops run during each backward (on the CPU the backward runs on the calling thread)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.mode: Any = None

    def on_before_backward(self, trainer: L.Trainer, module: L.LightningModule, loss: torch.Tensor) -> None:
        counts = self.counts

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                counts[func] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.mode.__exit__(None, None, None)


@pytest.mark.parametrize("depth", [3])
def test_kept_blocks_saving_matmuls_recompute_elementwise_ops_only(depth: int) -> None:
    """A recomputed block reruns its matmuls in the backward; a kept one does not; a kept one that saves
    only matmul outputs reruns its elementwise ops (here the GELU) but still not its matmuls."""
    seen = {}
    for name, kw in {"recomputed": {}, "kept": dict(keep_activations=depth),
                     "kept-matmuls": dict(keep_activations=depth, kept_saves="matmuls")}.items():
        probe = OpCounter()
        _trainer(strategy_of(**kw), max_steps=1, callbacks=[probe]).fit(BlockNet(depth=depth), _loader())
        seen[name] = probe.counts
    aten = torch.ops.aten
    linear = lambda c: c[aten.addmm.default] + c[aten.mm.default]  # noqa: E731
    assert seen["recomputed"][aten.gelu.default] == depth
    assert seen["kept"][aten.gelu.default] == 0
    assert seen["kept-matmuls"][aten.gelu.default] == depth
    assert linear(seen["kept"]) == linear(seen["kept-matmuls"]) < linear(seen["recomputed"])
    assert linear(seen["recomputed"]) - linear(seen["kept"]) == 2 * depth  # fc1 and fc2, forward again


def test_unknown_kept_saves_is_refused() -> None:
    with pytest.raises(ValueError, match="kept_saves"):
        strategy_of(kept_saves="some")


class MatmulOutputScaledInPlace(nn.Module):
    """Writes a Linear's output in place (``h.mul_``): exact when recomputed or kept whole; a kept block that
    saves only the matmul outputs reads the saved output, which the write changed."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        h.mul_(1.5)
        return x + self.fc2(torch.nn.functional.gelu(h))


def test_a_kept_block_writing_a_matmul_output_in_place_is_refused_with_the_fix() -> None:
    """Was torch's own "Tensor cached during selective activation checkpoint has been mutated" mid-backward."""
    from compat_zoo import TokenBlocks

    class Blocks(TokenBlocks):
        block_cls = MatmulOutputScaledInPlace

    ref = fit(Blocks, None, max_steps=2)
    assert_exact(ref, fit(Blocks, megatrain(keep_activations=2, kept_saves="all"), max_steps=2))
    with pytest.raises(RuntimeError, match=r"\(MatmulOutputScaledInPlace\) with kept_saves='matmuls'.*kept_saves='all'"):
        fit(Blocks, megatrain(keep_activations=2, kept_saves="matmuls"), max_steps=2)
