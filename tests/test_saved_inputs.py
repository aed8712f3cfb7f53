"""Saved block inputs split between the device and pinned host memory (``offload_inputs=N``), and stored in
the compute dtype (``saved_inputs_dtype="compute"``).

Partial offload must be exact (CPU fp32 parity with Lightning's default strategy), park exactly the first N
blocks' inputs, and bring each back while the backward of the block after it runs (the first block kept on
the device fetching the last offloaded one). Narrow saved inputs are a no-op in fp32 (exact), and under bf16
really store bf16 (half the bytes), leave the forward untouched and change the gradients by rounding only.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from conftest import megatrain, run_parity
from megatrain_lightning.config import EngineConfig
from megatrain_lightning.engine import StreamingEngine
from test_streaming import BlockNet
from zoo import ZOO

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_config_counts_and_refusals() -> None:
    assert EngineConfig(offload_inputs=True, keep_activations=1).offloaded_blocks(4) == 3
    assert EngineConfig(offload_inputs=2).offloaded_blocks(4) == 2
    assert EngineConfig(offload_inputs=9, keep_activations=1).offloaded_blocks(4) == 3  # clamped to the recomputed
    assert EngineConfig(offload_inputs=False).offloaded_blocks(4) == 0
    assert EngineConfig(offload_inputs=0).offloaded_blocks(4) == 0
    for bad in (-1, 1.5, "all"):
        with pytest.raises(ValueError, match="offload_inputs"):
            EngineConfig(offload_inputs=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="saved_inputs_dtype"):
        EngineConfig(saved_inputs_dtype="bf16")  # type: ignore[arg-type]


@pytest.mark.parametrize("option", [
    dict(offload_inputs=1),
    dict(offload_inputs=2, saved_inputs_dtype="compute"),  # fp32 compute: narrowing is a no-op
    dict(offload_inputs=1, keep_activations=1, cache_weights=2),
])
def test_partial_offload_parity_llama(option: dict) -> None:
    run_parity(partial(ZOO["llama"], optimizer="adamw", lr=3e-3, scheduler=True), megatrain(**option), max_steps=5)


class Fp32ResidualNet(BlockNet):
    """A residual stream kept in fp32 under bf16 autocast, as in Hugging Face decoders (fp32 embeddings)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).float()
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _engine(depth: int, compute_dtype: torch.dtype = torch.float32, **config) -> tuple[BlockNet, StreamingEngine]:
    torch.manual_seed(0)
    module = Fp32ResidualNet(depth=depth)
    engine = StreamingEngine(module, list(module.blocks), torch.device("cpu"), compute_dtype=compute_dtype,
                             config=EngineConfig(**config))
    return module, engine


def _step(module: BlockNet, engine: StreamingEngine, x: torch.Tensor, autocast: bool = False, before_backward=None):
    """One forward and backward through the engine: (output, {name: grad})."""
    engine.open_step()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    if before_backward is not None:
        before_backward()
    out.float().square().mean().backward()
    engine.finish_backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return out.detach(), grads


def test_first_blocks_go_to_the_host_and_come_back_one_block_ahead() -> None:
    """depth 4, offload 2: blocks 0 and 1 on the host, 2 parked as is (it fetches block 1), 3 with autograd."""
    module, engine = _engine(4, offload_inputs=2)
    offload = engine.offload
    log: list[tuple[str, int]] = []
    fetch, unstash = offload._fetch, offload.unstash

    def logged_fetch(stash):
        if stash.on_host and stash.fetched is None and not stash.released:
            log.append(("fetch", stash.index))
        fetch(stash)

    def logged_unstash(stash):
        log.append(("unstash", stash.index))
        return unstash(stash)

    offload._fetch, offload.unstash = logged_fetch, logged_unstash
    seen = {}

    def inspect() -> None:
        seen["host"] = [all(t.device.type == "cpu" and t.is_pinned() == engine.pins.enabled for t in s.parked.values())
                        for s in offload.stashes]
        seen["count"] = len(offload.stashes)

    try:
        _step(module, engine, torch.randn(4, 8), before_backward=inspect)
    finally:
        engine.close()
    assert seen == {"host": [True, True], "count": 2}
    # block 3: autograd's saves, no unstash; block 2 (index -1: on the device) brings back block 1 (index 1)
    # before block 1's backward asks for it, block 1 brings back block 0
    assert log == [("unstash", -1), ("fetch", 1), ("unstash", 1), ("fetch", 0), ("unstash", 0)]


def test_every_block_offloaded_fetches_one_ahead() -> None:
    module, engine = _engine(3, offload_inputs=True)
    log: list[int] = []
    fetch = engine.offload._fetch

    def logged_fetch(stash):
        if stash.fetched is None and not stash.released:
            log.append(stash.index)
        fetch(stash)

    engine.offload._fetch = logged_fetch
    try:
        _step(module, engine, torch.randn(4, 8))
    finally:
        engine.close()
    assert log == [2, 1, 0]  # the last block's own fetch, then each one a block ahead


@pytest.mark.parametrize("offload", [0, 2, True])
def test_narrow_saved_inputs_under_bf16(offload: bool | int) -> None:
    """bf16 compute: the parked inputs are bf16 (half the bytes), the forward is unchanged, the recompute
    differentiates an fp32 tensor (the forward's dtype), and the gradients move by rounding only."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    results = {}
    for dtype in ("input", "compute"):
        module, engine = _engine(3, torch.bfloat16, offload_inputs=offload, saved_inputs_dtype=dtype)
        parked: list[tuple[torch.dtype, int]] = []
        recomputed: list[torch.dtype] = []
        unstash = engine.offload.unstash

        def logged_unstash(stash, unstash=unstash, recomputed=recomputed):
            out = unstash(stash)
            recomputed.extend(t.dtype for t in out if t.is_floating_point() and t.requires_grad)
            return out

        engine.offload.unstash = logged_unstash

        def inspect(engine=engine, parked=parked) -> None:
            stashes = engine.offload.stashes
            parked.extend((t.dtype, t.nbytes) for s in stashes for t in s.parked.values())

        try:
            results[dtype] = _step(module, engine, x, autocast=True, before_backward=inspect) + (parked, recomputed)
        finally:
            engine.close()
    (out_w, grads_w, parked_w, rec_w), (out_n, grads_n, parked_n, rec_n) = results["input"], results["compute"]
    assert torch.equal(out_w, out_n)  # the forward ran on the same (wide) inputs
    assert set(rec_n) <= {torch.float32} and rec_n  # cast back: the recompute sees the forward's dtype
    offloaded = EngineConfig(offload_inputs=offload).offloaded_blocks(3)
    assert [d for d, _ in parked_w] == [torch.float32] * offloaded
    assert [d for d, _ in parked_n] == [torch.bfloat16] * offloaded
    assert [2 * n for _, n in parked_n] == [n for _, n in parked_w]
    worst = max(float((grads_n[k] - grads_w[k]).norm() / grads_w[k].norm()) for k in grads_w)
    changed = [k for k in grads_w if not torch.equal(grads_w[k], grads_n[k])]
    assert changed, "bf16 saved inputs changed no gradient: the rounding did not happen"
    assert worst < 2e-2, worst  # rounding of the recompute's input only (bf16: 2^-9 relative per element)


def test_narrow_inputs_kept_on_the_device_are_bf16() -> None:
    module, engine = _engine(3, torch.bfloat16, saved_inputs_dtype="compute")
    stashes = []
    stash = engine.offload.stash

    def logged_stash(*a, **k):
        s = stash(*a, **k)
        stashes.append([(t.dtype, t.device.type) for t in s.parked.values()])
        return s

    engine.offload.stash = logged_stash
    try:
        _step(module, engine, torch.randn(4, 8), autocast=True)
    finally:
        engine.close()
    assert stashes == [[(torch.bfloat16, "cpu")]] * 3


def test_an_input_parked_as_is_and_changed_in_place_is_refused() -> None:
    """The first block kept on the device parks its input without a copy: an in-place change before the
    backward must fail loudly, as autograd's own saved tensors do."""
    module, engine = _engine(3, offload_inputs=1)
    captured = {}
    hook = module.blocks[1].register_forward_pre_hook(lambda m, args: captured.update(x=args[0]))  # returns None

    def change() -> None:
        with torch.no_grad():
            captured["x"].add_(1.0)

    try:
        with pytest.raises(RuntimeError, match="modified in place"):
            _step(module, engine, torch.randn(4, 8), before_backward=change)
    finally:
        hook.remove()
        engine.abort_step()
        engine.close()


def test_narrow_copies_replace_the_wide_inputs() -> None:
    """The bf16 copy kept on the device must not come on top of the fp32 input: nothing holds the latter."""
    import gc
    import weakref

    module, engine = _engine(3, torch.bfloat16, saved_inputs_dtype="compute")
    inputs: list[weakref.ref] = []
    hooks = [b.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0]))) for b in module.blocks]
    try:
        engine.open_step()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(torch.randn(4, 8))
        gc.collect()
        # the inputs of blocks 1 and 2 (outputs of streamed blocks, fp32) live on as bf16 copies only
        assert len(inputs) == 3 and [r() is None for r in inputs[1:]] == [True, True]
        out.float().square().mean().backward()
        engine.finish_backward()
    finally:
        for h in hooks:
            h.remove()
        engine.close()
