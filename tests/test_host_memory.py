"""Host memory the process may really use, and the refusal at setup when the host store cannot fit it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import lightning as L
import pytest

from megatrain_lightning import host_memory
from megatrain_lightning.errors import ConfigError
from test_streaming import BlockNet, _loader


def test_available_is_at_most_meminfo_and_positive() -> None:
    # read between two reads of /proc/meminfo, with 256 MiB of slack: other processes (the suite's other worker)
    # allocate and free meanwhile (CI saw 8 MB more available in the second of two reads)
    before = host_memory.meminfo_available()
    available = host_memory.available_bytes()
    after = host_memory.meminfo_available()
    assert 0 < available <= max(before, after) + 2**28 and max(before, after) <= host_memory.total_bytes()


def test_refused_before_the_store_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that has (says it has) 100 bytes free: setup refuses with the numbers before allocating."""
    import megatrain_lightning

    monkeypatch.setattr(host_memory, "available_bytes", lambda: 100)
    strategy = megatrain_lightning.MegaTrainStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConfigError) as err:
        trainer.fit(BlockNet(depth=3), _loader())
    msg = str(err.value)
    assert msg.startswith("MegaTrainStrategy: BlockNet has 0.000 B parameters") and "0.0 GB" in msg
    assert "host_state='compact'" in msg and "\n" not in msg
    assert strategy.engine is None  # nothing was built


def test_ulimit_v_is_seen_and_train_py_refuses_in_one_paragraph(tmp_path) -> None:
    """Under `ulimit -v` the headroom is the address space left, and a model too big for it (though not for
    the hardware profile) is refused by train.py at setup with one paragraph and exit code 2, not an
    allocator error."""
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    code = textwrap.dedent(f"""
        import os, resource, runpy, sys
        import torch, lightning, transformers, hydra  # their address space first
        from megatrain_lightning import host_memory
        size = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')
        resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
        left = host_memory.address_space_headroom()
        assert left is not None and left <= 1 << 30, left
        assert host_memory.available_bytes() <= 1 << 30
        sys.argv = ["train.py", "model=qwen2_5_0_5b", "data=synthetic", "hardware=cpu", "hardware.host_memory_gb=1000",
                    "data.batch_size=1", "data.seq_len=16", "trainer.max_steps=1", "hydra.run.dir={tmp_path}"]
        runpy.run_path("{root / 'train.py'}", run_name="__main__")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith("error: MegaTrainStrategy: CausalLM has 0.494 B parameters") and "ulimit -v" in err and "GB more host memory" in err, err
    assert "Traceback" not in out.stderr


def test_data_parallel_counts_one_store_per_node_and_its_tmpfs() -> None:
    """Under data parallel the node's ranks share masters and moments (counted once) and each holds its own
    gradients; the shared store must also fit the tmpfs it lives in, or setup refuses naming it."""
    from megatrain_lightning.config import EngineConfig
    from megatrain_lightning.plan.fit import check_host_at_setup, setup_shape

    shape = setup_shape(10**9, [10**8] * 9)
    engine = EngineConfig(grad_buffers=0)  # own fp32 accumulators: 4 B/param per rank
    args = ("M", shape, engine, 1, False, 0.0, 1e15, "")
    one = check_host_at_setup(*args)
    two = check_host_at_setup(*args, ranks_per_node=2)
    assert two - one == pytest.approx(4e9, rel=0.01)  # a second rank adds its gradients only
    assert check_host_at_setup(*args, ranks_per_node=2, tmpfs=("/dev/shm", 13e9)) == two  # 12 GB shared fits
    with pytest.raises(ConfigError) as err:
        check_host_at_setup(*args, ranks_per_node=2, tmpfs=("/dev/shm", 11e9))
    msg = str(err.value)
    assert "lives in /dev/shm, which has only 11.0 GB free" in msg and "--shm-size" in msg
    assert "MEGATRAIN_SHM_DIR" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="one copy shared by this node's 2 ranks"):
        check_host_at_setup("M", shape, engine, 1, False, 0.0, 15e9, "", ranks_per_node=2)
