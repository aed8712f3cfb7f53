"""Checkpoints under faults: hard kills, damaged bytes, untrusted pickles, deleted files.

- kill -9 (a real ``os.kill(pid, SIGKILL)``) of a child process that trains under ``strategy="megatrain"``
  with a ModelCheckpoint saving every step (top 2 plus ``last.ckpt``), at a random moment inside a save
  or inside a removal; each next child resumes with ``ckpt_path="last"``. After every kill: each visible
  checkpoint is complete and holds exactly the state of the uninterrupted run at its step, ``last.ckpt``
  is there and is the newest (or one step behind a top-k save in flight), and the next start leaves no
  hidden temporary behind. The chain ends with a resume that must finish on the uninterrupted weights.
  10 trials each in CI, 50 in the slow-marked case elsewhere. Children fork from a forkserver that has torch and
  Lightning imported, so a trial costs a few hundred milliseconds.
- flipped data bytes, truncated shards, a relabelled dtype, swapped header or index entries, a truncated
  or corrupt ``meta.pt``/``index.json``, a damaged single file: refused with a CheckpointError naming the
  file, before Lightning restores anything.
- ``weights_only`` honoured both ways through ``Trainer.fit``; no mapping or open file of a checkpoint
  left after a resumed run, so deleting it frees its disk.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import struct
import threading
import time
import zipfile
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatrain_lightning.atomic_dir as atomic_dir
from conftest import fit
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.checkpoint_io import INDEX_NAME, META_NAME, ShardedCheckpointIO
from megatrain_lightning.errors import CheckpointError
from zoo import HFCausalLM, TinyLlama

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# one batch per epoch: every checkpoint is at an epoch boundary, where a plain dataloader resumes exactly
FACTORY = partial(TinyLlama, n_train=4, batch_size=4)
FORMATS: dict[str, dict[str, int]] = {
    "file": {},  # the default: a tiny model's checkpoint is one torch file
    "directory": {"max_shard_bytes": 32 * 1024, "single_file_max_bytes": 0},  # ~20 shards
}


# ---------------------------------------------------------------------------------------------
# the child process
# ---------------------------------------------------------------------------------------------
class _SignallingIO(ShardedCheckpointIO):
    """Tells the parent when a save or a removal begins (S, R) and ends (s, r, followed by the seconds it
    took, as this process measured them). With a kill plan (op, k, delay), the k-th such operation arms
    a timer thread that sends this process SIGKILL `delay` seconds into it: a removal (~2 ms) is shorter
    than the parent's wake-up latency on a loaded 2-core machine, so the parent could not aim at it."""

    def __init__(self, conn: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.conn = conn
        self.kill_plan: tuple[str, int, float] | None = None
        self.count: Counter = Counter()

    def _begin(self, op: str) -> float:
        self.count[op] += 1
        if self.kill_plan is not None and self.kill_plan[:2] == (op, self.count[op]):
            threading.Timer(self.kill_plan[2], os.kill, (os.getpid(), signal.SIGKILL)).start()
        self.conn.send_bytes(op.encode())
        return time.perf_counter()

    def _end(self, op: str, start: float) -> None:
        self.conn.send_bytes(op.lower().encode() + repr(time.perf_counter() - start).encode())

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        start = self._begin("S")
        super().save_checkpoint(checkpoint, path, storage_options)
        self._end("S", start)

    def remove_checkpoint(self, path: Any) -> None:
        start = self._begin("R")
        super().remove_checkpoint(path)
        self._end("R", start)


class _Started(pl.Callback):
    """At train start (after the strategy's setup, so after its tidy): tell the parent, wait for it to
    look at the directory, and take its kill plan."""

    megatrain_reads_weights = False

    def __init__(self, conn: Any, io: _SignallingIO) -> None:
        self.conn, self.io = conn, io

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.conn.send_bytes(b"T")
        plan = json.loads(self.conn.recv_bytes())
        self.io.kill_plan = tuple(plan) if plan else None  # type: ignore[assignment]


def _checkpointing(dirpath: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True)


def _trainer_kwargs(max_steps: int) -> dict[str, Any]:
    return dict(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=-1, logger=False, enable_progress_bar=False,
                enable_model_summary=False, deterministic=True, limit_val_batches=0, num_sanity_val_steps=0)


def _child(dirpath: str, fmt: str, conn: Any, max_steps: int, no_exchange: bool) -> None:
    torch.set_num_threads(1)
    if no_exchange:  # the fallback path: two renames, and a SIGKILL of ourselves between them
        atomic_dir._renameat2 = None
        real = atomic_dir._move

        def move_then_die(src: Path, dst: Path) -> None:
            real(src, dst)
            if Path(dst).name.startswith(".last.ckpt.old-"):
                os.kill(os.getpid(), signal.SIGKILL)

        atomic_dir._move = move_then_die
    io = _SignallingIO(conn, **FORMATS[fmt])
    pl.seed_everything(0, verbose=False)
    module = FACTORY()
    trainer = pl.Trainer(strategy=MegaTrainStrategy(checkpoint_io=io), callbacks=[_checkpointing(dirpath), _Started(conn, io)],
                         **_trainer_kwargs(max_steps))
    pl.seed_everything(0, verbose=False)
    trainer.fit(module, ckpt_path="last")
    conn.send_bytes(b"D")


_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "lightning.pytorch", "transformers", "megatrain_lightning", "zoo", "test_checkpoint_faults"])


class _Events:
    """What the child said, with the time each byte arrived."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.log: list[tuple[float, bytes]] = []
        self.closed = False

    def _recv(self, timeout: float) -> bytes | None:
        if self.closed or not self.conn.poll(timeout):
            return None
        try:
            b = self.conn.recv_bytes()
        except (EOFError, OSError):
            self.closed = True
            return None
        self.log.append((time.perf_counter(), b))
        return b

    def wait_for(self, what: bytes, count: int = 1, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while sum(b[:1] == what for _, b in self.log) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"the child said {[b for _, b in self.log]} in {timeout} s, waiting for {count} x {what!r}"
            b = self._recv(min(left, 1.0))
            if self.closed or b == b"D":
                return False
        return True

    def drain(self) -> None:
        while not self.closed and self._recv(0.2) is not None:
            pass

    def durations(self, end: bytes) -> list[float]:
        """How long each finished operation took, as the child measured it."""
        return [float(b[1:]) for _, b in self.log if b[:1] == end]

    def open_op(self, begin: bytes, end: bytes) -> bool:
        """Whether the child died inside an operation (its last begin has no end)."""
        seen = [b[:1] for _, b in self.log if b[:1] in (begin, end)]
        return bool(seen) and seen[-1] == begin


def _spawn(dirpath: Path, fmt: str, max_steps: int, no_exchange: bool = False) -> tuple[Any, _Events]:
    conn, child_conn = _CTX.Pipe()
    p = _CTX.Process(target=_child, args=(str(dirpath), fmt, child_conn, max_steps, no_exchange), daemon=True)
    p.start()
    child_conn.close()
    return p, _Events(conn)


# ---------------------------------------------------------------------------------------------
# the parent's checks
# ---------------------------------------------------------------------------------------------
class _Capture(pl.Callback):
    """The uninterrupted run's state after every step (reads weights between steps: declared)."""

    megatrain_reads_weights = True

    def __init__(self) -> None:
        self.states: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        sd = {k: v.detach().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
        opt = copy.deepcopy(trainer.strategy.optimizer_state(trainer.optimizers[0]))
        self.states[trainer.global_step] = (sd, opt)


def _reference(max_steps: int) -> dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    capture = _Capture()
    fit(FACTORY, "megatrain", max_steps=max_steps, max_epochs=-1, callbacks=[capture])
    assert sorted(capture.states) == list(range(1, max_steps + 1))
    return capture.states


def _same_state(ck: dict[str, Any], ref: tuple[dict[str, torch.Tensor], dict[str, Any]], where: str) -> None:
    sd, opt = ref
    got = ck["state_dict"]
    assert list(got) == list(sd), f"{where}: state_dict keys differ"
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{where}: state_dict[{k!r}] differs from the uninterrupted run"
    got_opt = ck["optimizer_states"][0]["state"]
    assert sorted(got_opt) == sorted(opt["state"]), f"{where}: optimizer state keys differ"
    for i, st in opt["state"].items():
        for name, v in st.items():
            assert torch.equal(got_opt[i][name], v), f"{where}: optimizer state[{i}][{name!r}] differs from the uninterrupted run"


def _hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def _lightning_last(d: Path) -> Path | None:
    """The path `fit(ckpt_path="last")` resolves to, as Lightning resolves it (newest `last*.ckpt`)."""
    found = ModelCheckpoint(dirpath=d)._find_last_checkpoints(None)  # type: ignore[arg-type]
    return Path(max(found, key=os.path.getmtime)) if found else None


def _check_after_kill(d: Path, ref: dict[int, Any], stats: Counter) -> None:
    visible = sorted(p for p in d.iterdir() if not p.name.startswith("."))
    steps: dict[Path, int] = {}
    for p in visible:
        ck = ShardedCheckpointIO().load_checkpoint(p)  # complete: every byte checks out
        steps[p] = ck["global_step"]
        _same_state(ck, ref[ck["global_step"]], p.name)
        stats["states checked"] += 1
    if not (d / "last.ckpt").exists() and not stats["last.ckpt written"]:
        return  # killed before the first last.ckpt was complete (after a top-k save of that step)
    stats["last.ckpt written"] = 1  # from now on it must always be there
    last = _lightning_last(d)
    assert last == d / "last.ckpt", f"ckpt_path='last' would pick {last}; the directory holds {[p.name for p in visible]}"
    newest = max(steps.values())
    assert steps[last] >= newest - 1, f"last.ckpt is at step {steps[last]}, a complete checkpoint at {newest}"


def _final_resume(d: Path, ref: dict[int, Any], max_steps: int, stats: Counter) -> None:
    """A last start: it resumes from `last`, tidies, and must end on the uninterrupted run's state."""
    run = fit(FACTORY, megatrain_with_io(), max_steps=max_steps, max_epochs=-1, callbacks=[_checkpointing(str(d))],
              enable_checkpointing=True, ckpt_path="last")
    assert run.trainer.global_step == max_steps
    assert _hidden(d) == [], f"left after a clean run: {_hidden(d)}"
    final = ShardedCheckpointIO().load_checkpoint(d / "last.ckpt")
    _same_state(final, ref[max_steps], "the end of the chain")
    stats["states checked"] += 1


def megatrain_with_io(**io: Any) -> Any:
    return lambda: MegaTrainStrategy(checkpoint_io=ShardedCheckpointIO(**io))


def _kill_trials(tmp_path: Path, trials: int, target: str) -> Counter:
    """`trials` children in one directory, each killed at a random moment inside its k-th save (or
    removal), k in 1..3; then the chain's last resume. A kill can land just past a short operation (a removal takes
    ~10 ms; a busy machine, the suite's other worker, delays the kill): up to `trials` more children are killed until
    half the kills landed inside one."""
    begin, end = (b"S", b"s") if target == "save" else (b"R", b"r")
    max_steps = 4 * 2 * trials + 4
    ref = _reference(max_steps)
    rng = random.Random(1234 + trials)
    d = tmp_path / "ckpts"
    stats: Counter = Counter()
    durations: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for i in range(2 * trials):
        if i >= trials and stats[f"kills inside a {target}"] >= trials // 2:
            break
        fmt = "directory" if target == "remove" or i % 2 else "file"
        seen = durations[fmt]
        mean = sum(seen) / len(seen) if seen else (0.005 if target == "save" else 0.0015)
        k, delay = rng.randint(1, 3), rng.uniform(0, mean)  # a random moment in the k-th operation
        p, events = _spawn(d, fmt, max_steps)
        try:
            assert events.wait_for(b"T"), "the child ended before training"
            if d.exists():
                assert _hidden(d) == [], f"trial {i}: a temporary survived the start: {_hidden(d)}"
            stats["starts checked"] += 1
            if target == "save":  # the parent kills it
                events.conn.send_bytes(b"null")
                if events.wait_for(begin, k):
                    time.sleep(delay)
                    os.kill(p.pid, signal.SIGKILL)
            else:  # it kills itself from a timer thread (see _SignallingIO)
                events.conn.send_bytes(json.dumps(["R", k, delay]).encode())
            p.join(60)
        finally:
            if p.is_alive():  # a failed check: the child would wait for us forever
                os.kill(p.pid, signal.SIGKILL)  # (its Lightning ignores SIGTERM, which multiprocessing sends at exit)
                p.join(30)
        events.drain()
        assert p.exitcode == -signal.SIGKILL, f"trial {i}: the child ended with {p.exitcode}, not by SIGKILL"
        stats["kills"] += 1
        durations[fmt] += events.durations(end)
        stats[f"kills inside a {target}"] += events.open_op(begin, end)
        stats["hidden entries left by the kills"] += len(_hidden(d))
        _check_after_kill(d, ref, stats)
    _final_resume(d, ref, max_steps, stats)
    for fmt, seen in durations.items():
        if seen:
            stats[f"mean ms per {target} ({fmt})"] = round(1000 * sum(seen) / len(seen), 2)
    return stats


# 10 trials each in CI (CI=true), and 50 more in a slow-marked run everywhere else
KILL_TRIALS = [10, pytest.param(50, marks=[pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("CI") == "true", reason="50 kill trials: outside CI (CI runs the 10-trial case)")])]


@pytest.mark.parametrize("trials", KILL_TRIALS)
def test_kill_during_save(tmp_path: Path, trials: int) -> None:
    stats = _kill_trials(tmp_path, trials, "save")
    print(f"\nkill -9 during save, {trials} trials: {dict(stats)}")
    assert trials <= stats["kills"] <= 2 * trials
    assert stats["kills inside a save"] >= trials // 2, "too few kills landed inside a save to say anything"


@pytest.mark.parametrize("trials", KILL_TRIALS)
def test_kill_during_remove(tmp_path: Path, trials: int) -> None:
    stats = _kill_trials(tmp_path, trials, "remove")
    print(f"\nkill -9 during remove, {trials} trials: {dict(stats)}")
    assert trials <= stats["kills"] <= 2 * trials
    assert stats["kills inside a remove"] >= trials // 2, "too few kills landed inside a removal to say anything"


def test_kill_between_the_two_renames_of_the_fallback_replace(tmp_path: Path) -> None:
    """Where the file system cannot swap two names, replace() renames twice; a SIGKILL between the
    two leaves `last.ckpt` missing and the complete previous version in `.last.ckpt.old-*`. The next
    start (here: the CheckpointIO's first use in the directory, or the strategy's setup) gives the name
    back, and `ckpt_path="last"` then resumes from it exactly."""
    ref = _reference(4)
    d = tmp_path / "ckpts"
    p, events = _spawn(d, "directory", 4, no_exchange=True)
    try:
        assert events.wait_for(b"T")
        events.conn.send_bytes(b"null")
    finally:
        p.join(60)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    events.drain()
    assert p.exitcode == -signal.SIGKILL, f"the child was to die between the renames; exit code {p.exitcode}"
    olds = [n for n in _hidden(d) if n.startswith(".last.ckpt.old-")]
    assert not (d / "last.ckpt").exists() and len(olds) == 1, sorted(x.name for x in d.iterdir())
    actions = ShardedCheckpointIO().tidy(d)
    assert any("restored" in a for a in actions), actions
    assert _hidden(d) == []
    assert _lightning_last(d) == d / "last.ckpt"
    ck = ShardedCheckpointIO().load_checkpoint(d / "last.ckpt")
    _same_state(ck, ref[ck["global_step"]], "the restored last.ckpt")
    _final_resume(d, ref, 4, Counter())


# ---------------------------------------------------------------------------------------------
# tidy and remove, without a kill
# ---------------------------------------------------------------------------------------------
def test_tidy_spares_live_writers_and_restores_a_missing_name(tmp_path: Path) -> None:
    dead = _dead_pid()
    for name in (f".a.ckpt.tmp-{dead}-00000000", f".b.ckpt.del-{dead}-00000000", ".c.ckpt.tmp-k2j_3x9a"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard-00001.safetensors").write_bytes(b"x")
    live = tmp_path / f".d.ckpt.tmp-{os.getppid()}-00000000"  # our parent process is alive
    live.mkdir()
    in_flight = atomic_dir.sibling(tmp_path / "e.ckpt", "tmp")
    in_flight.write_bytes(b"being written")
    (tmp_path / f".last.ckpt.old-{dead}-00000000").write_bytes(b"complete")  # its name is missing
    (tmp_path / "f.ckpt").write_bytes(b"new")
    (tmp_path / f".f.ckpt.old-{dead}-00000000").write_bytes(b"old")  # its name is there
    atomic_dir.tidy(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, in_flight.name, "last.ckpt", "f.ckpt"])
    assert (tmp_path / "last.ckpt").read_bytes() == b"complete" and (tmp_path / "f.ckpt").read_bytes() == b"new"
    atomic_dir.release(in_flight)  # no longer in flight: a leftover of ours, tidied like a dead writer's
    atomic_dir.tidy(tmp_path)
    assert not in_flight.exists()


def test_remove_renames_before_deleting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A removal interrupted inside the deletion has already taken the checkpoint's name away."""
    io = ShardedCheckpointIO(**FORMATS["directory"])
    path = tmp_path / "epoch=0-step=1.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.randn(20000)}}, path)

    def killed(p: Any, ignore_errors: bool = False) -> None:
        assert not path.exists(), "the files go while the checkpoint still has its name"
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic_dir.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        io.remove_checkpoint(path)
    hidden = _hidden(tmp_path)
    assert not path.exists() and len(hidden) == 1 and hidden[0].startswith(f".{path.name}.del-"), hidden
    monkeypatch.undo()
    ShardedCheckpointIO().tidy(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_saving_over_a_link_replaces_the_link_not_its_target(tmp_path: Path, fmt: str) -> None:
    """save_last="link" leaves `last.ckpt` a symbolic link; a later save_last=True saves over it."""
    io = ShardedCheckpointIO(**FORMATS[fmt])
    target, last = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.zeros(20000)}}, target)
    last.symlink_to(target.name)
    io.save_checkpoint({"state_dict": {"w": torch.ones(20000)}}, last)
    assert not last.is_symlink() and _hidden(tmp_path) == []
    assert bool((io.load_checkpoint(target)["state_dict"]["w"] == 0).all())
    assert bool((io.load_checkpoint(last)["state_dict"]["w"] == 1).all())
    io.remove_checkpoint(last)
    last.symlink_to(target.name)
    io.remove_checkpoint(last)  # removing a link leaves what it points to
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_a_file_that_is_no_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "x.ckpt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="x.ckpt: not a torch checkpoint"):
        ShardedCheckpointIO().load_checkpoint(tmp_path / "x.ckpt")
    (tmp_path / "d.ckpt").mkdir()
    with pytest.raises(CheckpointError, match="d.ckpt: a directory without index.json"):
        ShardedCheckpointIO().load_checkpoint(tmp_path / "d.ckpt")
    run = tmp_path / "run"  # a run directory given for its checkpoint: named, not "delete this one"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, run / "checkpoints" / "last.ckpt")
    with pytest.raises(CheckpointError, match=r"run: .*a run directory\? it holds .*checkpoints/last.ckpt\): pass one"):
        ShardedCheckpointIO().load_checkpoint(run)


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


# ---------------------------------------------------------------------------------------------
# damaged checkpoints
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-step megatrain checkpoint in each format."""
    out = {}
    for fmt, io in FORMATS.items():
        d = tmp_path_factory.mktemp(fmt)
        ckpt = ModelCheckpoint(dirpath=d, filename="c", every_n_train_steps=2)
        fit(FACTORY, megatrain_with_io(**io), max_steps=2, max_epochs=-1, callbacks=[ckpt], enable_checkpointing=True)
        out[fmt] = d / "c.ckpt"
    assert out["directory"].is_dir() and out["file"].is_file()
    return out


def _shard(path: Path, n: int = 2) -> Path:
    return path / f"shard-{n:05d}.safetensors"


def _header(shard: Path) -> tuple[int, dict[str, Any]]:
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def _rewrite_header(shard: Path, edit: Any) -> None:
    """Edit the JSON header in place, keeping its length (so only the header differs)."""
    raw = bytearray(shard.read_bytes())
    n, header = _header(shard)
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    raw[8 : 8 + n] = new + b" " * (n - len(new))
    shard.write_bytes(bytes(raw))


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


def _truncate(path: Path, by: int) -> None:
    os.truncate(path, path.stat().st_size - by)


def _relabel(header: dict[str, Any]) -> None:
    key = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[key]["dtype"] = "I32"  # same width: the bytes still fit, only their meaning changes


def _swap_entries(header: dict[str, Any]) -> None:
    by_shape: dict[str, list[str]] = {}
    for k, v in header.items():
        if k != "__metadata__":
            by_shape.setdefault(json.dumps([v["dtype"], v["shape"]]), []).append(k)
    a, b = next(ks for ks in by_shape.values() if len(ks) >= 2)[:2]  # same dtype and shape: sizes agree
    header[a], header[b] = header[b], header[a]


def _swap_index_entries(ckpt: Path) -> None:
    index = json.loads((ckpt / INDEX_NAME).read_text())
    tensors = index["files"]["shard-00002.safetensors"]["tensors"]
    a, b = list(tensors)[:2]
    tensors[a], tensors[b] = tensors[b], tensors[a]
    (ckpt / INDEX_NAME).write_text(json.dumps(index, indent=1))


def _swap_shard_files(ckpt: Path) -> None:
    a, b = _shard(ckpt, 2), _shard(ckpt, 3)
    tmp = ckpt / "swap"
    a.rename(tmp), b.rename(a), tmp.rename(b)


def _data_offset(shard: Path) -> int:
    n, header = _header(shard)
    spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
    begin, end = max(spans, key=lambda s: s[1] - s[0])
    return 8 + n + (begin + end) // 2


def _zip_offset(path: Path, record: str = "/data/") -> int:
    """The middle of a record's bytes in a torch.save zip: the largest tensor's, or data.pkl's."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if record in i.filename), key=lambda i: i.file_size)
    raw = path.read_bytes()
    h = info.header_offset
    n, m = struct.unpack("<HH", raw[h + 26 : h + 30])
    return h + 30 + n + m + info.file_size // 2


DAMAGE: dict[str, tuple[str, str, Any]] = {
    # name: (format, the file the error must name, what is done to the checkpoint)
    "flipped data byte": ("directory", "shard-00002.safetensors", lambda c: _flip(_shard(c), _data_offset(_shard(c)))),
    "truncated shard": ("directory", "shard-00002.safetensors", lambda c: _truncate(_shard(c), 100)),
    "missing shard": ("directory", "shard-00002.safetensors", lambda c: _shard(c).unlink()),
    "relabelled dtype": ("directory", "shard-00002.safetensors", lambda c: _rewrite_header(_shard(c), _relabel)),
    "swapped header entries": ("directory", "shard-00002.safetensors", lambda c: _rewrite_header(_shard(c), _swap_entries)),
    "swapped index entries": ("directory", INDEX_NAME, _swap_index_entries),
    "swapped shard files": ("directory", "shard-0000", _swap_shard_files),
    "corrupt index.json": ("directory", INDEX_NAME, lambda c: _flip(c / INDEX_NAME, 40)),
    "missing index.json": ("directory", INDEX_NAME, lambda c: (c / INDEX_NAME).unlink()),
    "truncated meta.pt": ("directory", META_NAME, lambda c: _truncate(c / META_NAME, 50)),
    "corrupt meta.pt": ("directory", META_NAME, lambda c: _flip(c / META_NAME, (c / META_NAME).stat().st_size // 3)),
    "file: flipped data byte": ("file", "c.ckpt", lambda c: _flip(c, _zip_offset(c))),
    "file: truncated": ("file", "c.ckpt", lambda c: _truncate(c, 1000)),
    "file: flipped pickle byte": ("file", "c.ckpt", lambda c: _flip(c, _zip_offset(c, "data.pkl"))),
    # zip64 records Python's zipfile does not read, torch's reader does (its RuntimeError named no file before)
    "file: flipped zip64 locator": ("file", "c.ckpt", lambda c: _flip(c, c.stat().st_size - 30)),
    "file: flipped zip64 entry count": ("file", "c.ckpt", lambda c: _flip(c, c.stat().st_size - 60)),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_refused_before_anything_is_restored(
    pristine: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    fmt, culprit, do = DAMAGE[damage]
    ckpt = tmp_path / "c.ckpt"
    (shutil.copytree if fmt == "directory" else shutil.copy2)(pristine[fmt], ckpt)
    ShardedCheckpointIO().load_checkpoint(ckpt)  # the copy is fine
    do(ckpt)
    touched: list[str] = []
    for name in ("load_model_state_dict", "load_optimizer_state_dict"):
        monkeypatch.setattr(MegaTrainStrategy, name, lambda self, *a, _n=name, **k: touched.append(_n))
    monkeypatch.setattr(TinyLlama, "on_load_checkpoint", lambda self, c: touched.append("on_load_checkpoint"))
    with pytest.raises(CheckpointError) as err:
        fit(FACTORY, megatrain_with_io(), max_steps=3, max_epochs=-1, ckpt_path=str(ckpt))
    message = str(err.value)
    assert culprit in message and "earlier checkpoint" in message, message
    assert "Errno" not in message, message
    assert touched == [], f"restored before the damage was found: {touched}"


def test_single_file_written_by_torch_with_crc_off_still_loads(tmp_path: Path) -> None:
    saved = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.arange(5)}, tmp_path / "x.ckpt")
    finally:
        torch.serialization.set_crc32_options(saved)
    assert torch.equal(ShardedCheckpointIO().load_checkpoint(tmp_path / "x.ckpt")["w"], torch.arange(5))


# ---------------------------------------------------------------------------------------------
# weights_only
# ---------------------------------------------------------------------------------------------
class ConfigLlama(HFCausalLM):
    """A tiny Llama whose hyperparameters hold its transformers LlamaConfig (an object
    torch.load(weights_only=True) refuses)."""

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        from transformers import LlamaConfig

        if config is None:
            config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 attn_implementation="eager")
        self._config = config
        super().__init__(n_train=4, batch_size=4, **kwargs)  # its save_hyperparameters() records `config`
        assert self.hparams.config is config

    def build_model(self) -> torch.nn.Module:
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(self._config)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_weights_only_is_honoured_both_ways(tmp_path: Path, fmt: str) -> None:
    full = fit(ConfigLlama, "megatrain", max_steps=4, max_epochs=-1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="c", every_n_train_steps=2)
    fit(ConfigLlama, megatrain_with_io(**FORMATS[fmt]), max_steps=2, max_epochs=-1, callbacks=[ckpt], enable_checkpointing=True)
    path = str(tmp_path / "c.ckpt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False") as err:  # the safe default stays
        fit(ConfigLlama, "megatrain", max_steps=4, max_epochs=-1, ckpt_path=path)
    assert isinstance(err.value, CheckpointError) and "c.ckpt" in str(err.value)
    with pytest.raises(pickle.UnpicklingError):
        fit(ConfigLlama, "megatrain", max_steps=4, max_epochs=-1, ckpt_path=path, weights_only=True)
    resumed = fit(ConfigLlama, "megatrain", seed=1, max_steps=4, max_epochs=-1, ckpt_path=path, weights_only=False)
    assert resumed.trainer.global_step == 4 and resumed.losses == full.losses[2:]
    for k, v in full.state.items():
        assert torch.equal(v, resumed.state[k]), k


# ---------------------------------------------------------------------------------------------
# nothing stays mapped
# ---------------------------------------------------------------------------------------------
def _held(path: Path) -> list[str]:
    """Mappings and open descriptors of this process that point into `path` (what would keep its disk
    space allocated after it is deleted)."""
    root = str(path)
    held = [line.split(maxsplit=5)[-1].strip() for line in open("/proc/self/maps") if root in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if root in target:
            held.append(f"fd {fd} -> {target}")
    return held


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_resumed_run_holds_no_mapping_and_deleting_frees_the_disk(tmp_path: Path, fmt: str) -> None:
    d = tmp_path / "ckpts"
    ckpt = ModelCheckpoint(dirpath=d, filename="c", every_n_train_steps=2)
    fit(FACTORY, megatrain_with_io(**FORMATS[fmt]), max_steps=2, max_epochs=-1, callbacks=[ckpt], enable_checkpointing=True)
    path = d / "c.ckpt"
    seen: list[list[str]] = []

    class Look(pl.Callback):
        megatrain_reads_weights = False

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            seen.append(_held(path))

    # the resumed run keeps the restored ModelCheckpoint state (best_model_score is a loaded tensor)
    again = ModelCheckpoint(dirpath=d, filename="c", every_n_train_steps=2)
    run = fit(FACTORY, megatrain_with_io(**FORMATS[fmt]), max_steps=4, max_epochs=-1, callbacks=[again, Look()],
              enable_checkpointing=True, ckpt_path=str(path))
    assert run.trainer.global_step == 4 and len(seen) == 2
    assert seen == [[], []], f"the checkpoint is still mapped or open during the resumed run: {seen[0]}"
    run.trainer.strategy.remove_checkpoint(path)
    assert not path.exists() and _held(path) == []
