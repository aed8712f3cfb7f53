"""timm's image models under ``strategy="megatrain"``: the model code of a third party the package never saw.

Each test trains one tiny timm model (32x32 random images, 10 random classes, 12 images in batches of 4, 3
steps, CPU, fp32) with Lightning's default strategy and with megatrain, and accepts what the compatibility
issue accepts: every loss and every final ``state_dict`` tensor within 1e-5 (``assert_exact``), or a refusal
before the first training step whose message names the module and the fix. Where megatrain streams, the test
also checks which blocks it found (``EngineProbe``) and that their gradients came home through the engine every
step, and that the config really has the feature it is there for (a stochastic block, shifted windows, ...).

* Exact: ViT (``blocks``, an ``nn.Sequential`` of ``Block``), with stochastic depth and dropout (the RNG drawn
  inside the block, which the backward's recompute must draw again), with layer scale; DeiT distilled
  (``set_distilled_training``: two heads, two losses); ConvNeXt (stages of ``LayerNorm2d`` blocks with layer
  scale and stochastic depth; streamed per stage, and per block with ``block_class="ConvNeXtBlock"``); Swin
  (relative position bias tables and index buffers, shifted-window attention masks as non-persistent buffers,
  patch merging; per stage and per block); MLP-Mixer; a ResNet whose BatchNorms track no running statistics.
  timm's own ``set_grad_checkpointing(True)`` (``checkpoint_seq`` around the blocks of a ViT, and inside the
  streamed stages of ConvNeXt and Swin). timm's ``ModelEmaV3`` updated in ``on_train_batch_end``, built in a
  callback's ``setup`` or held by the LightningModule (whose EMA copy megatrain then streams as well).
* Refused by name at setup: ResNet and EfficientNet as built (BatchNorm with running statistics, which a
  block's recompute would update twice per step).
* ``ModelEmaV3`` built in ``on_fit_start`` too, as timm's docs place it (after the model is placed): exact. It
  failed until 2026-12-07: ``copy.deepcopy`` of the model during fit copied the strategy's forward pre-hooks into
  its engine (``TypeError: cannot pickle '_queue.SimpleQueue'``), and a streamed block copied during fit kept the
  original's forward, computing with the original's weights (``megatrain_lightning/attached.py``).

timm is not in the ``test`` extra: every release imports torchvision at import time (``timm.layers``,
``timm.utils`` and ``timm.data``: 1.0.9 to 1.0.31 alike), and torchvision's PyPI wheels are built against the
CUDA torch and would replace or break the CPU one. Where torchvision is missing, ``import_timm`` serves those
imports from stand-ins for the duration of the import and takes them out of ``sys.modules`` again; none of
timm's model code these tests build calls into torchvision. The tests skip without timm (``.ci/run`` installs
it with ``--no-deps``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from functools import partial
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from compat_zoo import EngineProbe, assert_blocks_streamed, assert_exact, parity_or_refusal
from conftest import RunResult, assert_is_megatrain, compare_states, fit, megatrain, rel_diff
from zoo import ZooModule

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

STEPS = 3
CLASSES = 10


# ---------------------------------------------------------------------------------------------
# importing timm without torchvision
# ---------------------------------------------------------------------------------------------
class _StandInClass(type):
    """A torchvision class timm names at import time; its attributes (``InterpolationMode.BILINEAR``) are
    distinct strings."""

    def __getattr__(cls, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__qualname__}.{name}"


class _StandInModule(types.ModuleType):
    """A torchvision module: every name it is asked for is a fresh stand-in class."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _StandInClass(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and every ``torchvision.*`` import as a stand-in module."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_timm() -> Any:
    """``timm`` with ``timm.utils`` imported; the test skips where timm is not installed. Without torchvision,
    its imports are served by stand-ins during this import only (see the module docstring)."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (pip install --no-deps timm)")
    if "timm.utils" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        import timm
        import timm.utils  # noqa: F401

        return timm
    finder = _StandInFinder()
    sys.meta_path.insert(0, finder)
    try:
        import timm
        import timm.utils  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    return timm


# ---------------------------------------------------------------------------------------------
# the models
# ---------------------------------------------------------------------------------------------
VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)
SWIN = dict(img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4))
CONVNEXT = dict(depths=(1, 2, 2, 1), dims=(8, 16, 24, 32), ls_init_value=0.1, drop_path_rate=0.2)
SMALL_RESNET = dict(channels=(8, 16, 32, 64), stem_width=8)


def _mixer(timm: Any, **kwargs: Any) -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer  # its named configs fix the patch size

    return MlpMixer(img_size=32, patch_size=8, num_blocks=2, embed_dim=32, drop_path_rate=0.1, **kwargs)


def _resnet_without_running_stats(timm: Any, **kwargs: Any) -> nn.Module:
    norm = partial(nn.BatchNorm2d, track_running_stats=False)
    return timm.create_model("resnet18", norm_layer=norm, **SMALL_RESNET, **kwargs)


def _named(name: str, **config: Any) -> Callable[..., nn.Module]:
    def build(timm: Any, **kwargs: Any) -> nn.Module:
        return timm.create_model(name, pretrained=False, **config, **kwargs)

    return build


# name -> (builder(timm, num_classes=...), optimizer). SGD with momentum for the attention models, as
# test_compat_checkpointing.py's ViT: the key part of a fused qkv bias has an analytically zero gradient,
# which Adam would turn from rounding noise into lr-sized steps; AdamW (fused) for the others.
MODELS: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "vit": (_named("vit_tiny_patch16_224", **VIT), "sgd"),
    "vit_stochastic_depth": (_named("vit_tiny_patch16_224", **VIT, drop_path_rate=0.3, proj_drop_rate=0.1,
                                    attn_drop_rate=0.1), "sgd"),
    "vit_layer_scale": (_named("vit_tiny_patch16_224", **VIT, init_values=0.1), "sgd"),
    "deit_distilled": (_named("deit_tiny_distilled_patch16_224", **VIT), "sgd"),
    "convnext": (_named("convnext_atto", **CONVNEXT), "adamw"),
    "swin": (_named("swin_tiny_patch4_window7_224", **SWIN), "sgd"),
    "mixer": (_mixer, "adamw"),
    "resnet": (_named("resnet18", **SMALL_RESNET), "adamw"),
    "resnet_without_running_stats": (_resnet_without_running_stats, "adamw"),
    "efficientnet": (_named("tinynet_e"), "adamw"),
}


class TimmClassifier(ZooModule):
    """A timm model from MODELS on 12 random 32x32 images with random labels, cross-entropy; with
    ``distilled``, DeiT's two heads in training (``set_distilled_training``), the distillation head against
    other labels. ``grad_checkpointing``: timm's ``set_grad_checkpointing(True)``."""

    def __init__(self, arch: str = "vit", grad_checkpointing: bool = False, distilled: bool = False,
                 **kwargs: Any) -> None:
        build, optimizer = MODELS[arch]
        kwargs.setdefault("n_train", 12)
        kwargs.setdefault("scheduler", False)
        kwargs.setdefault("optimizer", optimizer)
        kwargs.setdefault("lr", 0.05 if optimizer == "sgd" else 3e-3)
        super().__init__(**kwargs)
        self.model = build(import_timm(), num_classes=CLASSES)
        if grad_checkpointing:
            self.model.set_grad_checkpointing(True)
        if distilled:
            self.model.set_distilled_training(True)
        g = torch.Generator().manual_seed(5)
        self.labels = torch.randint(0, CLASSES, (len(self.train_data),), generator=g)

    def make_data(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 3, 32, 32, generator=g)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.train_data, self.labels), batch_size=self.hparams.batch_size)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        out = self.model(x)
        if isinstance(out, tuple):  # DeiT in distilled training: (class head, distillation head)
            logits, distilled = out
            return F.cross_entropy(logits, y) + F.cross_entropy(distilled, (y + 1) % CLASSES)
        return F.cross_entropy(out, y)


def assert_stochastic(model: nn.Module) -> None:
    """Two training-mode ``forward_features`` of one batch differ: the model draws random numbers in its blocks
    (features, not logits: the Mixer's head starts at zero)."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model.train()
    with torch.no_grad():
        first, second = model.forward_features(x), model.forward_features(x)
    assert not torch.equal(first, second), "the model is deterministic in training: the test checks no RNG"


def _vit_stochastic_depth(model: nn.Module) -> None:
    from timm.layers import DropPath

    assert isinstance(model.blocks[-1].drop_path1, DropPath) and model.blocks[-1].drop_path1.drop_prob > 0
    assert_stochastic(model)


def _vit_layer_scale(model: nn.Module) -> None:
    from timm.layers import LayerScale

    assert all(isinstance(b.ls1, LayerScale) and isinstance(b.ls2, LayerScale) for b in model.blocks)


def _deit_two_heads(model: nn.Module) -> None:
    out = model.train()(torch.randn(2, 3, 32, 32))
    assert isinstance(out, tuple) and len(out) == 2, "DeiT does not train both heads"


def _convnext(model: nn.Module) -> None:
    from timm.layers import LayerNorm2d

    assert any(isinstance(m, LayerNorm2d) for m in model.stages.modules())
    assert all(b.gamma is not None for s in model.stages for b in s.blocks), "no layer scale"
    assert_stochastic(model)


def _swin(model: nn.Module) -> None:
    blocks = [b for stage in model.layers for b in stage.blocks]
    shifted = [b for b in blocks if any(b.shift_size)]
    assert shifted and all(b.attn_mask is not None for b in shifted), "no shifted windows"
    assert all(hasattr(b.attn, "relative_position_index") for b in blocks)
    assert_stochastic(model)


# MODELS key -> what its config is there for, checked on a fresh model before the runs
FEATURES: dict[str, Callable[[nn.Module], None]] = {
    "vit_stochastic_depth": _vit_stochastic_depth, "vit_layer_scale": _vit_layer_scale,
    "deit_distilled": _deit_two_heads, "convnext": _convnext, "swin": _swin, "mixer": assert_stochastic,
}


def exact_and_streamed(factory: Callable[[], pl.LightningModule], block_classes: list[str], strategy: Any = "megatrain",
                       called: int | None = None) -> tuple[RunResult, RunResult]:
    """Default strategy, then megatrain: the blocks it streams are ``block_classes``, the first ``called`` of them
    (all by default) streamed in each step, and the two runs end exactly alike."""
    probe = EngineProbe()
    ref = fit(factory, None, max_steps=STEPS)
    got = fit(factory, strategy, max_steps=STEPS, callbacks=[probe])
    assert_is_megatrain(got)
    assert probe.block_classes == block_classes, probe.block_classes
    assert_exact(ref, got)
    assert_blocks_streamed(probe, len(block_classes) if called is None else called, steps=STEPS)
    return ref, got


# ---------------------------------------------------------------------------------------------
# exact
# ---------------------------------------------------------------------------------------------
# case -> (MODELS key, TimmClassifier options, block_class or None, the classes megatrain streams)
EXACT: dict[str, tuple[str, dict[str, Any], str | None, list[str]]] = {
    "vit": ("vit", {}, None, ["Block"] * 2),
    "vit_stochastic_depth": ("vit_stochastic_depth", {}, None, ["Block"] * 2),
    "vit_layer_scale": ("vit_layer_scale", {}, None, ["Block"] * 2),
    "deit_distilled": ("deit_distilled", dict(distilled=True), None, ["Block"] * 2),
    "convnext_stages": ("convnext", {}, None, ["ConvNeXtStage"] * 4),
    "convnext_blocks": ("convnext", {}, "ConvNeXtBlock", ["ConvNeXtBlock"] * 6),
    "swin_stages": ("swin", {}, None, ["SwinTransformerStage"] * 2),
    "swin_blocks": ("swin", {}, "SwinTransformerBlock", ["SwinTransformerBlock"] * 4),
    "mixer": ("mixer", {}, None, ["MixerBlock"] * 2),
    "resnet_without_running_stats": ("resnet_without_running_stats", {}, None, ["BasicBlock"] * 8),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_timm_parity(case: str) -> None:
    """The model trains exactly like the default strategy, its blocks streamed (see EXACT for which)."""
    arch, options, block_class, classes = EXACT[case]
    factory = partial(TimmClassifier, arch=arch, **options)
    if arch in FEATURES:
        FEATURES[arch](factory().model)
    strategy = megatrain(block_class=block_class) if block_class else "megatrain"
    exact_and_streamed(factory, classes, strategy)


@pytest.mark.parametrize("arch, classes", [("vit_stochastic_depth", ["Block"] * 2),
                                           ("convnext", ["ConvNeXtStage"] * 4),
                                           ("swin", ["SwinTransformerStage"] * 2)], ids=["vit", "convnext", "swin"])
def test_timm_grad_checkpointing(arch: str, classes: list[str]) -> None:
    """timm's ``set_grad_checkpointing(True)``: a ViT runs ``checkpoint_seq`` over its streamed blocks from the
    root (with stochastic depth, so the checkpoint's RNG replay meets the engine's), ConvNeXt and Swin inside
    each streamed stage. Exact, streamed, and the flags still set after fit."""
    factory = partial(TimmClassifier, arch=arch, grad_checkpointing=True)
    _, got = exact_and_streamed(factory, classes)
    model = got.module.model
    stages = model.stages if arch == "convnext" else model.layers if arch == "swin" else None
    flags = [model.grad_checkpointing] if stages is None else [s.grad_checkpointing for s in stages]
    assert all(f is True for f in flags), flags


# ---------------------------------------------------------------------------------------------
# refused
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, names", [
    ("resnet", ["model.layer1.0.bn1", "BatchNorm2d", "track_running_stats=False"]),
    ("efficientnet", ["model.blocks.0.0.bn1", "BatchNormAct2d", "track_running_stats=False"]),
], ids=["resnet", "efficientnet"])
def test_timm_running_stats_refused_by_name(arch: str, names: list[str]) -> None:
    """ResNet and EfficientNet as built: BatchNorms that update running statistics in their forward, which a
    streamed block runs twice per step. Refused before the first step, naming the first such norm, its class and
    the fix (``resnet_without_running_stats`` in EXACT shows the fix trains exactly)."""
    ref, _, err = parity_or_refusal(partial(TimmClassifier, arch=arch), names, max_steps=STEPS)
    assert err is not None, f"megatrain trained {arch} with running statistics in its streamed blocks"
    assert ref.trainer.global_step == STEPS


# ---------------------------------------------------------------------------------------------
# ModelEmaV3
# ---------------------------------------------------------------------------------------------
EMA_DECAY = 0.5  # a visible average after 3 steps
# AdamW, and stochastic depth: megatrain's host Adam updates overlap the backward and would run on past the step
# unless something may read the weights between steps, as an EMA update does (an EMA taken from weights still
# being updated differs from the reference's by ~0.6 relative).
EMA_ARCH = "mixer"


class TimmEma(pl.Callback):
    """timm's ``ModelEmaV3`` of ``pl_module.model``, built in the hook ``build_in`` and updated after every
    training batch with the step count, as timm's train.py does after each optimizer step."""

    def __init__(self, build_in: str) -> None:
        self.build_in = build_in
        self.ema: Any = None

    def _build(self, pl_module: pl.LightningModule) -> None:
        from timm.utils import ModelEmaV3

        self.ema = ModelEmaV3(pl_module.model, decay=EMA_DECAY)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.build_in == "setup":
            self._build(pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.build_in == "on_fit_start":
            self._build(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ema.update(pl_module.model, step=trainer.global_step)


def _ema_outputs(ema: nn.Module) -> torch.Tensor:
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return ema.eval()(x)


def assert_ema_exact(ref: RunResult, ref_ema: nn.Module, got_ema: nn.Module, prefix: str) -> None:
    """The megatrain run's EMA holds the reference's, and computes what it computes; the reference's EMA is
    neither the initial nor the final model (the average is not vacuous)."""
    state = ref_ema.module.state_dict()
    for other, what in ((ref.init_state, "initial"), (ref.state, "final")):
        same = [k for k, v in state.items() if v.is_floating_point() and v.abs().sum() > 0
                and rel_diff(other[prefix + k], v) < 1e-6]
        assert not same, f"the EMA equals the {what} model in {same[:4]}"
    compare_states(state, got_ema.module.state_dict(), what="EMA state_dict")
    ref_out, got_out = _ema_outputs(ref_ema), _ema_outputs(got_ema)
    assert rel_diff(ref_out, got_out) <= 1e-5, f"EMA outputs differ by {rel_diff(ref_out, got_out):.2e}"


@pytest.mark.parametrize("build_in", [
    "setup",
    "on_fit_start",
])
def test_timm_model_ema_v3_callback(build_in: str) -> None:
    """``ModelEmaV3`` in a callback (decay 0.5), built before the strategy sets up (``setup``) or once the model
    is placed (``on_fit_start``, as timm's docs advise), updated in ``on_train_batch_end``: the model trains
    exactly and the EMA ends equal to the reference's, or megatrain refuses before the first step naming the
    deepcopy."""
    emas: list[TimmEma] = []

    def callbacks() -> list[pl.Callback]:
        emas.append(TimmEma(build_in))
        return [emas[-1]]

    factory = partial(TimmClassifier, arch=EMA_ARCH)
    ref, got, err = parity_or_refusal(factory, ["deepcopy"], callbacks=callbacks, max_steps=STEPS)
    if err is None:
        assert_ema_exact(ref, emas[0].ema, emas[1].ema, prefix="model.")


class EmaHeldByModule(TimmClassifier):
    """The LightningModule holds ``self.model_ema = ModelEmaV3(self.model)`` (a submodule, so in its
    state_dict), updates it in its own ``on_train_batch_end`` and optimizes ``self.model`` only (AdamW, fused)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from timm.utils import ModelEmaV3

        self.model_ema = ModelEmaV3(self.model, decay=EMA_DECAY)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return torch.optim.AdamW(self.model.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95),
                                 eps=hp.adam_eps, fused=True)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.model_ema.update(self.model, step=self.global_step)


def test_timm_model_ema_v3_held_by_module() -> None:
    """``ModelEmaV3`` as a submodule: megatrain streams the EMA copy's blocks too (four ``MixerBlock``s, the EMA's
    never called in a forward), whose weights the EMA update writes in place between steps; model and EMA exact."""
    factory = partial(EmaHeldByModule, arch=EMA_ARCH)
    ref, got = exact_and_streamed(factory, ["MixerBlock"] * 4, called=2)
    assert_ema_exact(ref, ref.module.model_ema, got.module.model_ema, prefix="model.")
