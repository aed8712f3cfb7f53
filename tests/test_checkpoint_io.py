"""ShardedCheckpointIO (issue 5): Lightning checkpoints as one torch file (small) or a directory of
safetensors shards written a shard at a time (large), atomically; MegaTrainStrategy's default.

Round trip of every kind of tensor a checkpoint holds, exact resume through `Trainer.fit(ckpt_path=...)`
in both formats, the previous checkpoint surviving an interrupted save, Lightning's and torch's own
readers on megatrain checkpoints (`load_from_checkpoint`, `Trainer(strategy="auto")`, `torch.load`,
after `consolidate` for a directory), and (slow) the host memory a save and a consolidation cost.
Faults (kills, damaged bytes, weights_only, mappings): tests/test_checkpoint_faults.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatrain_lightning.checkpoint_io as cio
from conftest import fit, megatrain
from megatrain_lightning.checkpoint_io import ShardedCheckpointIO
from zoo import TinyLlama


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def tensors_equal(a: Any, b: Any, where: str = "checkpoint") -> None:
    """Same structure and container types; tensors equal in dtype, shape and every bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            tensors_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            tensors_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def sample_checkpoint() -> dict[str, Any]:
    """What a MegaTrainStrategy checkpoint holds: parameters and Adam moments as views of one flat fp32
    buffer each, plus the awkward cases (overlapping and transposed views, a tied weight, ints, bf16,
    0-d and empty tensors, tensors in lists, tuples and callback state)."""
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(4 * 6 + 6 + 8, generator=g)  # the strategy's flat host store
    w, b, v = flat[:24].view(4, 6), flat[24:30], flat[30:]
    moments = torch.randn(2, 38, generator=g)
    m, s = moments[0], moments[1]  # two views of one storage
    return {
        "epoch": 1,
        "state_dict": OrderedDict(
            [
                ("layer.weight", w),
                ("layer.bias", b),
                ("head.weight", w),  # tied: the same tensor under two names
                ("vec", v),
                ("first_row_again", flat[:6]),  # overlaps layer.weight
                ("weight_t", w.t()),  # non-contiguous
                ("strided", flat[::3]),  # non-contiguous, overlapping everything
                ("bf16", torch.randn(5, generator=g).to(torch.bfloat16)),
                ("steps", torch.arange(7, dtype=torch.int64)),
                ("mask", torch.tensor([True, False])),
                ("empty", torch.empty(0, 3)),
            ]
        ),
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": m[:24].view(4, 6), "exp_avg_sq": s[:24].view(4, 6)},
                          1: {"step": torch.tensor(3.0), "exp_avg": m[24:30], "exp_avg_sq": s[24:30]}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
            }
        ],
        "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.5), "kth": [torch.ones(2), "x"]}},
        "pair": (torch.zeros(3), None),
    }


def test_round_trip(tmp_path: Path) -> None:
    ck = sample_checkpoint()
    before = OrderedDict((k, v.clone()) for k, v in ck["state_dict"].items())
    io = ShardedCheckpointIO(max_shard_bytes=64)
    path = tmp_path / "epoch=1.ckpt"
    io.save_checkpoint(ck, path)
    assert path.is_dir() and (path / cio.META_NAME).is_file()
    assert len(list(path.glob("shard-*.safetensors"))) >= 3
    assert (path / cio.META_NAME).stat().st_size < 4096, "tensors leaked into meta.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1.ckpt"], "a temporary directory was left behind"
    # the checkpoint given to save is not modified
    tensors_equal(before, ck["state_dict"], "the checkpoint given to save")
    loaded = io.load_checkpoint(path)
    tensors_equal(ck, loaded)
    sd = loaded["state_dict"]
    assert sd["head.weight"] is sd["layer.weight"], "a tied tensor should load as one tensor"
    assert all(t.is_contiguous() for t in sd.values())


def test_contiguous_host_tensors_are_not_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The strategy's views reach safetensors as they are (no copy); only the transposed one is copied."""
    flat = torch.randn(40)
    views = {"a": flat[:24].view(4, 6), "b": flat[24:]}
    seen: list[dict[str, torch.Tensor]] = []
    real = cio._write_shard

    def spy(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
        seen.append(dict(tensors))
        return real(tensors, path)

    monkeypatch.setattr(cio, "_write_shard", spy)
    ShardedCheckpointIO(single_file_max_bytes=0).save_checkpoint({"state_dict": {**views, "t": views["a"].t()}}, tmp_path / "c")
    (written,) = seen
    ptrs = {t.data_ptr() for t in written.values()}
    assert views["a"].data_ptr() in ptrs and views["b"].data_ptr() in ptrs
    assert len(ptrs) == 3, "the transposed view needs its own contiguous copy"


def test_loads_single_file_checkpoint(tmp_path: Path) -> None:
    """Checkpoints written by Lightning's default TorchCheckpointIO keep loading."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    ck = {"state_dict": {"w": torch.randn(3, 2)}, "epoch": 0}
    TorchCheckpointIO().save_checkpoint(ck, tmp_path / "old.ckpt")
    tensors_equal(ck, ShardedCheckpointIO().load_checkpoint(tmp_path / "old.ckpt"))
    ShardedCheckpointIO().remove_checkpoint(tmp_path / "old.ckpt")
    assert not (tmp_path / "old.ckpt").exists()


def test_remove_and_errors(tmp_path: Path) -> None:
    io = ShardedCheckpointIO(max_shard_bytes=16)
    io.save_checkpoint(sample_checkpoint(), tmp_path / "c.ckpt")
    io.remove_checkpoint(tmp_path / "c.ckpt")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "c.ckpt")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        ShardedCheckpointIO(max_shard_bytes=0)
    with pytest.raises(ValueError, match="TorchCheckpointIO"):
        io.save_checkpoint({}, "s3://bucket/c.ckpt")


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_interrupted_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    io = ShardedCheckpointIO(max_shard_bytes=64)
    path = tmp_path / "last.ckpt"
    old = sample_checkpoint()
    io.save_checkpoint(old, path)
    old_files = sorted(p.name for p in path.iterdir())

    new = sample_checkpoint()
    new["state_dict"]["layer.weight"].add_(1.0)
    new["epoch"] = 2
    calls = 0
    real = cio._write_shard

    def fail_on_second(tensors: dict[str, torch.Tensor], shard_path: Path) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise exc
        return real(tensors, shard_path)

    monkeypatch.setattr(cio, "_write_shard", fail_on_second)
    with pytest.raises(type(exc)):
        io.save_checkpoint(new, path)
    assert calls == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"], "a temporary directory was left behind"
    assert sorted(p.name for p in path.iterdir()) == old_files
    tensors_equal(old, io.load_checkpoint(path))

    monkeypatch.setattr(cio, "_write_shard", real)
    io.save_checkpoint(new, path)  # a complete save then replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    tensors_equal(new, io.load_checkpoint(path))


# ---------------------------------------------------------------------------------------------
# through the Trainer
# ---------------------------------------------------------------------------------------------
def test_strategy_default_is_sharded() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from megatrain_lightning import MegaTrainStrategy

    assert isinstance(MegaTrainStrategy().checkpoint_io, ShardedCheckpointIO)
    assert isinstance(pl.Trainer(strategy="megatrain", accelerator="cpu", logger=False).strategy.checkpoint_io, ShardedCheckpointIO)
    own = TorchCheckpointIO()
    assert MegaTrainStrategy(checkpoint_io=own).checkpoint_io is own


@pytest.mark.parametrize("fmt", ["directory", "file"])
def test_trainer_resume_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """2 epochs of 3 batches; a ModelCheckpoint at the end of epoch 1 (through the strategy's default
    checkpoint_io: tiny shards, or its default single file); a fresh Trainer and module (another seed)
    resume from it and end with exactly the uninterrupted run's weights."""
    if fmt == "directory":
        monkeypatch.setattr(ShardedCheckpointIO.__init__, "__defaults__", (4096, None))  # tiny shards: a directory
    factory = partial(TinyLlama, n_train=12, batch_size=4, optimizer="adamw", scheduler=True)
    full = fit(factory, "megatrain", max_epochs=2, max_steps=-1)
    assert len(full.losses) == 6

    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    first = fit(factory, "megatrain", max_epochs=1, max_steps=-1, callbacks=[ckpt], enable_checkpointing=True)
    assert isinstance(first.trainer.strategy.checkpoint_io, ShardedCheckpointIO)
    path = tmp_path / "epoch=0.ckpt"
    if fmt == "directory":
        assert path.is_dir(), sorted(p.name for p in tmp_path.iterdir())
        shards = sorted(path.glob("shard-*.safetensors"))
        assert len(shards) >= 2, [p.name for p in path.iterdir()]
    else:
        assert path.is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0.ckpt"]
    saved = ShardedCheckpointIO().load_checkpoint(path, weights_only=False)
    assert saved["optimizer_states"][0]["state"], "the checkpoint holds no optimizer state"
    tensors_equal(first.state, dict(saved["state_dict"]), "checkpoint state_dict")

    resumed = fit(factory, "megatrain", seed=1, max_epochs=2, max_steps=-1, ckpt_path=str(path))
    assert resumed.trainer.global_step == 6
    assert resumed.losses == full.losses[3:]
    tensors_equal(full.state, resumed.state, "resumed vs uninterrupted state_dict")


@pytest.mark.parametrize("fmt", ["file", "directory"])
def test_top_k_last_and_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """ModelCheckpoint's bookkeeping works with both formats: save_top_k removes the older ones,
    save_last writes `last.ckpt` (a copy, then a symbolic link), and `ckpt_path="last"` resumes."""
    if fmt == "directory":
        monkeypatch.setattr(ShardedCheckpointIO.__init__, "__defaults__", (4096, 0))
    factory = partial(TinyLlama, n_train=12, batch_size=4)
    kw: dict[str, Any] = dict(dirpath=tmp_path, every_n_train_steps=1, save_top_k=1, monitor="step", mode="max")
    fit(factory, "megatrain", max_steps=3, callbacks=[ModelCheckpoint(save_last=True, **kw)], enable_checkpointing=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    last = tmp_path / "last.ckpt"
    assert (last.is_dir() if fmt == "directory" else last.is_file()) and not last.is_symlink()
    run = fit(factory, "megatrain", max_steps=5, callbacks=[ModelCheckpoint(save_last="link", **kw)],
              enable_checkpointing=True, ckpt_path="last")
    assert run.trainer.global_step == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1-step=5.ckpt", "last.ckpt"]
    assert (tmp_path / "last.ckpt").is_symlink()
    assert ShardedCheckpointIO().load_checkpoint(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 5


def test_explicit_checkpoint_io(tmp_path: Path) -> None:
    """`MegaTrainStrategy(checkpoint_io=ShardedCheckpointIO(...))` is used, and `trainer.save_checkpoint` writes through it."""
    factory = partial(TinyLlama, n_train=4, batch_size=4)
    run = fit(factory, megatrain(checkpoint_io=ShardedCheckpointIO(max_shard_bytes=2048)), max_steps=1)
    run.trainer.save_checkpoint(tmp_path / "manual.ckpt")
    assert len(list((tmp_path / "manual.ckpt").glob("shard-*.safetensors"))) >= 2


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch
    from megatrain_lightning.checkpoint_io import ShardedCheckpointIO

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    n = 2**28  # 1 GiB of fp32 weights, as the strategy's flat store: one buffer, many views
    flat = torch.ones(n)
    state = {f"layers.{i}.weight": v.view(2048, -1) for i, v in enumerate(flat.chunk(64))}
    state["t"] = flat[: 2**22].view(2048, -1).t()  # 16 MiB non-contiguous: copied, one shard at a time
    ckpt = {"state_dict": state, "optimizer_states": [{"state": {}, "param_groups": []}], "epoch": 0}
    before = peak()
    ShardedCheckpointIO(max_shard_bytes=256 * 2**20).save_checkpoint(ckpt, sys.argv[1])
    print(json.dumps({"before": before, "after": peak(), "bytes": n * 4 + 2**24}))
    """
)


@pytest.mark.slow
def test_save_memory_is_bounded(tmp_path: Path) -> None:
    """Saving 1 GiB of fp32 weights raises peak host RSS by far less than the checkpoint
    (TorchCheckpointIO: by at least the checkpoint, its in-memory BytesIO)."""
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "big.ckpt")], capture_output=True, text=True, check=True
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["after"] - r["before"]
    assert grew < 0.5 * r["bytes"], f"saving {r['bytes'] / 2**30:.2f} GiB raised peak RSS by {grew / 2**30:.2f} GiB"
    assert len(list((tmp_path / "big.ckpt").glob("shard-*.safetensors"))) == 5


# ---------------------------------------------------------------------------------------------
# Lightning's and torch's own readers
# ---------------------------------------------------------------------------------------------
def test_small_checkpoint_is_one_torch_file(tmp_path: Path) -> None:
    """At most single_file_max_bytes (default: one shard): exactly what torch.save writes."""
    ck = sample_checkpoint()
    ShardedCheckpointIO().save_checkpoint(ck, tmp_path / "c.ckpt")
    assert (tmp_path / "c.ckpt").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]
    tensors_equal(ck, torch.load(tmp_path / "c.ckpt", weights_only=True))
    tensors_equal(ck, ShardedCheckpointIO().load_checkpoint(tmp_path / "c.ckpt"))
    # the size counts each storage once, whole: 38 + 2*38 floats + the small ones
    assert cio._storage_bytes(ck) < 1024
    ShardedCheckpointIO(single_file_max_bytes=cio._storage_bytes(ck) - 1).save_checkpoint(ck, tmp_path / "c.ckpt")
    assert (tmp_path / "c.ckpt").is_dir(), "one byte over the limit: a directory (replacing the file)"
    tensors_equal(ck, ShardedCheckpointIO().load_checkpoint(tmp_path / "c.ckpt"))
    ShardedCheckpointIO().save_checkpoint(ck, tmp_path / "c.ckpt")  # and back: a file replaces the directory
    assert (tmp_path / "c.ckpt").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]


def test_consolidate_directory_into_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatrain_lightning.consolidate import main

    ck = sample_checkpoint()
    ShardedCheckpointIO(max_shard_bytes=64).save_checkpoint(ck, tmp_path / "d.ckpt")
    assert main([str(tmp_path / "d.ckpt"), str(tmp_path / "one.ckpt")]) == 0
    assert "wrote" in capsys.readouterr().out
    one = torch.load(tmp_path / "one.ckpt", weights_only=True)
    tensors_equal(ShardedCheckpointIO().load_checkpoint(tmp_path / "d.ckpt"), one)
    assert one["state_dict"]["head.weight"] is one["state_dict"]["layer.weight"], "a tied tensor stays one tensor"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.ckpt", "one.ckpt"]
    assert main([str(tmp_path / "one.ckpt"), str(tmp_path / "two.ckpt")]) == 2
    assert "a single file already" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["file", "consolidated"])
def test_lightning_and_auto_strategy_read_a_megatrain_checkpoint(tmp_path: Path, fmt: str) -> None:
    """`TinyLlama.load_from_checkpoint(path)` and `Trainer(strategy="auto").fit(ckpt_path=path)` on a
    checkpoint written under strategy="megatrain": a single file as written, or a directory checkpoint
    after `python -m megatrain_lightning.consolidate`. Both restore it bit for bit, and the auto run
    continues as the uninterrupted native run does."""
    from megatrain_lightning.consolidate import consolidate

    factory = partial(TinyLlama, n_train=12, batch_size=4, optimizer="adamw", scheduler=True)
    io = {"file": {}, "consolidated": {"max_shard_bytes": 4096, "single_file_max_bytes": 0}}[fmt]
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    first = fit(factory, megatrain(checkpoint_io=ShardedCheckpointIO(**io)), max_epochs=1, max_steps=-1, callbacks=[ckpt],
                enable_checkpointing=True)
    path = tmp_path / "epoch=0.ckpt"
    if fmt == "consolidated":
        assert path.is_dir()
        path = consolidate(path, tmp_path / "consolidated.ckpt")
    assert path.is_file()
    saved = torch.load(path, weights_only=True)

    loaded = TinyLlama.load_from_checkpoint(path)
    tensors_equal(first.state, {k: v for k, v in loaded.state_dict().items()}, "load_from_checkpoint")
    assert loaded.hparams.n_train == 12

    # the auto strategy restores the weights and the Adam state bit for bit ...
    at_ckpt = fit(factory, None, seed=1, max_epochs=1, max_steps=-1, ckpt_path=str(path))
    assert at_ckpt.trainer.global_step == 3 and at_ckpt.losses == []
    tensors_equal(first.state, at_ckpt.state, "auto strategy, restored")
    tensors_equal(saved["optimizer_states"][0]["state"], at_ckpt.trainer.optimizers[0].state_dict()["state"], "Adam state")
    # ... and trains on as the uninterrupted native run (megatrain is within 1e-5 of it: the parity tests)
    from conftest import compare_losses, compare_states

    native = fit(factory, None, max_epochs=2, max_steps=-1)
    resumed = fit(factory, None, seed=1, max_epochs=2, max_steps=-1, ckpt_path=str(path))
    assert resumed.trainer.global_step == 6
    compare_losses(native.losses[3:], resumed.losses, what="auto strategy resumed from a megatrain checkpoint")
    compare_states(native.state, resumed.state)


CONSOLIDATE_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, time, torch
    from megatrain_lightning.checkpoint_io import ShardedCheckpointIO
    from megatrain_lightning.consolidate import consolidate

    def anon() -> int:  # the process's own memory: what a consolidation must not grow with the checkpoint
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    n = 2**27  # 512 MiB of fp32, as the strategy's flat store
    flat = torch.ones(n)
    ck = {"state_dict": {f"layers.{i}.weight": v for i, v in enumerate(flat.chunk(32))}, "epoch": 0}
    ShardedCheckpointIO(max_shard_bytes=64 * 2**20, single_file_max_bytes=0).save_checkpoint(ck, sys.argv[1])
    del ck, flat
    peak, done = [anon()], []
    def watch() -> None:
        while not done:
            peak.append(anon())
            time.sleep(0.002)
    t = threading.Thread(target=watch)
    t.start()
    before = peak[0]
    consolidate(sys.argv[1], sys.argv[2])
    done.append(1)
    t.join()
    one = torch.load(sys.argv[2], weights_only=True)
    assert all(bool((v == 1).all()) for v in one["state_dict"].values())
    print(json.dumps({"before": before, "peak": max(peak), "bytes": n * 4}))
    """
)


@pytest.mark.slow
def test_consolidate_memory_is_bounded(tmp_path: Path) -> None:
    """Consolidating 512 MiB raises the process's own (anonymous) memory by far less than the checkpoint:
    torch.save writes from file-backed maps of the shards."""
    out = subprocess.run(
        [sys.executable, "-c", CONSOLIDATE_SCRIPT, str(tmp_path / "d.ckpt"), str(tmp_path / "one.ckpt")],
        capture_output=True, text=True, check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["peak"] - r["before"]
    print(f"\nconsolidating {r['bytes'] / 2**20:.0f} MiB raised anonymous memory by {grew / 2**20:.1f} MiB")
    assert grew < 0.25 * r["bytes"], f"consolidating {r['bytes'] / 2**20:.0f} MiB grew anonymous memory by {grew / 2**20:.0f} MiB"


def test_older_formats_still_load(tmp_path: Path) -> None:
    """A format-1 directory (before index.json: no checksums) and a pre-zip torch file."""
    import safetensors.torch

    w = torch.randn(3, 4)
    v1 = tmp_path / "v1.ckpt"
    v1.mkdir()
    safetensors.torch.save_file({"0": w}, str(v1 / "shard-00001.safetensors"), metadata={"format": "pt"})
    ph = {cio._PLACEHOLDER: 1, "shard": "shard-00001.safetensors", "key": "0", "dtype": "float32", "shape": [3, 4]}
    torch.save({"format_version": 1, "checkpoint": {"state_dict": {"w": ph}, "epoch": 2}}, v1 / cio.META_NAME)
    tensors_equal({"state_dict": {"w": w}, "epoch": 2}, ShardedCheckpointIO().load_checkpoint(v1))
    torch.save({"w": w}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    tensors_equal({"w": w}, ShardedCheckpointIO().load_checkpoint(tmp_path / "legacy.ckpt"))


class MetaBuiltLlama(TinyLlama):
    """TinyLlama built in `configure_model`: on the meta device under megatrain, materialised at setup."""

    def build_model(self) -> Any:
        return None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = TinyLlama.build_model(self)


def test_resume_of_a_meta_built_module_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning restores before setup (so that fit(weights_only=...) reaches the loader): the weights of
    a module still on the meta device wait until setup has built the host store."""
    from megatrain_lightning import MegaTrainStrategy

    factory = partial(MetaBuiltLlama, n_train=12, batch_size=4)
    full = fit(factory, "megatrain", max_epochs=2, max_steps=-1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    fit(factory, "megatrain", max_epochs=1, max_steps=-1, callbacks=[ckpt], enable_checkpointing=True)
    waited: list[bool] = []
    real_setup = MegaTrainStrategy.setup

    def setup(self: Any, trainer: Any) -> None:
        waited.append(self._pending_model_state is not None)
        real_setup(self, trainer)

    monkeypatch.setattr(MegaTrainStrategy, "setup", setup)
    resumed = fit(factory, "megatrain", seed=1, max_epochs=2, max_steps=-1, ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    assert waited == [True]
    assert resumed.losses == full.losses[3:]
    tensors_equal(full.state, resumed.state, "resumed vs uninterrupted state_dict")
