"""Modules and helpers of the third-party compatibility tests (``test_compat_*.py``, issue 13).

Every module is built from a config with random weights (no hub, no download) and is tiny (hidden
size 32-64, 2-4 blocks), so that one parity comparison (Lightning's default strategy, then
``strategy="megatrain"``) takes a few seconds on two cores. Data come from private generators
(``zoo.random_tokens`` and ``random_vectors``), so both runs see the same batches.

What the comparisons add to ``conftest.py``'s harness:

* ``assert_exact``: every logged loss and every final ``state_dict`` tensor within 1e-5 (the
  harness's tolerances), and frozen tensors bit for bit their initial values, in both runs. Unlike
  ``assert_parity`` it does not require half of the tensors to have changed (a LoRA model freezes
  most of them); it requires every trainable tensor to have changed in the reference run instead.
* ``parity_or_refusal``: the run under megatrain either trains exactly like the reference, or raises
  before the first training step with a message that names what it refuses (the module's path or
  class) -- the two outcomes the issue accepts for models the engine may not support.
* ``EngineProbe``: a callback that looks at ``trainer.strategy.engine`` while it exists (the strategy
  drops it at teardown): the streamed blocks and the host stores.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable, Sequence

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import RunResult, compare_losses, compare_states, fit, megatrain, rel_diff
from zoo import VOCAB, ZooModule

# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
DIM = 32


def random_vectors(n: int, dim: int, seed: int) -> torch.Tensor:
    """`n` standard-normal rows from a private generator (global RNG untouched)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g)


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager",
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def qwen2_config(**overrides: Any) -> Any:
    from transformers import Qwen2Config

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def build_causal_lm(arch: str, **overrides: Any) -> nn.Module:
    """A tiny Hugging Face causal LM: "llama" (untied head) or "qwen2" (tied embeddings, q/k/v biases)."""
    if arch == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(llama_config(**overrides))
    if arch == "qwen2":
        from transformers import Qwen2ForCausalLM

        return Qwen2ForCausalLM(qwen2_config(**overrides))
    raise ValueError(arch)


class CausalLMModule(ZooModule):
    """A tiny HF causal LM (``build()`` gives it; ``self.model``) on random tokens, labels = inputs.

    Defaults: 2 layers, 12 rows of 16 tokens in batches of 4 (3 steps an epoch), AdamW (fused, eps 1e-6)
    over the parameters that require grad when the optimizer is built.
    """

    def __init__(self, arch: str = "llama", **kwargs: Any) -> None:
        kwargs.setdefault("n_train", 12)
        kwargs.setdefault("scheduler", False)
        super().__init__(**kwargs)
        self.model = self.build()

    def build(self) -> nn.Module:
        return build_causal_lm(self.hparams.arch)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (input_ids,) = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss


# ---------------------------------------------------------------------------------------------
# the user's own blocks
# ---------------------------------------------------------------------------------------------
class MLPBlock(nn.Module):
    """x + fc2(GELU(fc1(LayerNorm(x)))): the block of the user-written modules below."""

    def __init__(self, dim: int = DIM, hidden: int = 2 * DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TokenBlocks(ZooModule):
    """Embedding, ``self.blocks`` (an nn.ModuleList of ``block_cls``), LayerNorm and head; token-wise
    task (target = (7 x + 3) mod V). Subclasses change one thing (a hook, a frozen part, a loss term).

    Defaults: 3 blocks, 12 rows of 16 tokens in batches of 4, AdamW over ``requires_grad`` parameters."""

    block_cls: type[nn.Module] = MLPBlock

    def __init__(self, num_blocks: int = 3, **kwargs: Any) -> None:
        kwargs.setdefault("n_train", 12)
        kwargs.setdefault("scheduler", False)
        super().__init__(**kwargs)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([self.block_cls() for _ in range(num_blocks)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        y = (7 * x + 3) % VOCAB
        logits = self.head(self.trunk(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class VectorBlocks(ZooModule):
    """Vectors in, classes out: Linear, ``self.blocks`` (``block_cls``), Linear; the classes of a fixed
    random teacher. For blocks that want (N, C) inputs (BatchNorm1d). 16 rows in batches of 4."""

    block_cls: Callable[[], nn.Module] = MLPBlock
    n_classes = 8

    def __init__(self, num_blocks: int = 3, **kwargs: Any) -> None:
        kwargs.setdefault("n_train", 16)
        kwargs.setdefault("scheduler", False)
        super().__init__(**kwargs)
        teacher = random_vectors(DIM, self.n_classes, 99)
        self.train_labels = (self.train_data @ teacher).argmax(-1)
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([type(self).block_cls() for _ in range(num_blocks)])
        self.out = nn.Linear(DIM, self.n_classes)

    def make_data(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        return random_vectors(n, DIM, seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.train_data, self.train_labels), batch_size=self.hparams.batch_size)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.out(h), y)


# ---------------------------------------------------------------------------------------------
# looking at the engine during fit
# ---------------------------------------------------------------------------------------------
class EngineProbe(pl.Callback):
    """Records what the strategy's engine holds, at the start and at the end of training (the strategy
    drops its engine at teardown). Under megatrain only; under another strategy it records nothing.

    Assumes the engine exposes ``blocks`` (the streamed block modules, in order) and ``all_stores()``
    (one FlatStore per block and per resident part, with ``params``, ``grad``, ``exp_avg`` and
    ``exp_avg_sq``), as ``tests/test_streaming.py`` and ``tests/test_compact_state.py`` do.
    """

    megatrain_reads_weights = False  # it reads buffer sizes, never weights

    def __init__(self) -> None:
        self.block_classes: list[str] | None = None
        self.stores: list[Any] = []
        self.engine: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.engine = engine
            self.block_classes = [type(b).__name__ for b in engine.blocks]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.stores = list(engine.all_stores())


def assert_blocks_streamed(probe: EngineProbe, n_blocks: int, steps: int) -> None:
    """Every block's gradients came home through the engine once per step (``engine.stats.d2h``,
    keyed by block index): the blocks really streamed in the backward, rather than running as plain host
    modules (which the CPU tolerates and a GPU would not: host weights, device activations)."""
    assert probe.engine is not None, "EngineProbe saw no engine"
    d2h = probe.engine.stats.d2h
    short = {i: d2h.get(i, 0) for i in range(n_blocks) if d2h.get(i, 0) < steps}
    assert not short, f"blocks whose gradients did not come home through the engine in each of {steps} steps: {short}"


# ---------------------------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------------------------
def frozen_names(module: nn.Module) -> set[str]:
    """``state_dict`` keys of the parameters that do not require grad (tied aliases included)."""
    return {k for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, nn.Parameter) and not v.requires_grad}


def assert_frozen_unchanged(run: RunResult, names: Iterable[str], what: str) -> None:
    """Each named tensor is bit for bit its value before fit."""
    changed = [n for n in names if not torch.equal(run.init_state[n], run.state[n].cpu())]
    assert not changed, f"{what}: {len(changed)} frozen tensors changed in training, e.g. {sorted(changed)[:4]}"


def assert_exact(
    ref: RunResult,
    got: RunResult,
    frozen: Iterable[str] = (),
    loose: dict[str, float] | None = None,
    losses: Sequence[tuple[str, list[float], list[float]]] = (),
) -> None:
    """Every recorded loss within 1e-5 relative, the optimizer step count equal, every final state_dict
    tensor within 1e-5 in ||delta||/||ref||, the ``frozen`` tensors bit for bit their initial values in
    both runs, and every other floating tensor changed in the reference (the check is not vacuous).
    ``losses``: further (name, reference values, values) to compare, e.g. a GAN's two losses."""
    frozen = set(frozen)
    trainable = [k for k, v in ref.init_state.items() if v.is_floating_point() and k not in frozen]
    unchanged = [k for k in trainable if rel_diff(ref.init_state[k], ref.state[k]) <= 1e-6]
    assert not unchanged, f"reference run left trainable tensors unchanged (the test is vacuous): {unchanged[:4]}"
    compare_losses(ref.losses, got.losses)
    for name, r, g in losses:
        compare_losses(r, g, what=name)
    assert got.trainer.global_step == ref.trainer.global_step, f"{got.trainer.global_step} steps vs {ref.trainer.global_step}"
    assert_frozen_unchanged(ref, frozen, "reference")
    assert_frozen_unchanged(got, frozen, "megatrain")
    compare_states(ref.state, got.state, loose=loose)


class BatchCounter(pl.Callback):
    """Counts the training batches that started (0 after a refusal at setup)."""

    megatrain_reads_weights = False

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batches += 1


def parity_or_refusal(
    factory: Callable[[], pl.LightningModule],
    names: Sequence[str],
    compare: Callable[[RunResult, RunResult], None] | None = None,
    callbacks: Callable[[], Sequence[pl.Callback]] = tuple,
    **fit_kwargs: Any,
) -> tuple[RunResult, RunResult | None, BaseException | None]:
    """Train with the default strategy, then with megatrain. Accepted outcomes: megatrain trains exactly
    (``compare``, default ``assert_exact``), or it refuses before the first training batch with an error
    whose message contains every string of ``names`` (the module's path and class, say). Anything else
    fails: a crash during training, a refusal that does not name the module, a different result.
    ``callbacks``: builds each run's own callbacks (they hold state)."""
    ref = fit(factory, None, callbacks=callbacks(), **fit_kwargs)
    counter = BatchCounter()
    try:
        got = fit(factory, "megatrain", callbacks=[*callbacks(), counter], **fit_kwargs)
    except Exception as err:  # noqa: BLE001 -- a refusal at setup is one of the two accepted outcomes
        msg = f"{type(err).__name__}: {err}"
        assert counter.batches == 0, f"megatrain failed in training batch {counter.batches} instead of refusing at setup: {msg}"
        missing = [n for n in names if n not in str(err)]
        assert not missing, f"megatrain refused at setup, but its message does not name {missing}: {msg}"
        return ref, None, err
    (compare or assert_exact)(ref, got)
    return ref, got, None


def refused_in_the_first_forward(factory: Callable[[], pl.LightningModule], pattern: str, **options: Any) -> None:
    """The default strategy trains ``factory``'s module; megatrain (``options``: its EngineConfig fields and
    strategy arguments) raises matching ``pattern`` in the first training batch, before any update: every weight
    as it was built (as the host store holds it: with ``host_state="compact"``, the bf16 high half)."""
    fit(factory, None, max_steps=2)
    counter, built = BatchCounter(), []

    def build() -> pl.LightningModule:
        built.append(factory())
        built.append(copy.deepcopy(built[0].state_dict()))
        return built[0]

    with pytest.raises(RuntimeError, match=pattern):
        fit(build, megatrain(**options), max_steps=2, callbacks=[counter])
    assert counter.batches == 1
    module, before = built
    after = module.state_dict()
    changed = [k for k in before if not torch.equal(before[k].to(after[k].dtype), after[k].cpu())]
    assert not changed, f"weights changed in the refused step: {changed}"


def max_abs_diff(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """Largest elementwise |got - ref| over the floating tensors both states hold (for messages)."""
    worst = 0.0
    for k, r in ref.items():
        g = got.get(k)
        if g is not None and r.is_floating_point() and g.shape == r.shape:
            worst = max(worst, float((g.double().cpu() - r.double()).abs().max()))
    return worst


def finite(values: Iterable[float]) -> bool:
    return all(math.isfinite(v) for v in values)
