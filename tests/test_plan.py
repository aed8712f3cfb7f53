"""The fit check: the arithmetic of host memory, and a refusal that names the numbers and the fix."""

from __future__ import annotations

import pytest

from megatrain_lightning.errors import ConfigError
from megatrain_lightning.plan import check_fits, device_state_warning, estimate_host_bytes, pin_memory_fits


def test_host_state_is_16_bytes_per_param() -> None:
    assert estimate_host_bytes(1_000_000_000) == 16_000_000_000
    assert estimate_host_bytes(10, state_bytes_per_param=12, transfer_bytes_per_param=2) == 140


def test_check_fits_passes_at_the_boundary_and_refuses_past_it() -> None:
    assert check_fits(1_000_000_000, 16.0) == 16_000_000_000
    # the 7B shape fits the device machine's 135 GB (it trained there: 123.2 GiB peak RSS); 14B does not
    assert check_fits(7_615_616_512, 135, model="qwen2_5_7b") == 121_849_864_192
    with pytest.raises(ConfigError) as err:
        check_fits(14_770_033_664, 135, model="qwen2_5_14b", hardware="auto(h200)")
    msg = str(err.value)
    assert "model=qwen2_5_14b has 14.77 B parameters" in msg and "236 GB of host memory" in msg
    assert "hardware=auto(h200) has 135 GB" in msg and "hardware.host_memory_gb" in msg and "\n" not in msg


def test_device_and_pinned_budgets() -> None:
    assert device_state_warning(1_000_000_000, 80, "single_device") is None
    assert "236 GB > 141 GB" in device_state_warning(14_770_000_000, 141, "single_device")
    assert pin_memory_fits(10_000_000_000, 80) and not pin_memory_fits(10_000_000_001, 80)
    assert not pin_memory_fits(1, 0)
