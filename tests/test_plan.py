"""The fit checks outside the planner's table: a CPU-offload baseline's 16 B/param, the device warning."""

from __future__ import annotations

import dataclasses

import pytest

from megatrain_lightning.errors import ConfigError
from megatrain_lightning.hardware import load_profile
from megatrain_lightning.plan import check_baseline_host, device_state_warning
from megatrain_lightning.plan.memory import GB, PROCESS_OVERHEAD_GB


def test_baseline_check_passes_at_the_boundary_and_refuses_past_it() -> None:
    h200 = dataclasses.replace(load_profile("h200"), name="auto(h200)", host_memory_gb=135)
    need = 16 * 7_615_616_512 + PROCESS_OVERHEAD_GB * GB
    assert check_baseline_host("qwen2_5_7b", 7_615_616_512, h200) == need
    exact = dataclasses.replace(h200, host_memory_gb=need / GB)
    assert check_baseline_host("m", 7_615_616_512, exact) == need
    with pytest.raises(ConfigError) as err:
        check_baseline_host("qwen2_5_14b", 14_770_033_664, h200)
    msg = str(err.value)
    assert "model=qwen2_5_14b (14.77 B parameters) needs 239.3 GB of host memory" in msg
    assert "hardware=auto(h200) has 135 GB" in msg and "hardware.host_memory_gb" in msg and "\n" not in msg


def test_device_state_warning() -> None:
    assert device_state_warning(1_000_000_000, 80, "single_device") is None
    assert "236 GB > 141 GB" in device_state_warning(14_770_000_000, 141, "single_device")


def test_the_plan_cli_prints_its_usage_and_one_line_for_a_bad_override(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m megatrain_lightning.plan --help`` prints how to call it (it went to Hydra's override parser, a
    traceback, until 2026-12-04); an override Hydra cannot parse gets one line and exit 2."""
    from megatrain_lightning.plan.__main__ import main

    assert main(["--help"]) == 0
    assert "python -m megatrain_lightning.plan model=" in capsys.readouterr().out
    assert main(["model=qwen2_5_3b", "data.batch_size=["]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert main(["model=qwen2_5_3b", "hardware=h200", "data.batch_size=2"]) == 0
    assert capsys.readouterr().out.startswith("verdict: fits")


@pytest.mark.parametrize("overrides, said", [
    # found by a sweep of bad input (2026-12-07): the plan checked no value against its constructor (a plan printed
    # for trainer.max_steps=abc), dropped Hydra's "+" hint, and told a user to set data.batch_size=0
    (["trainer.max_steps=abc"], "error: trainer.max_steps='abc': expected an integer"),
    (["+strategy.engine.slotz=3"], "error: strategy.engine.slotz: EngineConfig has no parameter 'slotz' (did you mean "
                                   "strategy.engine.slots?)"),
    (["model.config.foo=1"], "error: Could not override 'model.config.foo'. To append to your config use "
                             "+model.config.foo=1"),
    (["hardware=cpu", "hardware.link_gb_per_s=0"], "error: hardware.link_gb_per_s=0: expected a positive number"),
    (["trainer.devices=0"], "error: trainer.devices=0: expected a positive number of devices"),
    (["model=qwen2_5_7b", "hardware=rtx3090", "data.seq_len=131072", "data.batch_size=4"],
     "hardware=rtx3090 has 23.0 GB for tensors: use data.seq_len=896 at this micro-batch (and"),
])
def test_the_plan_cli_checks_values_as_train_py_does(overrides: list[str], said: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from megatrain_lightning.plan.__main__ import main

    assert main(["model=tiny", *overrides]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
