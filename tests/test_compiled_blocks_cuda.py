"""Compiled blocks and Liger Kernel on the GPU (skipped without CUDA; Liger's cases without liger_kernel).

    python -m pytest -q -s tests/test_compiled_blocks_cuda.py     # -s shows the printed figures

(a) fp32, TF32 off, ``compile_blocks=True`` with 2 of 6 blocks kept saving matmul outputs and the rest recomputed:
    every loss of 20 steps within 1e-4 of Lightning's default strategy, every weight within 1e-3 (as the eager
    path's bar, tests/test_parity_cuda.py (a)); the compiled functions really ran.
(b) bf16-mixed: the default (compiled under mixed precision) against ``compile_blocks=False``, 30 steps of a
    ~100M-parameter Llama: the mean of the last 10 losses within 1%.
(c) a plain Hugging Face Qwen2 with Liger Kernel applied by the module (``_apply_liger_kernel_to_instance``):
    ``kept_saves="matmuls"`` set by hand is refused by name; left open, kept blocks keep every activation, nothing
    is compiled, and bf16 training follows Lightning's default strategy on the same Liger module (last-10 mean
    within 1%).
(d) a tiny GPT-OSS (experts on ``grouped_mm_gather``) with ``compile_blocks=True``: compiled around its experts
    (eager), one block kept saving matmul outputs (the experts under their own selective checkpoint), fp32 with TF32
    off: 10 steps at the bar of (a) against Lightning's default strategy.
(e) a tiny Qwen3-MoE (experts on ``grouped_mm_gather``, no biases): compiled inside its blocks' graphs, the same.
(f) the same Qwen3-MoE in bf16-mixed, where its experts run torch's grouped GEMM inside the compiled graphs (fp32 takes
    transformers' fallback op): the default against ``compile_blocks=False``, the mean of the last 10 of 30 losses
    within 1%; and with its router loss, the kept block compiled whole with the recording hook inside its graph at
    every step but the first.
(g) router auxiliary losses (``router_aux_loss_coef=0.5``, HF's own ``outputs.loss``) on tiny Mixtral, Qwen3-MoE and
    GPT-OSS (experts on ``grouped_mm_gather``), ``compile_blocks=True``, one block kept saving matmul outputs: fp32 at
    the bar of (a). Blocks compile while router logits are recorded (a graph break at the recording hook,
    ``engine/compiled.py``). A kept one compiled whole with its checkpoint (Mixtral's and Qwen3-MoE's, experts inside)
    would compile with the hook inside its graph (``side_outputs.in_one_graph``), but in fp32 transformers' fallback
    grouped mm (5.17) cannot be traced whole and it runs eager after one failed compilation, as in (e); (f) runs it
    compiled, in bf16.
(h) a model compiled whole by its module (``torch.compile(self.model)``, inductor) with ``compile_blocks=True``: the
    streamed blocks break the user's graph and run the engine eager, their own compiled functions inside (dynamo
    compiles none of the engine's code); fp32 at the bar of (a) against the default strategy on the same module.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from conftest import (assert_is_megatrain, compare_losses, compare_states, fit, megatrain, package_files, rel_diff,
                      traced_by_dynamo)
from megatrain_lightning.config import STREAMING
from megatrain_lightning.engine import side_outputs
from megatrain_lightning.engine.compiled import CompiledBlocks
from megatrain_lightning.errors import ConfigError
from megatrain_lightning.models import expert_routing  # noqa: F401  registers "grouped_mm_gather"
from test_parity_cuda import CUDA, _fp32_factory, _free_cuda, no_tf32  # noqa: F401 (a fixture)
from zoo import ZOO, LlamaLM

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


@pytest.fixture
def compiled_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per compiled block call: whether it ran compiled whole (one graph, not a failed compilation's
    eager fallback) while router logits were recorded."""
    calls: list[bool] = []
    call = CompiledBlocks.call

    def counted(self: CompiledBlocks, block: int, original: Any, module: Any, args: tuple, kwargs: dict,
                matmuls_only: bool = False) -> Any:
        whole = self._fullgraph(block, matmuls_only) and side_outputs.recording()
        out = call(self, block, original, module, args, kwargs, matmuls_only)
        calls.append(whole and (original, matmuls_only, block in self.around_experts) not in self._failed)
        return out

    monkeypatch.setattr(CompiledBlocks, "call", counted)
    return calls


def _compiled_fp32_parity(label: str, factory: Any, placement: dict, steps: int, compiled_calls: list[bool],
                          compiles: bool = True) -> None:
    """``steps`` fp32 steps (TF32 off) with ``placement`` compiled against Lightning's default strategy, at the bar of
    the eager path (tests/test_parity_cuda.py (a)): every loss within 1e-4, every weight within 1e-3; with
    ``compiles``, compiled block calls ran."""
    ref = fit(factory, None, max_steps=steps, precision="32-true", **CUDA)
    got = fit(factory, megatrain(**{**STREAMING, **placement, "compile_blocks": True}), max_steps=steps,
              precision="32-true", **CUDA)
    assert_is_megatrain(got)
    worst_loss = max(abs(g - r) / abs(r) for r, g in zip(ref.losses, got.losses))
    worst_param = max(rel_diff(ref.state[k], got.state[k]) for k in ref.state)
    print(f"\n{label}, fp32 TF32-off, {steps} steps: worst loss rel diff {worst_loss:.2e}, worst param "
          f"{worst_param:.2e}; {len(compiled_calls)} compiled block calls ({sum(compiled_calls)} whole while "
          "recording)")
    assert len(compiled_calls) > 0 or not compiles
    compare_losses(ref.losses, got.losses, rtol=1e-4)
    compare_states(ref.state, got.state, rtol=1e-3)


def test_cuda_compiled_blocks_fp32_parity(no_tf32: None, compiled_calls: list[bool]) -> None:  # noqa: F811 (the fixture)
    _compiled_fp32_parity("(a) compiled, keep 2 (matmuls) of 6", _fp32_factory(),
                          {"slots": 3, "keep_activations": 2, "kept_saves": "matmuls"}, 20, compiled_calls)


class CompiledWholeLlama(LlamaLM):
    """The module compiles its whole Hugging Face model, as Lightning's docs show (``torch.compile(model)``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = torch.compile(self.model)


def test_cuda_a_model_compiled_whole_by_its_module_fp32_parity(no_tf32: None,  # noqa: F811 (the fixture)
                                                               compiled_calls: list[bool]) -> None:
    factory = _fp32_factory()
    torch._dynamo.reset()
    _compiled_fp32_parity("(h) compiled whole by its module, keep 2 (matmuls) of 6",
                          partial(CompiledWholeLlama, **factory.keywords),
                          {"slots": 3, "keep_activations": 2, "kept_saves": "matmuls"}, 10, compiled_calls)
    traced = traced_by_dynamo()
    assert any("modeling_llama" in f for f in traced) and not package_files(traced), traced


def _llama_100m(steps: int) -> Any:
    return partial(LlamaLM, hidden_size=768, num_layers=12, intermediate_size=2048, num_heads=12, vocab_size=8192,
                   task="pattern", period=16, alphabet=256, seq_len=256, batch_size=8, n_train=8 * steps, lr=1e-3,
                   weight_decay=0.1, warmup_steps=5, schedule_steps=steps)


def _last10(losses: list[float]) -> float:
    return sum(losses[-10:]) / 10


def test_cuda_compiled_blocks_bf16_train_like_eager(compiled_calls: list[bool]) -> None:
    steps = 30
    placement = {**STREAMING, "keep_activations": 4, "kept_saves": "matmuls"}
    eager = fit(_llama_100m(steps), megatrain(**placement, compile_blocks=False), max_steps=steps,
                precision="bf16-mixed", **CUDA)
    assert not compiled_calls
    _free_cuda()
    got = fit(_llama_100m(steps), megatrain(**placement), max_steps=steps, precision="bf16-mixed", **CUDA)
    diff = abs(_last10(got.losses) - _last10(eager.losses)) / _last10(eager.losses)
    print(f"\n(b) bf16, 12x768 Llama, keep 4 (matmuls), {steps} steps: last-10 mean eager {_last10(eager.losses):.4f}, "
          f"compiled (the default) {_last10(got.losses):.4f} ({100 * diff:.3f}%); {len(compiled_calls)} compiled calls")
    assert compiled_calls
    assert _last10(got.losses) <= 0.7 * got.losses[0]
    assert diff <= 0.01


class LigerQwen(LlamaLM):
    """A plain Hugging Face Qwen2 whose module applies Liger Kernel to itself, as a Liger user writes it."""

    def build_model(self) -> torch.nn.Module:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from transformers import Qwen2Config, Qwen2ForCausalLM

        hp = self.hparams
        config = Qwen2Config(hidden_size=hp.hidden_size, intermediate_size=hp.intermediate_size,
                             num_hidden_layers=hp.num_layers, num_attention_heads=hp.num_heads, num_key_value_heads=2,
                             vocab_size=hp.vocab_size, use_cache=False, tie_word_embeddings=False,
                             attn_implementation="sdpa")
        model = Qwen2ForCausalLM(config)
        _apply_liger_kernel_to_instance(model=model)
        return model


def test_cuda_liger_kernel_keeps_whole_activations(compiled_calls: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("liger_kernel")
    from transformers.models.qwen2 import modeling_qwen2

    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):  # Liger patches transformers' module itself
        monkeypatch.setattr(modeling_qwen2, name, getattr(modeling_qwen2, name))
    steps = 30
    factory = partial(LigerQwen, hidden_size=512, num_layers=6, intermediate_size=1376, num_heads=8, vocab_size=8192,
                      task="pattern", period=16, alphabet=256, seq_len=256, batch_size=8, n_train=8 * steps, lr=1e-3,
                      warmup_steps=5, schedule_steps=steps)
    with pytest.raises(ConfigError, match="LigerSwiGLUMLP|Liger Kernel.*kept_saves='all'"):
        fit(factory, megatrain(**{**STREAMING, "keep_activations": 2, "kept_saves": "matmuls"}), max_steps=1,
            precision="bf16-mixed", **CUDA)
    _free_cuda()
    ref = fit(factory, None, max_steps=steps, precision="bf16-mixed", **CUDA)
    _free_cuda()
    got = fit(factory, megatrain(**{**STREAMING, "keep_activations": 2, "kept_saves": None}), max_steps=steps,
              precision="bf16-mixed", **CUDA)
    assert_is_megatrain(got)
    chosen = got.trainer.strategy.config
    diff = abs(_last10(got.losses) - _last10(ref.losses)) / _last10(ref.losses)
    print(f"\n(c) Liger Kernel on a 6x512 Qwen2, bf16, {steps} steps: last-10 mean default strategy "
          f"{_last10(ref.losses):.4f}, megatrain {_last10(got.losses):.4f} ({100 * diff:.3f}%); kept_saves "
          f"{chosen.kept_saves}, {len(compiled_calls)} compiled calls")
    assert chosen.kept_saves == "all"
    assert not compiled_calls
    assert _last10(got.losses) <= 0.7 * got.losses[0]
    assert diff <= 0.01


def test_cuda_moe_compiled_around_its_experts_fp32_parity(no_tf32: None,  # noqa: F811 (the fixture)
                                                          compiled_calls: list[bool]) -> None:
    factory = partial(ZOO["gpt_oss"], experts_implementation="grouped_mm_gather", optimizer="adamw", lr=3e-3)
    _compiled_fp32_parity("(d) GPT-OSS compiled around its experts, keep 1 (matmuls)", factory,
                          {"keep_activations": 1, "kept_saves": "matmuls"}, 10, compiled_calls)


def test_cuda_moe_compiled_inside_its_blocks_fp32_parity(no_tf32: None,  # noqa: F811 (the fixture)
                                                        compiled_calls: list[bool]) -> None:
    factory = partial(ZOO["qwen3_moe"], experts_implementation="grouped_mm_gather", optimizer="adamw", lr=3e-3)
    _compiled_fp32_parity("(e) Qwen3-MoE compiled with its experts inside, keep 1 (matmuls)", factory,
                          {"keep_activations": 1, "kept_saves": "matmuls"}, 10, compiled_calls)


@pytest.mark.parametrize("router_loss", [False, True])
def test_cuda_moe_compiled_inside_bf16_trains_like_eager(compiled_calls: list[bool], router_loss: bool) -> None:
    steps = 30
    factory = partial(ZOO["qwen3_moe"], experts_implementation="grouped_mm_gather", optimizer="adamw", lr=3e-3,
                      **({"router_aux_loss_coef": 0.5} if router_loss else {}))
    placement = {**STREAMING, "keep_activations": 1, "kept_saves": "matmuls"}
    eager = fit(factory, megatrain(**placement, compile_blocks=False), max_steps=steps, precision="bf16-mixed", **CUDA)
    assert not compiled_calls
    got = fit(factory, megatrain(**placement), max_steps=steps, precision="bf16-mixed", **CUDA)
    diff = abs(_last10(got.losses) - _last10(eager.losses)) / _last10(eager.losses)
    print(f"\n(f) bf16, tiny Qwen3-MoE{' with its router loss' if router_loss else ''}, keep 1 (matmuls), {steps} "
          f"steps: last-10 mean eager {_last10(eager.losses):.4f}, compiled with its experts inside (the default) "
          f"{_last10(got.losses):.4f} ({100 * diff:.3f}%); {len(compiled_calls)} compiled calls "
          f"({sum(compiled_calls)} whole while recording)")
    assert compiled_calls
    # the kept block, compiled whole with the recording hook inside, at every step but the first (eager, checked)
    assert sum(compiled_calls) == (steps - 1 if router_loss else 0)
    assert _last10(got.losses) < got.losses[0]
    assert diff <= 0.01


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_cuda_router_loss_fp32_parity(no_tf32: None, compiled_calls: list[bool], name: str) -> None:  # noqa: F811
    factory = partial(ZOO[name], experts_implementation="grouped_mm_gather", router_aux_loss_coef=0.5,
                      optimizer="adamw", lr=3e-3)
    _compiled_fp32_parity(f"(g) {name} with its router loss, keep 1 (matmuls)", factory,
                          {"keep_activations": 1, "kept_saves": "matmuls"}, 10, compiled_calls)
