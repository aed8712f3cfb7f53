"""host_state="compact" (issue 5): at most 8 host bytes per parameter of lasting state, and its accuracy.

The fp32 master is kept exactly as a bf16 high half plus an int16 low half, Adam's moments are bf16. The
accuracy test is the issue's: 200 steps at a fine-tuning learning rate, where each AdamW update (~lr) is
far below half a bf16 step of the weights (~0.02 * 2^-9 = 4e-5), so plain bf16 masters do not train at
all while the compact state follows fp32 state. It compares against that plain-bf16 variant (the store
without its low half), so it would fail if the compensation stopped working.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine import materialize
from megatrain_lightning.engine.host_buffers import PinnedRegistry
from megatrain_lightning.engine.store import FlatStore, join_fp32, split_fp32
from megatrain_lightning.optim.adam import AdamHyper, Piece
from megatrain_lightning.optim.kernels import step_compact as compact_adam_step
from conftest import strategy_of


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class TinyLlamaLM(L.LightningModule):
    """A 2-layer Llama (hidden 64, vocab 128) on rows repeating a random 8-token pattern, AdamW with
    torch's default betas (0.9, 0.999): the setting where bf16 moments need stochastic rounding."""

    def __init__(self, lr: float = 1e-5, optimizer: str = "adamw", n_rows: int = 64) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
            attn_implementation="eager",
        )
        self.model = LlamaForCausalLM(config)
        g = torch.Generator().manual_seed(7)
        self.rows = torch.randint(0, 32, (n_rows, 8), generator=g).repeat(1, 4)  # 32 tokens per row
        self.lr = lr
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(self.rows)
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.optimizer == "amsgrad":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, amsgrad=True)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class Record(L.Callback):
    """Every training loss, and the engine's stores (the engine itself is gone after teardown)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.stores: list[FlatStore] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.stores = trainer.strategy.engine.all_stores()


def _fit(host_state: str, steps: int, ckpt_path: str | None = None, callbacks: tuple = (), seed: int = 0,
         max_epochs: int | None = None, **module_kw: Any) -> tuple[TinyLlamaLM, L.Trainer, Record]:
    L.seed_everything(seed, verbose=False)
    module = TinyLlamaLM(**module_kw)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy_of(host_state=host_state), max_steps=steps,
        max_epochs=max_epochs, logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record, *callbacks],
    )
    L.seed_everything(0, verbose=False)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer, record


# ------------------------------------------------------------------------------------------ format
def test_split_and_join_are_exact_and_round_to_nearest() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 16, generator=g) * torch.logspace(-30, 30, 1 << 16)
    w[:4] = torch.tensor([0.0, -0.0, 1.0, -3.0e38])
    n = w.numel()
    hi, lo = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    bits, tmp = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    split_fp32(w.view(torch.int32).clone(), hi, lo, tmp)
    join_fp32(hi, lo, bits, tmp)
    assert torch.equal(bits, w.view(torch.int32)), "join(split(w)) must give back the fp32 bits"
    # the high half is the nearest bf16 (ties away from zero instead of to even: a handful of elements)
    assert (hi.float() - w.bfloat16().float()).ne(0).sum() < 20
    assert ((hi.double() - w.double()).abs() <= w.double().abs() * 2.0**-8).all()


# ------------------------------------------------------------------------------------------ bytes
def test_lasting_host_state_is_8_bytes_per_parameter() -> None:
    module, _, record = _fit("compact", steps=1)
    stores = record.stores
    for store in stores:
        assert store.master.dtype == torch.bfloat16 and store.master_low.dtype == torch.int16
        assert store.exp_avg.dtype == store.exp_avg_sq.dtype == torch.bfloat16
        # transient, 4 B: a pooled buffer that went back after the overlapped update, or the store's own
        assert store.grad is None or store.grad.dtype == torch.float32
        buffers = (store.master, store.master_low, store.exp_avg, store.exp_avg_sq)
        lasting = sum(t.numel() * t.element_size() for t in buffers)
        assert lasting == store.lasting_bytes() == 8 * store.numel
        assert store.numel - sum(p.numel() for p in store.params) < 16 * len(store.params)  # alignment only
    n_params = sum(p.numel() for p in module.parameters())
    assert sum(s.lasting_bytes() for s in stores) <= 8 * n_params * 1.01
    # and the fp32 default: 12 B/param
    _, _, fp32 = _fit("fp32", steps=1)
    assert all(s.lasting_bytes() == 12 * s.numel for s in fp32.stores)


def test_parameters_are_bf16_views_with_fp32_gradients() -> None:
    module, trainer, record = _fit("compact", steps=2)
    store = record.stores[0]
    p = store.params[0]
    assert p.dtype == torch.bfloat16 and p.grad_dtype == torch.float32
    assert p.untyped_storage().data_ptr() == store.master.untyped_storage().data_ptr()
    state = trainer.optimizers[0].state[p]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["master_low"].dtype == torch.int16
    # the exact fp32 master, of which the bf16 parameter is the rounding (to even in .bfloat16(), away from
    # zero in the store: exact ties, 1 in 65536, may differ)
    full = store.master_fp32()[: p.numel()].view(p.shape)
    assert (full.bfloat16() != p.detach()).sum() <= 2 and not torch.equal(full, p.detach().float())


def test_compact_update_is_fp32_adamw_on_the_weights() -> None:
    """With fp32 moments out of the picture (one step from zero moments, whose bf16 rounding is the
    only difference), the weights after a compact step equal torch's fused AdamW on the fp32 weights."""
    torch.manual_seed(0)
    w = torch.randn(300_000) * 0.02
    grad = torch.randn(300_000) * 1e-3
    store = FlatStore([nn.Parameter(w.clone())], PinnedRegistry(False), "compact")
    ea, eas = store.moment_buffers()
    step = torch.tensor(1.0)
    hyper = AdamHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)
    compact_adam_step(store.master, store.master_low, ea, eas, [Piece(0, 300_000, grad, step)], hyper)
    ref = nn.Parameter(w.clone())
    opt = torch.optim.AdamW([ref], lr=1e-5, weight_decay=0.01, fused=True)
    ref.grad = grad.clone()
    opt.step()
    assert torch.equal(store.master_fp32()[:300_000], ref.detach())  # exactly: the same fp32 kernel
    assert not torch.equal(w.bfloat16(), store.master[:300_000])  # and the update did not round away


def test_compact_update_does_not_depend_on_the_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk size follows the thread count; the result (stochastic rounding of the moments included)
    must not, or a run resumed on another machine would round differently."""
    from megatrain_lightning.optim import adam as host_adam

    torch.manual_seed(0)
    n = 100_003
    w, grads = torch.randn(n) * 0.02, [torch.randn(n) * 1e-3 for _ in range(3)]
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)
    results = []
    for chunk in (4096, 65_536, 1 << 20):
        monkeypatch.setattr(host_adam, "CHUNK_ELEMS", chunk)
        store = FlatStore([nn.Parameter(w.clone())], PinnedRegistry(False), "compact")
        ea, eas = store.moment_buffers()
        step = torch.tensor(0.0)
        for g in grads:
            step += 1
            compact_adam_step(store.master, store.master_low, ea, eas, [Piece(0, n, g, step)], hyper)
        results.append((store.master_fp32()[:n].clone(), ea[:n].clone(), eas[:n].clone()))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


class SlotProbe(L.Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.staging = trainer.strategy.engine.weights.slots.staging


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_compact_state_with_clipping_and_accumulation(precision: str) -> None:
    """The non-overlapped path (clipping sees fp32 gradients of bf16 parameters), both precisions: bf16
    slots take the bf16 halves as they are (no staging), fp32 slots cast them on the device."""
    L.seed_everything(0, verbose=False)
    module, probe, record = TinyLlamaLM(lr=1e-3, n_rows=32), SlotProbe(), Record()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy_of(host_state="compact"), precision=precision,
        max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record, probe],
    )
    trainer.fit(module)
    assert len(record.losses) == 6 and all(math.isfinite(x) for x in record.losses)
    assert record.losses[-1] < record.losses[0]
    if precision == "bf16-mixed":
        assert probe.staging is None
    else:
        assert probe.staging.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ accuracy
FINETUNE_LR = 1e-5  # updates of ~1e-5 against weights of ~0.02: below half a bf16 step (4e-5)


@pytest.mark.slow
def test_compact_state_loss_within_1_percent_of_fp32_where_plain_bf16_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 steps; final loss = mean of the last 20. (a) fp32 state, (b) compact, (c) compact without the
    low half (plain bf16 masters + bf16 moments). Measured: a 4.6858, b 4.6862 (+0.01%), c 4.8416 (+3.3%),
    from 4.8716 at the first step (README, "Compact state")."""
    a = _fit("fp32", steps=200, lr=FINETUNE_LR)[2].losses
    b = _fit("compact", steps=200, lr=FINETUNE_LR)[2].losses
    monkeypatch.setattr(materialize, "FlatStore", functools.partial(FlatStore, compensate=False))
    c = _fit("compact", steps=200, lr=FINETUNE_LR)[2].losses
    fa, fb, fc = (sum(x[-20:]) / 20 for x in (a, b, c))
    print(f"\nfinal loss (mean of last 20 of 200): fp32 {fa:.5f}, compact {fb:.5f} ({(fb - fa) / fa:+.3%}), "
          f"plain bf16 {fc:.5f} ({(fc - fa) / fa:+.3%}); first {a[0]:.5f}")
    assert b[0] == c[0] and abs(b[0] - a[0]) / a[0] < 1e-4  # compact computes with the bf16-rounded weights
    assert (a[0] - fa) / a[0] > 0.03, "the fp32 run must learn, or the comparison says nothing"
    assert abs(fb - fa) / fa <= 0.01
    assert abs(fc - fa) / fa > 0.01


# ------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_resume_gives_the_same_next_steps(tmp_path: Any) -> None:
    """3 epochs of 3 steps; a run stopped after the first epoch's checkpoint resumes, from a module built
    with another seed, with exactly the uninterrupted run's losses (bf16 moments, low halves and all)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = dict(steps=-1, lr=1e-3, n_rows=24)
    full = _fit("compact", max_epochs=3, **kw)[2].losses
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    first = _fit("compact", max_epochs=1, callbacks=(ckpt,), **kw)[2].losses
    assert first == full[:3]
    path = tmp_path / "epoch=0.ckpt"
    assert path.exists(), sorted(p.name for p in tmp_path.iterdir())
    _, trainer, record = _fit("compact", max_epochs=3, ckpt_path=str(path), seed=1, **kw)
    assert len(full) == 9 and record.losses == full[3:], f"resumed {record.losses} vs uninterrupted {full[3:]}"
    saved = trainer.optimizers[0].state_dict()["state"]
    assert {k for st in saved.values() for k in st} == {"step", "exp_avg", "exp_avg_sq", "master_low"}
    # without the low halves the resumed run would differ: the checkpoint's weights alone are bf16
    low = [st["master_low"] for st in saved.values()]
    assert sum(int(t.ne(0).sum()) for t in low) > 0.9 * sum(t.numel() for t in low)


def test_compact_optimizer_state_loads_into_plain_adamw() -> None:
    """The state dict keeps torch's format: a plain AdamW takes it (moments cast to its dtype)."""
    module, trainer, _ = _fit("compact", steps=2)
    state = trainer.optimizers[0].state_dict()
    plain = torch.optim.AdamW([nn.Parameter(p.detach().float().clone()) for p in module.parameters()])
    plain.load_state_dict(state)
    st = next(iter(plain.state.values()))
    assert st["exp_avg"].dtype == torch.float32 and float(st["step"]) == 2.0


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("optimizer", ["sgd", "amsgrad"])
def test_unsupported_optimizer_is_refused_with_what_to_use(optimizer: str) -> None:
    with pytest.raises(ValueError, match=r"host_state='compact'.*Adam.*host_state='fp32'"):
        _fit("compact", steps=1, optimizer=optimizer)


def test_unknown_host_state_is_refused() -> None:
    with pytest.raises(ValueError, match=r"host_state='bf16'.*'fp32', 'compact'"):
        strategy_of(host_state="bf16")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ planner
def test_planner_counts_12_bytes_per_parameter_and_half_the_weight_copies() -> None:
    import dataclasses

    from megatrain_lightning.config import EngineConfig
    from megatrain_lightning.hardware import HardwareProfile
    from megatrain_lightning.plan import PlanShape, Run, Workload, make_plan
    from megatrain_lightning.plan.memory import host_bytes, pinned_bytes
    from megatrain_lightning.plan.timing import COMPACT_ADAM_SPEED, COMPACT_ADAM_SPEED_CHUNKED, step_times

    shape = PlanShape(total_params=1000, block_params=600, largest_block=300, resident_params=400, head_params=200,
                      layers=2, heads=2, head_dim=4, kv_dim=4, hidden=8, intermediate=16, vocab=50)
    # every block its own fp32 gradient buffer
    fp32 = Run(Workload(micro_batch=2, seq_len=3), EngineConfig(grad_buffers=0, bf16_grads=False))
    compact = fp32.replace(host_state="compact")
    assert list(host_bytes(shape, compact).values())[:3] == [4000, 4000, 4000]  # master halves, grad, moments
    # bf16 gradients (bf16_grads=True): the blocks' own buffers hold 2 B/param, the resident store's still 4
    assert list(host_bytes(shape, compact.replace(bf16_grads=True)).values())[1] == 2 * 600 + 4 * 400
    # pooled gradient buffers (the default when nothing accumulates): 2 blocks' worth + the larger resident store
    pooled = compact.replace(grad_buffers=2)
    assert list(host_bytes(shape, pooled).values())[:3] == [4000, 4 * (2 * 300 + 400), 4000]
    assert sum(list(host_bytes(shape, fp32).values())[:3]) == 16000
    assert pinned_bytes(shape, compact) == 6000  # the bf16 halves and the gradients
    hw = HardwareProfile(name="toy", accelerator="cuda", device="cuda:0", precision="bf16-mixed", device_memory_gb=2,
                         host_memory_gb=10, link_gb_per_s=1, peak_bf16_tflops=1, slots=3, micro_batch=2, seq_len=3,
                         pinned_budget_gb=1, host_adam_gparams_per_s=1)
    h2d = step_times(shape, compact, hw)["host->device copies"] / step_times(shape, fp32, hw)["host->device copies"]
    assert 0.5 < h2d < 1  # block weights at 2 B instead of 4; resident ones still 4
    # the host AdamW at the measured speed of the one-pass compact kernel, or of the chunked torch ops
    adam = {s: step_times(shape, dataclasses.replace(compact, compact_native=s), hw)["host optimizer"] for s in (True, False)}
    assert adam[False] / adam[True] == pytest.approx(COMPACT_ADAM_SPEED / COMPACT_ADAM_SPEED_CHUNKED)
    assert adam[True] < step_times(shape, fp32, hw)["host optimizer"] < adam[False]  # 1.25x and 0.32x of fp32
    # the fit check counts 12 B/param of compact state and names compact as the fix only for fp32 runs
    need = sum(host_bytes(shape, compact).values())
    assert make_plan(shape, compact, dataclasses.replace(hw, host_memory_gb=need / 1e9)).host_total == need
    with pytest.raises(Exception, match=r"needs .* GB of host memory") as err:
        make_plan(shape, compact, dataclasses.replace(hw, host_memory_gb=need / 1e9 * 0.99))
    assert "host_state=compact" not in str(err.value)
    with pytest.raises(Exception, match=r"strategy.engine.host_state=compact"):
        make_plan(shape, fp32, dataclasses.replace(hw, host_memory_gb=need / 1e9))
