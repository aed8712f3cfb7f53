"""bf16-mixed on the CPU: ``strategy="megatrain"`` trains like Lightning's own bf16-mixed, step for step.

Lightning's bf16-mixed keeps fp32 weights and autocasts the matmuls; the ops outside autocast's lists
(RMSNorm gains, residual adds) read the fp32 weights. The engine computes blocks from bf16 copies of the
masters, so it keeps the one-dimensional weights (norm gains, biases) of each device slot in fp32
(``engine/slots.py``) and sends their gradients home in fp32, also beside bf16 gradients
(``FlatStore.hold_half_grad``). Before, those gains were rounded to bf16 in the forward: after 30 steps of
the embedded arithmetic task the losses differed by 1.1e-4 and the weights by 7.8e-4, and over 1,000
steps the run reached 53-96 % exact match where Lightning's reached 99.5 %.

Weights of more dimensions that an op other than a matmul reads (a layer scale, GPT-OSS's expert biases, peft's IA3
vectors) are found by each block's first call and held in fp32 too, the step run again (``engine/wide_weights.py``):
the second half of this file, each case of which drifted before.
"""

from __future__ import annotations

import logging
import warnings
from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compat_zoo import CausalLMModule, build_causal_lm
from conftest import assert_is_megatrain, compare_losses, compare_states, fit, megatrain, resolve_strategy
from megatrain_lightning.engine.wide_weights import GraphNodes, NarrowRead, dtype_reads, narrow_reads, outputs_and_gradients
from zoo import LoraGptOss, ScaledBlock, ScaledBlocks, TinyGptOss, TinyLlama, TinyQwen2, TinyQwen3Moe, UserBlocks, VOCAB

STEPS = 12


@pytest.mark.parametrize(
    ("factory", "engine"),
    [
        (TinyLlama, dict()),  # the defaults: overlapped updates, bf16 gradients where the kernel builds
        (TinyLlama, dict(bf16_grads=False, overlap_optimizer=False)),  # fp32 gradients, the host step after the backward
        (TinyQwen2, dict(keep_activations=1, cache_weights=2)),  # q/k/v biases; a kept and a cached block
        (TinyQwen2, dict(kept_saves="matmuls", keep_activations=2, grad_buffers=2)),  # selective saves, pooled grads
        # the embedding and the first block updated where their gradients are (its bf16 ones widened there,
        # its fp32 norm gains into the slot's fp32 copies): a streamed first block, then a cached one
        (TinyLlama, dict(update_on_device=True)),
        (TinyQwen2, dict(update_on_device=True, cache_weights=3)),
        (TinyQwen2, dict(update_on_device=3, cache_weights=3)),  # every block updated in its fixed slot
    ],
    ids=["llama-defaults", "llama-fp32-grads", "qwen2-keep-cache", "qwen2-matmuls-pool", "llama-on-device",
         "qwen2-on-device-cached", "qwen2-all-blocks-on-device"],
)
def test_bf16_mixed_matches_lightning_step_for_step(factory: Any, engine: dict, one_intra_op_thread: Any) -> None:
    ref = fit(factory, None, precision="bf16-mixed", max_steps=STEPS)
    got = fit(factory, megatrain(**engine), precision="bf16-mixed", max_steps=STEPS)
    assert_is_megatrain(got)
    compare_losses(ref.losses, got.losses, rtol=0.0)  # the same bits
    # the weights: within what the order of fused AdamW's and torch's for-each AdamW's operations gives
    compare_states(ref.state, got.state, rtol=1e-7)


# ---- weights of two or more dimensions read outside autocast's matmuls (engine/wide_weights.py) ----------------------


@pytest.mark.parametrize(
    ("factory", "engine", "widened"),
    [
        (ScaledBlocks, dict(), 4),  # a layer scale per block; a dropout
        (ScaledBlocks, dict(keep_activations=1, update_on_device=True), 4),  # a kept block; one updated on the device
        (ScaledBlocks, dict(bf16_grads=False, cache_weights=2), 4),  # fp32 gradients; cached blocks
        (TinyGptOss, dict(), 8),  # its experts' biases, (experts, dim), gathered per token and added
        (TinyGptOss, dict(keep_activations=1, overlap_optimizer=False), 8),
        (partial(ScaledBlocks, frozen_scale=True), dict(), 4),  # frozen: they compute in fp32 under Lightning too
        (LoraGptOss, dict(), 8),
    ],
    ids=["layer-scale", "layer-scale-kept-on-device", "layer-scale-fp32-grads-cached", "gpt-oss", "gpt-oss-kept",
         "frozen-layer-scale", "gpt-oss-lora"],
)
def test_weights_read_outside_autocast_matmuls_train_as_under_lightning(
        factory: Any, engine: dict, widened: int, one_intra_op_thread: Any, caplog: Any) -> None:
    """Lightning's bf16-mixed reads such a weight in fp32; the engine held it in bf16 in the slots before, and the run
    drifted silently (GPT-OSS, 6 steps: 4.0e-4 in the loss, 9.1e-2 in the weights, relative). Now the first call
    finds it, it is held in fp32 on the device from then on and the first step runs again: the same bits."""
    if factory is LoraGptOss:
        pytest.importorskip("peft")
    ref = fit(factory, None, precision="bf16-mixed", max_steps=STEPS)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning.strategy"):
        got = fit(factory, megatrain(**engine), precision="bf16-mixed", max_steps=STEPS)
    assert_is_megatrain(got)
    said = [r.getMessage() for r in caplog.records if "outside autocast's matmuls" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"MegaTrainStrategy: {widened} weights"), said
    compare_losses(ref.losses, got.losses, rtol=0.0)
    compare_states(ref.state, got.state, rtol=1e-7)


def test_weights_read_only_by_matmuls_stay_narrow(one_intra_op_thread: Any, caplog: Any) -> None:
    """A 3-d expert weight read by matmuls only, a Llama's projections: nothing widened, no step run again."""
    for factory in (TinyLlama, TinyQwen3Moe):
        with caplog.at_level(logging.INFO, logger="megatrain_lightning.strategy"):
            got = fit(factory, megatrain(), precision="bf16-mixed", max_steps=2)
        assert_is_megatrain(got)
        assert not [r for r in caplog.records if "outside autocast's matmuls" in r.getMessage()]


def test_grouped_gemm_experts_are_named_at_setup(one_intra_op_thread: Any) -> None:
    """transformers' grouped GEMM experts cast the tokens to the weights' dtype: fp32 under Lightning's bf16-mixed, bf16
    here (held in fp32 they would run most of an MoE's work in fp32). Not silent: a warning at setup names them and
    the fix; on the eager experts the run is Lightning's bits and nothing is said."""
    grouped = partial(TinyQwen3Moe, experts_implementation="grouped_mm")
    with pytest.warns(UserWarning, match=r"Qwen3MoeExperts compute their grouped GEMMs in bf16 .*experts_implementation"):
        got = fit(grouped, megatrain(), precision="bf16-mixed", max_steps=2)
    assert_is_megatrain(got)
    ref = fit(grouped, None, precision="bf16-mixed", max_steps=2)
    assert ref.losses != got.losses  # what the warning says (if they ever agree, it is no longer needed)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*compute their grouped GEMMs")
        got = fit(TinyQwen3Moe, megatrain(), precision="bf16-mixed", max_steps=2)
    compare_losses(fit(TinyQwen3Moe, None, precision="bf16-mixed", max_steps=2).losses, got.losses, rtol=0.0)


def _reads(build: Callable[[list[torch.Tensor]], torch.Tensor], *shapes: tuple[int, ...]) -> dict[int, str]:
    weights = [torch.randn(*s, dtype=torch.bfloat16).requires_grad_() for s in shapes]
    watch = GraphNodes({id(w): i for i, w in enumerate(weights)})
    with torch.autocast("cpu", dtype=torch.bfloat16), watch:
        out = build(weights)
    return {**watch.reads, **narrow_reads(out, weights, range(len(weights)), watch.nodes)}


def test_narrow_reads_names_the_op_that_reads_a_weight_outside_matmuls() -> None:
    x = torch.randn(2, 3, 8)
    ids = torch.tensor([[0, 1, 2], [3, 4, 0]])
    assert _reads(lambda w: F.linear(x, w[0]) @ w[1].t().contiguous()[:, :2], (8, 8), (4, 8)) == {}
    assert _reads(lambda w: torch.einsum("bsi,eij->bsej", x, w[0]), (2, 8, 4)) == {}  # views, then a bmm
    assert _reads(lambda w: F.linear(x, w[0]) * w[1], (8, 8), (1, 8)) == {1: "MulBackward0"}  # a layer scale
    assert _reads(lambda w: F.embedding(ids, w[0]) + x, (5, 8)) == {0: "AddBackward0"}  # CLIP's position embedding
    assert _reads(lambda w: F.embedding(ids, w[0]), (5, 8)) == {0: "EmbeddingBackward0"}  # it leaves the block so
    assert _reads(lambda w: F.embedding(ids, w[0]) @ w[1], (5, 8), (8, 4)) == {}  # gathered, then a matmul
    assert _reads(lambda w: x @ torch.exp(w[0].float()), (8, 4)) == {0: "ExpBackward0"}  # Mamba's A_log
    assert _reads(lambda w: F.linear(x, w[0]) + w[1][ids], (8, 8), (5, 8)) == {1: "AddBackward0"}  # expert biases
    assert _reads(lambda w: x @ w[0].float(), (8, 4)) == {}  # widened, then cast back by autocast's matmul

    def fp32_matmul(w: list[torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return x @ w[0].float()

    assert _reads(fp32_matmul, (8, 4)) == {0: "MmBackward0"}  # a matmul in fp32: Lightning's reads the fp32 weight

    def detached_norm(w: list[torch.Tensor]) -> torch.Tensor:  # DoRA's: the norm leaves the graph
        return F.linear(x, w[0]) / torch.linalg.norm(w[0].float() + 1, dim=1).detach()

    assert _reads(detached_norm, (8, 8)) == {0: "AddBackward0"}

    def through_data(w: list[torch.Tensor]) -> torch.Tensor:  # SHiRA's: an update added into its base's .data
        merged = w[0].data.clone()
        merged += 0.5
        return F.linear(x, merged)

    assert _reads(through_data, (8, 8)) == {0: "add_"}
    assert _reads(lambda w: F.linear(x, w[0].data.clone().t().t()), (8, 8)) == {}  # moved, then a matmul

    def under_no_grad(w: list[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            scale = w[0].abs().amax()
        return F.linear(x, w[0]) / scale

    assert _reads(under_no_grad, (8, 8)) == {0: "abs"}


def test_dtype_reads_finds_a_weight_whose_dtype_sets_another_tensors() -> None:
    """peft's LoRA casts its input to lora_A's dtype before its dropout: fp32 under Lightning's bf16-mixed. lora_B
    starts at zeros, which would hide it; the probe binds random values there."""
    x = torch.randn(4, 8)
    lora_a, lora_b, base = (torch.randn(2, 8).bfloat16(), torch.zeros(8, 2).bfloat16(), torch.randn(8, 8).bfloat16())

    def run(swaps: dict[int, torch.Tensor], dropout: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        a, b, w = (swaps.get(i, t) for i, t in enumerate((lora_a, lora_b, base)))
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x.to(a.dtype)
            h = F.dropout(h, 0.1) if dropout else h
            return [F.linear(x, w) + F.linear(F.linear(h, a), b)], []

    assert dtype_reads(partial(run, dropout=True), [lora_a, lora_b, base], [0, 1, 2]) == {0: "its dtype"}
    assert dtype_reads(partial(run, dropout=False), [lora_a, lora_b, base], [0, 1, 2]) == {}  # rounded the same


def test_dtype_reads_finds_a_weight_whose_dtype_sets_where_gradients_meet() -> None:
    """T5's feed-forward casts its hidden states to its output weight's dtype when they differ: under Lightning's
    bf16-mixed (fp32 weights) the gradients of that weight's base and LoRA paths meet in fp32 before the cast, here in
    bf16. The forward rounds to the same bits either way; the backward does not (a LoRA on a T5, an fp32 base, LoRA's
    dropout on: 2.3e-4 in the loss after 3 steps; the outputs alone show nothing)."""
    x = torch.randn(4, 8, requires_grad=True)
    wo, lora_a, lora_b = torch.randn(8, 8).bfloat16(), torch.randn(2, 8).requires_grad_(), torch.randn(8, 2).requires_grad_()

    def run(swaps: dict[int, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        w = swaps.get(0, wo)
        call = lambda args, kwargs: _t5_wo(args[0], w, lora_a, lora_b)  # noqa: E731
        return outputs_and_gradients(call, (x,), {}, [w, lora_a, lora_b])

    assert dtype_reads(run, [wo, lora_a, lora_b], [0]) == {0: "its dtype"}
    out, grads = run({})
    assert len(out) == 1 and len(grads) == 3  # the input's, lora_A's and lora_B's


def _t5_wo(h: torch.Tensor, wo: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = F.linear(h, torch.eye(8))  # bf16, as T5's wi under autocast
        if h.dtype != wo.dtype:
            h = h.to(wo.dtype)
        torch.manual_seed(0)  # LoRA's dropout: its gradient, scaled by 1 / 0.9, is no bf16 value
        return F.linear(h, wo) + F.linear(F.linear(F.dropout(h.to(lora_a.dtype), 0.1), lora_a), lora_b)


def test_a_validation_first_without_inference_mode_widens_there(one_intra_op_thread: Any, caplog: Any) -> None:
    """Trainer(inference_mode=False): the sanity check's validation runs the blocks' first calls with a graph (under
    no_grad), so the weights to widen are found there, and the validation step runs again: its losses, the training
    losses and the weights are Lightning's bits."""
    factory = partial(ScaledBlocks, n_val=8)
    kwargs = dict(precision="bf16-mixed", max_steps=4, inference_mode=False, num_sanity_val_steps=1,
                  limit_val_batches=2, val_check_interval=2)
    ref = fit(factory, None, **kwargs)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning.strategy"):
        got = fit(factory, megatrain(), **kwargs)
    assert_is_megatrain(got)
    assert len([r for r in caplog.records if "outside autocast's matmuls" in r.getMessage()]) == 1
    assert len(ref.module.val_losses) == len(got.module.val_losses) == 5  # the sanity check's batch, then 2 x 2
    assert ref.module.val_losses == got.module.val_losses
    compare_losses(ref.losses, got.losses, rtol=0.0)
    compare_states(ref.state, got.state, rtol=1e-7)


class _Predicts(ScaledBlocks):
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.compute_loss(batch)


def test_validate_and_predict_alone_read_the_weights_as_lightning(one_intra_op_thread: Any, caplog: Any) -> None:
    """trainer.validate and trainer.predict with no training step (a trained checkpoint evaluated): under inference_mode
    the first call builds a graph outside it for the check alone, finds the layer scales read outside the matmuls, and
    the losses are Lightning's bits (before, read in bf16: 4.79618 against 4.79623)."""
    import lightning.pytorch as pl

    def run(strategy: Any) -> tuple[list[float], list[torch.Tensor], dict[str, torch.Tensor]]:
        pl.seed_everything(0, verbose=False)
        module = _Predicts(n_val=8)
        trainer = pl.Trainer(strategy=resolve_strategy(strategy), accelerator="cpu", devices=1, precision="bf16-mixed",
                             logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
                             limit_predict_batches=2, max_steps=2, num_sanity_val_steps=0, enable_checkpointing=False)
        trainer.validate(module, verbose=False)
        predicted = trainer.predict(module, module.val_dataloader())
        trainer.fit(module)  # then trained: the weights widened in the predict step live outside inference mode
        return list(module.val_losses), predicted, {k: v.detach().clone() for k, v in module.state_dict().items()}

    ref = run(None)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning.strategy"):
        got = run(megatrain())
    assert any("outside autocast's matmuls" in r.getMessage() for r in caplog.records)
    assert ref[0] == got[0] and len(ref[0]) >= 2
    assert len(ref[1]) == len(got[1]) == 2
    for a, b in zip(ref[1], got[1]):
        assert torch.equal(a, b)
    compare_states(ref[2], got[2], rtol=1e-7)


class PeftScalingLM(CausalLMModule):
    """A tiny Llama under one of peft's methods whose weights of two dimensions an op outside the matmuls reads: IA3's
    scaling vectors (a mul), LoKr's Kronecker factors, OFT's skew-symmetric blocks (an index_put), HRA's reflections
    (a norm); LoHa, C3A and RandLoRA compute theirs inside their own autograd.Function. Under Lightning's bf16-mixed
    those read fp32; each drifted here before they were widened."""

    def __init__(self, method: str = "ia3", bf16_base: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def build(self) -> Any:
        import peft

        attn = ["q_proj", "v_proj"]
        config = {
            "ia3": lambda: peft.IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", "down_proj"],
                                          feedforward_modules=["down_proj"]),
            "lokr": lambda: peft.LoKrConfig(r=4, alpha=8, target_modules=attn),
            "oft": lambda: peft.OFTConfig(r=0, oft_block_size=8, target_modules=attn),
            "hra": lambda: peft.HRAConfig(r=4, target_modules=attn),
            "loha": lambda: peft.LoHaConfig(r=4, alpha=8, target_modules=attn),
            "c3a": lambda: peft.C3AConfig(block_size=8, target_modules=attn),
            "randlora": lambda: peft.RandLoraConfig(r=4, target_modules=attn),
            # the input cast to lora_A's dtype (fp32 under Lightning's), then dropped out: lora_A's dtype matters
            "lora-dropout": lambda: peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=attn),
            # that cast again, and DoRA's weight norm (detached) reads the base weight
            "dora": lambda: peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=attn),
            "miss": lambda: peft.MissConfig(r=4, target_modules=attn),  # the input cast to the adapter's dtype
            "shira": lambda: peft.ShiraConfig(r=4, target_modules=attn),  # the base weight read through .data
        }[self.hparams.method]()
        base = build_causal_lm("llama")
        # from_pretrained(torch_dtype=torch.bfloat16): a bf16 base, peft's adapters fp32
        return peft.get_peft_model(base.to(torch.bfloat16) if self.hparams.bf16_base else base, config)


@pytest.mark.parametrize(("method", "bf16_base"), [
    *[(m, False) for m in ("ia3", "lokr", "oft", "hra", "loha", "c3a", "randlora", "lora-dropout", "dora", "miss", "shira")],
    # on a bf16 base (its frozen norm gains were held in fp32 on the device: the norms' outputs were fp32)
    ("ia3", True), ("lora-dropout", True), ("dora", True)])
def test_peft_weights_read_outside_matmuls_train_as_under_lightning(method: str, bf16_base: bool,
                                                                    one_intra_op_thread: Any, caplog: Any) -> None:
    pytest.importorskip("peft")
    factory = partial(PeftScalingLM, method=method, bf16_base=bf16_base)
    ref = fit(factory, None, precision="bf16-mixed", max_steps=6)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning.strategy"):
        got = fit(factory, megatrain(), precision="bf16-mixed", max_steps=6)
    assert_is_megatrain(got)
    assert any("outside autocast's matmuls" in r.getMessage() for r in caplog.records)
    compare_losses(ref.losses, got.losses, rtol=0.0)
    compare_states(ref.state, got.state, rtol=1e-7)


class _LaterBlock(ScaledBlock):
    """A second class of blocks, first called after the training step's optimizer step."""


class StepsBetween(ScaledBlocks):
    """Manual optimisation: the first blocks, an optimizer step, then blocks of another class for the first time."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(dropout=0.0, **kwargs)
        self.automatic_optimization = False
        self.later = nn.ModuleList([_LaterBlock(32, 64, 0.0) for _ in range(2)])

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt = self.optimizers()
        (x,) = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        loss = self.head(self.norm(h)).float().logsumexp(-1).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        h = h.detach()
        for block in self.later:
            h = block(h)
        return loss


def test_a_block_first_called_after_an_optimizer_step_is_refused_not_run_again(one_intra_op_thread: Any) -> None:
    """The step cannot run again once its optimizer stepped (its update would apply twice): the error says so."""
    fit(StepsBetween, None, precision="bf16-mixed", max_steps=2)
    with pytest.raises(NarrowRead, match="_LaterBlock") as info:
        fit(StepsBetween, megatrain(), precision="bf16-mixed", max_steps=2)
    assert any("cannot run again" in note for note in getattr(info.value, "__notes__", []))


# ---- a block handed a container it writes into: the dtype probe runs it again (engine/call_containers.py) ----------


class NotingBlock(nn.Module):
    """x + up(dropout(x cast to up's dtype)) (peft's LoRA casts its input so: fp32 under Lightning's bf16-mixed, so
    the dropout runs in fp32), noting its input's mean under its index in the mapping it is handed (a user's
    logging; Gemma4's layers are handed its ``shared_kv_states`` so)."""

    def __init__(self, dim: int, index: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)
        self.index = index

    def forward(self, x: torch.Tensor, noted: dict) -> torch.Tensor:
        noted[self.index] = x.detach().float().mean().item()
        return x + self.up(self.drop(x.to(self.up.weight.dtype)))


class Notes(dict):
    """What the blocks note: a class of its own, as Gemma4's ``KVSharingDict`` (torch's pytree leaves it whole, so
    the blocks write into the caller's)."""


class NotingBlocks(UserBlocks):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = nn.ModuleList([NotingBlock(32, i) for i in range(len(self.blocks))])
        self.noted: list[dict] = []

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        h, noted = self.embed(x), Notes()
        for block in self.blocks:
            h = block(h, noted)
        self.noted.append(noted)
        return F.cross_entropy(self.head(self.norm(h)).reshape(-1, VOCAB), ((7 * x + 3) % VOCAB).reshape(-1))


def test_a_block_handed_a_mapping_it_writes_into_is_probed_and_the_mapping_holds_what_lightnings_holds(
        one_intra_op_thread: Any, caplog: Any) -> None:
    """The dtype probe runs a block's forward again; it used to skip every block handed a mapping or list (Gemma4's
    layers are all handed one), whose dtype-dependent weights then ran in bf16 (Gemma4 with LoRA's dropout at 0.05:
    lora_B 4.5e-3 apart after one step). Each run now starts from the mapping as the call found it and leaves it as
    the call did."""
    ref = fit(NotingBlocks, None, precision="bf16-mixed", max_steps=3)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning.strategy"):
        got = fit(NotingBlocks, megatrain(), precision="bf16-mixed", max_steps=3)
    assert_is_megatrain(got)
    assert any("its dtype" in r.getMessage() for r in caplog.records), "the probe did not find up.weight's dtype"
    compare_losses(ref.losses, got.losses, rtol=0.0)
    compare_states(ref.state, got.state, rtol=1e-7)
    assert got.module.noted[-1] == ref.module.noted[-1] and sorted(ref.module.noted[-1]) == [0, 1, 2, 3]


def test_snapshot_puts_back_what_a_call_put_into_or_took_out_of_its_containers() -> None:
    from megatrain_lightning.engine.call_containers import Snapshot

    inner, entries = [1], {"a": torch.zeros(1)}
    kept = entries["a"]
    args, kwargs = ((inner, 2),), {"cache": entries}
    before = Snapshot(args, kwargs)
    inner.append(3)
    entries["b"] = torch.ones(1)
    del entries["a"]
    after = Snapshot(args, kwargs)
    before.restore()
    assert inner == [1] and list(entries) == ["a"] and entries["a"] is kept
    after.restore()
    assert inner == [1, 3] and list(entries) == ["b"]
