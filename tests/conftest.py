"""Shared test setup and the parity harness.

The harness trains one LightningModule factory twice from the same seed, once with Lightning's
default strategy and once with the strategy under test, and compares what a user can see
through the public API only: every micro-batch loss (read from `outputs["loss"]` in a callback),
the learning rates, the optimizer step count and the final `state_dict()`.

    ref, got = run_parity(TinyLlama, max_steps=8)          # asserts parity, returns both runs

`fit(...)` runs one side alone; `compare_losses` / `compare_states` are the comparisons, usable
on parts of runs (resume tests). Tolerances default to 1e-5 relative (issue 2).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Inductor's C++ kernels without their SIMD variants: a quarter less cold compilation for the compiled-block tests
# (their file 350 -> 266 s with a fresh inductor cache, as CI has). What the CPU tests check is how blocks compile and
# train, not inductor's vectorization (nothing compiles on the CPU by default; the cuda-marked tests compile for the
# GPU). Read when torch._inductor.config is first imported, which Lightning's import does: set before it. Processes
# the tests start inherit it. A value set outside wins.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5

# What a test passes as `strategy`: None = Lightning's default; "megatrain" = the registered
# name; or a zero-argument callable returning a fresh strategy instance (instances hold state
# and must not be shared between Trainers).
StrategySpec = None | str | Callable[[], Any]

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def load_recipe(name: str) -> Any:
    """``recipes/<name>.py`` imported as a module (the recipes are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# markers
# ---------------------------------------------------------------------------------------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cuda`-marked tests are skipped on a machine without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------------
class Recorder(Callback):
    """Records what the training loop exposes through public hooks.

    losses:      `outputs["loss"]` of every micro-batch (Lightning divides it by
                 `accumulate_grad_batches`, identically for both strategies)
    lrs:         the learning rate of every param group of the first optimizer, per micro-batch

    It hooks nothing between the backward and the optimizer step, and declares that it reads no weights
    between steps, so MegaTrainStrategy runs its default path (host updates overlapped with the backward
    and running on into the next forward, pooled gradient buffers); see GradNormRecorder.
    """

    megatrain_reads_weights = False  # losses and learning rates only

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[list[float]] = []
        self.grad_norms: list[dict[str, tuple[str, float]]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:  # training_step returned None: Lightning skipped the batch (outputs {})
            return
        self.losses.append(float(loss))
        self.lrs.append([float(g["lr"]) for g in trainer.optimizers[0].param_groups])

    def global_grad_norms(self) -> list[float]:
        return [math.sqrt(sum(n * n for _, n in step.values())) for step in self.grad_norms]


class GradNormRecorder(Recorder):
    """Also records, per optimizer step, {parameter name: (grad device type, grad L2 norm)} as seen in
    `on_before_optimizer_step`, i.e. before gradient clipping. A hook there must see every gradient, so
    MegaTrainStrategy then steps after the backward instead of overlapping it."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grad_norms.append(
            {
                name: (p.grad.device.type, float(p.grad.detach().double().norm()))
                for name, p in pl_module.named_parameters()
                if p.grad is not None
            }
        )



@dataclass
class RunResult:
    module: pl.LightningModule
    trainer: pl.Trainer
    recorder: Recorder
    init_state: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]  # state_dict() after fit, as returned (not moved), cloned
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return self.recorder.losses


def resolve_strategy(spec: StrategySpec) -> Any:
    """Turn a StrategySpec into what `Trainer(strategy=...)` takes. Importing the package is what
    registers "megatrain"; a failing import fails the test (never a skip)."""
    if spec is None:
        return "auto"
    if isinstance(spec, str):
        if spec == "megatrain":
            import megatrain_lightning  # noqa: F401  (registers the strategy name)
        return spec
    return spec()


def megatrain(**kwargs: Any) -> Callable[[], Any]:
    """A StrategySpec building `MegaTrainStrategy` per Trainer: `EngineConfig` fields among `kwargs` go
    into its `engine` config, the rest to the strategy itself."""

    def build() -> Any:
        return strategy_of(**kwargs)

    return build


def strategy_of(**kwargs: Any) -> Any:
    """`MegaTrainStrategy(engine=EngineConfig(<its fields in kwargs>), <the other kwargs>)`."""
    import dataclasses

    import megatrain_lightning

    fields = {f.name for f in dataclasses.fields(megatrain_lightning.EngineConfig)}
    engine = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    return megatrain_lightning.MegaTrainStrategy(engine=megatrain_lightning.EngineConfig(**engine), **kwargs)


def _clone_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit(
    factory: Callable[[], pl.LightningModule],
    strategy: StrategySpec = None,
    *,
    seed: int = 0,
    accelerator: str = "cpu",
    precision: str = "32-true",
    callbacks: Sequence[Callback] = (),
    ckpt_path: str | None = None,
    weights_only: bool | None = None,
    record_grad_norms: bool = False,
    allow_nonfinite: bool = False,
    **trainer_kwargs: Any,
) -> RunResult:
    """Build the module from `seed`, train it with `strategy`, return what was recorded.

    The global seed is set before building the module AND again right before `fit`, so that
    dropout draws the same masks in both runs. Defaults: 8 steps, no logger, no checkpoints,
    no progress bar or summary, no validation (pass `limit_val_batches` to enable it),
    `deterministic=True`. `ckpt_path` and `weights_only` go to `trainer.fit`.
    """
    pl.seed_everything(seed, verbose=False)
    module = factory()
    init_state = _clone_state(module)
    recorder = GradNormRecorder() if record_grad_norms else Recorder()
    kwargs: dict[str, Any] = dict(
        accelerator=accelerator,
        devices=1,
        precision=precision,
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(strategy=resolve_strategy(strategy), callbacks=[recorder, *callbacks], **kwargs)
    pl.seed_everything(seed, verbose=False)
    trainer.fit(module, ckpt_path=ckpt_path, weights_only=weights_only)
    for loss in recorder.losses:
        assert allow_nonfinite or math.isfinite(loss), f"non-finite training loss: {recorder.losses}"
    return RunResult(module, trainer, recorder, init_state, _clone_state(module))


# ---------------------------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------------------------
def compare_losses(ref: Sequence[float], got: Sequence[float], rtol: float = LOSS_RTOL, what: str = "loss") -> None:
    assert len(got) == len(ref), f"{what}: {len(got)} values vs {len(ref)} in the reference\nref={ref}\ngot={got}"
    bad = [
        (i, r, g, abs(g - r) / max(abs(r), 1e-30))
        for i, (r, g) in enumerate(zip(ref, got))
        if not abs(g - r) <= rtol * abs(r)
    ]
    assert not bad, (
        f"{what}: {len(bad)}/{len(ref)} values differ by more than {rtol:g} relative; first: "
        + ", ".join(f"#{i}: ref={r:.8g} got={g:.8g} (rel {d:.2e})" for i, r, g, d in bad[:4])
    )


def rel_diff(ref: torch.Tensor, got: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (the absolute norm of the difference where ref is 0)."""
    r, g = ref.detach().double(), got.detach().double()
    denom = float(r.norm())
    diff = float((g - r).norm())
    return diff / denom if denom > 0 else diff


def compare_states(
    ref: dict[str, torch.Tensor],
    got: dict[str, torch.Tensor],
    rtol: float = PARAM_RTOL,
    what: str = "state_dict",
    loose: dict[str, float] | None = None,
) -> None:
    """Same keys (no wrapper prefixes), host CPU tensors with the reference's dtype and shape,
    floating tensors within `rtol` in ||delta||/||ref||, other tensors equal. `loose` maps a key
    substring to a larger tolerance for the tensors it matches (say why where it is used)."""
    missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    assert not missing and not extra, f"{what}: keys differ; missing {missing[:5]}, unexpected {extra[:5]}"
    bad = []
    for k, r in ref.items():
        g = got[k]
        assert isinstance(g, torch.Tensor), f"{what}[{k}] is a {type(g).__name__}, not a tensor"
        assert g.device.type == "cpu", f"{what}[{k}] is on {g.device}, expected a host (CPU) tensor"
        assert g.dtype == r.dtype and g.shape == r.shape, f"{what}[{k}]: {g.dtype}{tuple(g.shape)} vs {r.dtype}{tuple(r.shape)}"
        if r.is_floating_point():
            d = rel_diff(r.cpu(), g)
            tol = max([rtol] + [t for sub, t in (loose or {}).items() if sub in k])
            if not d <= tol:
                bad.append((k, d))
        elif not torch.equal(r.cpu(), g):
            bad.append((k, float("inf")))
    bad.sort(key=lambda kd: -kd[1])
    assert not bad, f"{what}: {len(bad)}/{len(ref)} tensors differ by more than {rtol:g} in ||delta||/||ref||; worst: " + ", ".join(
        f"{k} ({d:.2e})" for k, d in bad[:5]
    )


def assert_trained(run: RunResult, min_fraction: float = 0.5) -> None:
    """The run really changed the model (so that a parity check is not vacuous)."""
    floats = [k for k, v in run.init_state.items() if v.is_floating_point()]
    changed = [k for k in floats if rel_diff(run.init_state[k], run.state[k].cpu()) > 1e-4]
    assert len(changed) >= min_fraction * len(floats), f"only {len(changed)}/{len(floats)} tensors changed in training"


def assert_parity(
    ref: RunResult,
    got: RunResult,
    loss_rtol: float = LOSS_RTOL,
    param_rtol: float = PARAM_RTOL,
    loose: dict[str, float] | None = None,
) -> None:
    """Every micro-batch loss, every learning rate, the step count and the final state_dict."""
    assert_trained(ref)
    compare_losses(ref.losses, got.losses, loss_rtol)
    compare_losses([lr for s in ref.recorder.lrs for lr in s], [lr for s in got.recorder.lrs for lr in s], 1e-12, "learning rate")
    assert got.trainer.global_step == ref.trainer.global_step, f"{got.trainer.global_step} optimizer steps vs {ref.trainer.global_step}"
    compare_states(ref.state, got.state, param_rtol, loose=loose)


def assert_is_megatrain(run: RunResult) -> None:
    import megatrain_lightning

    assert isinstance(run.trainer.strategy, megatrain_lightning.MegaTrainStrategy), type(run.trainer.strategy)


def run_parity(
    factory: Callable[[], pl.LightningModule],
    strategy: StrategySpec = "megatrain",
    *,
    loss_rtol: float = LOSS_RTOL,
    param_rtol: float = PARAM_RTOL,
    loose: dict[str, float] | None = None,
    **fit_kwargs: Any,
) -> tuple[RunResult, RunResult]:
    """Train with Lightning's default strategy, then with `strategy`; assert parity."""
    ref = fit(factory, None, **fit_kwargs)
    got = fit(factory, strategy, **fit_kwargs)
    if strategy is not None:
        assert_is_megatrain(got)
    assert_parity(ref, got, loss_rtol, param_rtol, loose)
    return ref, got


@pytest.fixture
def one_intra_op_thread() -> Any:
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine OpenMP's waiting
    threads slow every small op down (seen: one GPT-OSS fit 30 s with 2 threads, 0.6 s with 1). Test
    files that compare strategies use it for every test (``pytestmark``), so both sides run alike."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def traced_by_dynamo() -> set[str]:
    """The source files of the frames dynamo has compiled since its last reset (its own record of them)."""
    from torch._dynamo.convert_frame import input_codes

    return {code.co_filename for code in (ref() for ref in input_codes.seen) if code is not None}


def package_files(files: set[str]) -> list[str]:
    """Those of ``files`` that are the package's own source."""
    import megatrain_lightning

    root = str(Path(megatrain_lightning.__file__).resolve().parent) + os.sep
    return sorted(f for f in files if str(Path(f).resolve()).startswith(root))


@pytest.fixture
def compile_without_codegen(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile`` with AOTAutograd's decompositions and min-cut partitioner but no kernels written (backend
    ``aot_eager_decomp_partition``): dynamo captures the same graphs, with the same graph breaks, recompute and
    selective checkpoint, as under inductor; only inductor's C++ kernels for the CPU, which no run compiles by
    default (``compiles_by_default``), are not made: built cold on 2 cores they were most of the compiled-block
    tests' time (the two files alone: 75 + 138 s, 31 + 49 s without). A test marked ``inductor`` compiles with
    inductor itself. Test files of compiled blocks use it for every test (``pytestmark``)."""
    if request.node.get_closest_marker("inductor") is not None:
        return
    compile_ = torch.compile

    def without_codegen(model: Any = None, **kwargs: Any) -> Any:
        kwargs.setdefault("backend", "aot_eager_decomp_partition")
        return compile_(model, **kwargs) if model is not None else compile_(**kwargs)

    monkeypatch.setattr(torch, "compile", without_codegen)


@pytest.fixture
def block_updates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The block of each update the engine ran on the device (``engine/device_update.py``), in order."""
    from megatrain_lightning.engine.device_update import DeviceUpdate

    calls: list[int] = []
    run_block = DeviceUpdate.run_block

    def counted(self: DeviceUpdate, block: int, *args: Any, **kwargs: Any) -> Any:
        calls.append(block)
        return run_block(self, block, *args, **kwargs)

    monkeypatch.setattr(DeviceUpdate, "run_block", counted)
    return calls


@pytest.fixture
def compiled_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """(grad enabled, matmuls_only) of each compiled block call."""
    from megatrain_lightning.engine.compiled import CompiledBlocks

    calls: list[tuple[bool, bool]] = []
    call = CompiledBlocks.call

    def counted(self: Any, block: int, original: Any, module: Any, args: tuple, kwargs: dict,
                matmuls_only: bool = False) -> Any:
        calls.append((torch.is_grad_enabled(), matmuls_only))
        return call(self, block, original, module, args, kwargs, matmuls_only)

    monkeypatch.setattr(CompiledBlocks, "call", counted)
    return calls
