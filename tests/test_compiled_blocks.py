"""Blocks run through torch.compile (``compile_blocks``, ``engine/compiled.py``).

On the CPU (inductor's C++ backend) in fp32 a compiled run must train as Lightning's default strategy does, to
the parity bar of test_parity.py (weights to 1e-4: fused kernels round differently), and must really run compiled:
the streamed blocks' forward without grad, their recompute with grad, a kept block's graph keeping every
activation and a kept block saving matmul outputs only (the selective checkpoint inside the compiled function).
The same for blocks we did not write (torch.nn with dropout, peft's LoRA layers); a failed compilation runs
eager. Left at None, nothing compiles on the CPU. Blocks with Hugging Face's experts: tests/test_compiled_experts.py.
The first test compiles with inductor itself; the others with its graphs but no kernels written (conftest's
``compile_without_codegen``: inductor's cold C++ build was most of this file's time on 2 cores).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from compat_zoo import TokenBlocks, assert_exact, assert_frozen_unchanged, frozen_names
from conftest import compare_losses, compare_states, fit, megatrain, package_files, run_parity, traced_by_dynamo
from lightning.pytorch.callbacks import Callback
from test_compat_frozen import ATTN, LoraLM
from zoo import ZOO, TinyLlama

from megatrain_lightning.blocks import BlockDetectionError
from megatrain_lightning.engine.compiled import compiles_by_default

pytestmark = pytest.mark.usefixtures("one_intra_op_thread", "compile_without_codegen")


@pytest.mark.inductor
@pytest.mark.parametrize("kept_saves", ["matmuls", "all"])
def test_compiled_blocks_train_as_the_default_strategy(kept_saves: str, compiled_calls: list, caplog: Any) -> None:
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    factory = partial(ZOO["qwen2"], optimizer="adamw", lr=3e-3, scheduler=True)
    # fused kernels sum in another order: fp32 rounding, not bit for bit (layer 0's k_proj bias, whose gradient is
    # the smallest, moves most: 1.4e-05 after 4 steps); a wrong gradient would be off by O(1)
    run_parity(factory, megatrain(compile_blocks=True, keep_activations=1, kept_saves=kept_saves), max_steps=4,
               param_rtol=1e-4)
    assert "torch.compile failed" not in caplog.text
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    kinds = set(compiled_calls)
    assert (False, False) in kinds  # a streamed block's forward
    assert (True, False) in kinds  # its recompute (and a kept block keeping all)
    assert ((True, True) in kinds) == (kept_saves == "matmuls")  # a kept block saving matmul outputs only


def test_nothing_compiles_on_the_cpu_by_default(compiled_calls: list) -> None:
    assert not compiles_by_default(torch.device("cpu"), torch.bfloat16)
    assert compiles_by_default(torch.device("cuda"), torch.bfloat16)
    assert not compiles_by_default(torch.device("cuda"), torch.float32)
    run_parity(partial(ZOO["qwen2"], optimizer="adamw", lr=3e-3), megatrain(keep_activations=1), max_steps=2)
    assert compiled_calls == []


@pytest.mark.parametrize("failing", ["saving matmul outputs", "every"])
def test_a_function_that_fails_to_compile_runs_eager_and_trains_the_same(
        failing: str, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Compilation fails (injected: ``torch.compile`` hands back a function raising dynamo's error, as a graph
    break under ``fullgraph`` does): one warning, the call runs eager, later calls take the eager path (a kept
    block's selective recompute rebinding its weights), and training stays at parity."""
    compile_ = torch.compile

    def failing_compile(fn: Any, **kwargs: Any) -> Any:
        if failing == "every" or kwargs.get("fullgraph"):
            def broken(*args: Any, **kw: Any) -> Any:
                raise torch._dynamo.exc.TorchDynamoException("injected compile failure")
            return broken
        return compile_(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", failing_compile)
    factory = partial(ZOO["qwen2"], optimizer="adamw", lr=3e-3)
    with caplog.at_level("WARNING", logger="megatrain_lightning.engine.compiled"):
        run_parity(factory, megatrain(compile_blocks=True, keep_activations=2, kept_saves="matmuls"), max_steps=3,
                   param_rtol=1e-4)
    warned = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warned) == (1 if failing != "every" else 2), warned  # once per function that failed
    assert all("injected compile failure" in w for w in warned)


class CountsMlpCalls(Callback):
    """Registers a forward hook on every block's MLP at the third step (a user's activation statistics would)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            for layer in module.model.model.layers:
                layer.mlp.register_forward_hook(self.count)

    def count(self, *_: Any) -> None:
        self.calls += 1


@pytest.mark.slow
def test_a_hook_registered_mid_run_runs_in_compiled_blocks(compiled_calls: list) -> None:
    """A forward hook a callback registers after the blocks compiled runs in them as in eager blocks: as many calls
    (the forward's and the recompute's) with compile_blocks=True as with False."""
    factory = partial(ZOO["llama"], optimizer="adamw", lr=3e-3)
    counts = []
    for compiled in (False, True):
        hook = CountsMlpCalls()
        fit(factory, megatrain(compile_blocks=compiled, keep_activations=1), max_steps=4, callbacks=[hook])
        counts.append(hook.calls)
    assert compiled_calls and counts[0] > 0 and counts[1] == counts[0], counts


THIRD_PARTY = {
    "nn.TransformerEncoder with dropout": partial(ZOO["encoder"], optimizer="sgd", lr=0.05, momentum=0.9),
    "a Llama, every block kept whole": partial(ZOO["llama"], optimizer="adamw", lr=3e-3),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(THIRD_PARTY))
def test_compiled_modules_we_did_not_write(case: str) -> None:
    """Blocks from torch.nn (dropout: the compiled blocks draw the eager masks, forward and recompute alike) and
    transformers, compiled, train as the default strategy trains them."""
    kept = 99 if case.startswith("a Llama") else 1
    run_parity(THIRD_PARTY[case], megatrain(compile_blocks=True, keep_activations=kept), max_steps=3,
               param_rtol=1e-4)


@pytest.mark.slow
def test_compiled_peft_lora_trains_its_adapters_as_the_default_strategy() -> None:
    """peft's LoRA layers inside compiled blocks: the adapters train as under the default strategy, the frozen
    base weights stay bit for bit."""
    pytest.importorskip("peft")
    factory = partial(LoraLM, arch="qwen2", targets=ATTN)
    ref = fit(factory, None, max_steps=3)
    frozen = frozen_names(ref.module)
    got = fit(factory, megatrain(compile_blocks=True, keep_activations=1, kept_saves="matmuls"), max_steps=3)
    assert_frozen_unchanged(got, frozen, "megatrain")
    compare_losses(ref.losses, got.losses)
    compare_states(ref.state, got.state, rtol=1e-4)


class CompiledByHand(TokenBlocks):
    """Each block replaced by ``torch.compile(block)`` before fit, as a user speeding up the default strategy would."""

    def __init__(self) -> None:
        super().__init__()
        for i, block in enumerate(self.blocks):
            self.blocks[i] = torch.compile(block, backend="eager")


def test_blocks_compiled_by_the_user_are_refused_naming_the_class_to_stream() -> None:
    """The OptimizedModule wrappers were streamed as the blocks: "Module [OptimizedModule] is missing the required
    'forward' function" in the first forward. Refused at setup instead, naming the class they wrap, which then
    trains exactly, with the engine's block calls run eager: dynamo traced them inside the user's compiled frames,
    recompiling each of the engine's functions per block index (132 frames compiled, none now)."""
    with pytest.raises(BlockDetectionError, match=r"OptimizedModule around MLPBlock.*block_class=\"MLPBlock\""):
        fit(CompiledByHand, "megatrain", max_steps=1)
    ref = fit(CompiledByHand, None, max_steps=3)
    torch._dynamo.reset()
    got = fit(CompiledByHand, megatrain(block_class="MLPBlock"), max_steps=3)
    assert_exact(ref, got)
    assert not package_files(traced_by_dynamo())


class CompiledWhole(TinyLlama):
    """The whole Hugging Face model compiled (``torch.compile(model)``), as a user of the default strategy would."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = torch.compile(self.model)


def test_a_model_compiled_whole_by_the_user_trains_as_the_default_strategy() -> None:
    """Its streamed blocks break the graph (their calls and the resident parts' hooks run eager, the engine's code
    untraced: dynamo traced it, 210 frames compiled against 42 now, 19 s for 3 steps against 2); the rest compiles."""
    torch._dynamo.reset()
    run_parity(partial(CompiledWhole, optimizer="adamw", lr=3e-3), megatrain(), max_steps=3, param_rtol=1e-4)
    traced = traced_by_dynamo()
    assert any("modeling_llama" in f for f in traced), traced
    assert not package_files(traced), traced
