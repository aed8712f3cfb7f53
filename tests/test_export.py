"""Hugging Face export: a model trained with the megatrain strategy, exported in shards, reloads with
`from_pretrained` to the same logits; the export is atomic and refuses bad input.

Tiny models built from configs (no downloads). The trained runs are shared by the tests of a module
(one fit per model, about 2 s each on 2 cores).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedModel

import megatrain_lightning
from megatrain_lightning.callbacks import HFExport
from megatrain_lightning.export import INDEX_NAME, WEIGHTS_NAME, export_hf
from zoo import TinyLlama, TinyQwen2, UserBlocks

SHARD = 40_000  # bytes: a tiny model (~140 kB of fp32 weights) goes into 4 or more shards
INPUT = torch.tensor([[1, 5, 9, 2, 77, 30, 4, 11, 60, 8, 0, 95]])


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Any:
    """Tiny models gain nothing from intra-op threads (see test_parity.py); module scope, so that
    the shared training runs get it too."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class SnapshotAfterFirstEpoch(pl.Callback):
    """After HFExport's first epoch-end export: a copy of that export and of the state the strategy
    reports at that moment (what a Lightning checkpoint would hold)."""

    def __init__(self, export_dir: Path, copy_dir: Path) -> None:
        self.export_dir, self.copy_dir = export_dir, copy_dir
        self.state: dict[str, torch.Tensor] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            shutil.copytree(self.export_dir, self.copy_dir)
            full = trainer.strategy.lightning_module_state_dict()
            self.state = {k.removeprefix("model."): v.detach().clone() for k, v in full.items()}


def logits(model: PreTrainedModel) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=INPUT).logits.float()


def reload(directory: Path, like: PreTrainedModel, **kwargs: Any) -> PreTrainedModel:
    """from_pretrained with the trained model's attention kernel (eager and sdpa round differently),
    asserting that every weight was found and used."""
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, attn_implementation=like.config._attn_implementation, **kwargs
    )
    assert not any(info.values()), f"loading {directory}: {info}"
    return model


def shard_files(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out[path.name] = {k: f.get_tensor(k) for k in f.keys()}
    return out


def check_index(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The index names every shard on disk and every tensor in them, with the right total size."""
    files = shard_files(directory)
    index = json.loads((directory / INDEX_NAME).read_text())
    assert not (directory / WEIGHTS_NAME).exists()
    n = len(files)
    assert sorted(files) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert index["weight_map"] == {k: name for name, tensors in files.items() for k in tensors}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for ts in files.values() for t in ts.values())
    return files


@pytest.fixture(scope="module", params=[TinyLlama, TinyQwen2], ids=["llama", "qwen2_tied"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """4 steps with the megatrain strategy (2 epochs of 2 steps), HFExport after every epoch."""
    root = tmp_path_factory.mktemp(request.param.__name__)
    export_dir = root / "hf"
    snapshot = SnapshotAfterFirstEpoch(export_dir, root / "hf_epoch0")
    pl.seed_everything(0, verbose=False)
    module = request.param(n_train=8, batch_size=4)
    init = {k: v.clone() for k, v in module.model.state_dict().items()}
    trainer = pl.Trainer(
        strategy="megatrain",
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[HFExport(export_dir, every_n_epochs=1, max_shard_bytes=SHARD), snapshot],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module)
    assert isinstance(trainer.strategy, megatrain_lightning.MegaTrainStrategy)
    model = module.model
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, init[k])]
    assert len(changed) == len(init), f"untrained: {sorted(set(init) - set(changed))}"
    return {"model": model, "dir": export_dir, "epoch0": snapshot.copy_dir, "epoch0_state": snapshot.state, "root": root}


def test_trained_model_reloads_with_identical_logits(trained: dict[str, Any]) -> None:
    model, directory = trained["model"], trained["dir"]
    files = check_index(directory)
    assert len(files) >= 3
    for name, tensors in files.items():  # no shard above the limit (no single tensor exceeds it here)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= SHARD, name
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__] and config["dtype"] == "float32"
    assert (directory / "generation_config.json").is_file()

    loaded = reload(directory, model)
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)
    got = loaded.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(got[key], value), key
    if model.config.tie_word_embeddings:  # written once, as save_pretrained does, and tied again on load
        assert "lm_head.weight" not in {k for ts in files.values() for k in ts}
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_epoch_end_export_holds_the_weights_of_that_moment(trained: dict[str, Any]) -> None:
    """The mid-training export (with the strategy's engine live) equals what the strategy reports
    then, and is not the final state."""
    loaded = reload(trained["epoch0"], trained["model"]).state_dict()
    expected = trained["epoch0_state"]
    assert expected.keys() == loaded.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    final = trained["model"].state_dict()
    assert not torch.equal(loaded["model.layers.1.mlp.up_proj.weight"], final["model.layers.1.mlp.up_proj.weight"])


def test_bf16_export(trained: dict[str, Any], tmp_path: Path) -> None:
    model = trained["model"]
    config_dtype = model.config.dtype
    out = export_hf(model, tmp_path / "bf16", max_shard_bytes=SHARD // 2, dtype=torch.bfloat16)
    files = check_index(out)
    assert len(files) >= 3
    assert {t.dtype for ts in files.values() for t in ts.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.dtype == torch.float32 and model.config.dtype == config_dtype  # the model is untouched

    loaded = reload(out, model)
    assert loaded.dtype == torch.bfloat16
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.to(torch.bfloat16)), key
    ref = logits(model)
    # bf16 weights and activations: 8 mantissa bits, a few roundings deep
    torch.testing.assert_close(logits(loaded), ref, rtol=0, atol=0.05 * float(ref.abs().max()))


# ---------------------------------------------------------------------------------------------
# untrained models: layouts, atomicity, bad input
# ---------------------------------------------------------------------------------------------
def tiny_llama() -> PreTrainedModel:
    torch.manual_seed(0)
    return TinyLlama().model


def tiny_mixtral() -> PreTrainedModel:
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
    )
    return MixtralForCausalLM(config)


def test_fused_experts_are_written_in_the_original_layout(tmp_path: Path) -> None:
    """Mixtral fuses per-expert weights at load; the export writes them per expert, block by block,
    as save_pretrained does, and they load back to the same tensors."""
    model = tiny_mixtral()
    files = check_index(export_hf(model, tmp_path / "moe", max_shard_bytes=20_000))
    keys = {k for ts in files.values() for k in ts}
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in keys
    loaded = reload(tmp_path / "moe", model)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("build", [lambda: TinyQwen2().model, tiny_mixtral], ids=["qwen2_tied", "mixtral"])
def test_same_files_as_save_pretrained(build: Any, tmp_path: Path) -> None:
    """Same tensors under the same names, same config and generation config as transformers' own
    `save_pretrained` writes (shard boundaries may differ)."""
    torch.manual_seed(0)
    model = build()
    export_hf(model, tmp_path / "ours", max_shard_bytes=SHARD)
    model.save_pretrained(tmp_path / "theirs", max_shard_size=SHARD)
    ours, theirs = shard_files(tmp_path / "ours"), shard_files(tmp_path / "theirs")
    assert len(theirs) > 1 and len(ours) > 1
    ours_t = {k: t for ts in ours.values() for k, t in ts.items()}
    theirs_t = {k: t for ts in theirs.values() for k, t in ts.items()}
    assert ours_t.keys() == theirs_t.keys()
    for key, t in theirs_t.items():
        assert torch.equal(ours_t[key], t), key
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "ours" / name).read_text()) == json.loads((tmp_path / "theirs" / name).read_text()), name
    metadata = [json.loads((tmp_path / d / INDEX_NAME).read_text())["metadata"] for d in ("ours", "theirs")]
    assert metadata[0] == metadata[1]


def test_small_model_is_one_file_with_tokenizer(tmp_path: Path) -> None:
    saved: list[Path] = []

    class Tokenizer:
        def save_pretrained(self, directory: Path) -> None:
            saved.append(Path(directory))
            (Path(directory) / "tokenizer.json").write_text("{}")

    model = tiny_llama()
    out = export_hf(model, tmp_path / "one", tokenizer=Tokenizer())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", WEIGHTS_NAME, "tokenizer.json"]
    assert saved and saved[0] != out  # written in the temporary directory, then renamed
    torch.testing.assert_close(logits(reload(out, model)), logits(model), rtol=0, atol=0)


def listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt])
def test_interrupted_export_keeps_the_previous_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: type) -> None:
    model = tiny_llama()
    out = export_hf(model, tmp_path / "hf", max_shard_bytes=SHARD)
    before = listing(out)

    calls = []
    real_save = safetensors.torch.save_file

    def failing_save(*args: Any, **kwargs: Any) -> None:
        calls.append(args[1])
        if len(calls) == 2:
            raise interrupt("disk full")
        real_save(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # a different model: a half-written export would show
    with pytest.raises(interrupt, match="disk full"):
        export_hf(model, out, max_shard_bytes=SHARD, dtype=torch.bfloat16)
    assert len(calls) == 2 and Path(calls[0]).parent.parent == tmp_path  # it was writing a sibling
    assert listing(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary directory left

    # into a fresh directory: nothing at all is left behind
    calls.clear()
    with pytest.raises(interrupt):
        export_hf(model, tmp_path / "fresh", max_shard_bytes=SHARD)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]

    # and once the disk is back, the new export replaces the old one whole
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    export_hf(model, out, max_shard_bytes=SHARD)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert torch.equal(reload(out, model).model.norm.weight, model.model.norm.weight)


def test_bad_input_is_refused_with_the_argument_named(tmp_path: Path) -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="^model: expected a transformers.PreTrainedModel, got Linear"):
        export_hf(torch.nn.Linear(2, 2), tmp_path / "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got TinyLlama; .* `module.model`"):
        export_hf(TinyLlama(), tmp_path / "x")  # type: ignore[arg-type]
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    with pytest.raises(ValueError, match="^out_dir=.*file: exists and is not a directory"):
        export_hf(model, a_file)
    with pytest.raises(ValueError, match="^out_dir=.*is a file, not a directory"):
        export_hf(model, a_file / "sub")
    with pytest.raises(ValueError, match="^out_dir=''"):
        export_hf(model, "")
    unrelated = tmp_path / "home"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a previous export .* refusing to replace it"):
        export_hf(model, unrelated)
    assert (unrelated / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="^max_shard_bytes=0"):
        export_hf(model, tmp_path / "x", max_shard_bytes=0)
    with pytest.raises(ValueError, match="^dtype=torch.int8"):
        export_hf(model, tmp_path / "x", dtype=torch.int8)
    with pytest.raises(ValueError, match="^tokenizer: a str has no save_pretrained"):
        export_hf(model, tmp_path / "x", tokenizer="gpt2")
    with torch.device("meta"):
        on_meta = type(model)(model.config)
    with pytest.raises(ValueError, match="^model: .* tensors .* are on the meta device"):
        export_hf(on_meta, tmp_path / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "home"]  # nothing was written


def test_callback_without_a_hugging_face_model_fails_before_training(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        strategy="megatrain", accelerator="cpu", max_steps=1, callbacks=[HFExport(tmp_path / "hf")],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module = UserBlocks()
    with pytest.raises(ValueError, match="HFExport: UserBlocks holds no transformers.PreTrainedModel"):
        trainer.fit(module)
    assert trainer.global_step == 0 and not (tmp_path / "hf").exists()


MEMORY_PROBE = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.export import export_hf

def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

with torch.device("meta"):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                                         num_hidden_layers=16, num_attention_heads=8))
model = model.to_empty(device="cpu")
for p in model.parameters():
    p.data.fill_(0.01)
base = status("VmRSS")
try:  # the peak (VmHWM) restarts from the current RSS: pages swapped out before do not count
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
assert status("VmHWM") < base + 20e6, "peak already above RSS"
export_hf(model, sys.argv[1], max_shard_bytes=8 * 2**20, dtype=torch.bfloat16)
print(sum(p.numel() for p in model.parameters()), status("VmHWM") - base)
"""


@pytest.mark.slow  # about 7 s: a fresh interpreter imports transformers
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_export_holds_about_one_shard_not_the_model(tmp_path: Path) -> None:
    """A 240 MB fp32 model exported to bf16 (a converted copy would be 120 MB) with 8 MiB shards,
    in a fresh process: the peak RSS rises by about one shard (the C allocator may keep a second
    one cached), not by the model."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "hf")], capture_output=True, text=True, check=True)
    params, rise = map(int, done.stdout.split())
    assert params * 4 > 200e6
    assert rise < 3 * 8 * 2**20, f"peak RSS rose by {rise / 1e6:.0f} MB exporting {params * 2 / 1e6:.0f} MB of bf16 weights"


def test_callback_takes_the_dtype_by_name_as_a_yaml_config_gives_it(tmp_path: Path) -> None:
    assert HFExport(tmp_path / "hf", dtype="bfloat16").dtype is torch.bfloat16
    assert HFExport(tmp_path / "hf", dtype="torch.float16").dtype is torch.float16
    with pytest.raises(ValueError, match="dtype=.int8.: expected a floating-point dtype name"):
        HFExport(tmp_path / "hf", dtype="int8")
