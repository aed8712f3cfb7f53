"""The long-context recipes run (shortened): the CPU measurement of bf16 saved inputs, and the GPU layer
benchmark's smoke run on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_recipe as load

@pytest.mark.slow
def test_saved_inputs_dtype_recipe(tmp_path: Path) -> None:
    recipe = load("saved_inputs_dtype")
    effect = recipe.layer_effect(tokens=128, hidden=64)
    assert all(0 < v < 0.1 for v in effect.values()), effect
    wide, _ = recipe.train(3, "megatrain", "bf16-mixed")
    narrow, _ = recipe.train(3, "megatrain", "bf16-mixed", saved_inputs_dtype="compute")
    assert wide[0] == narrow[0] and len(wide) == 3  # the first forward is the same; later steps may differ


@pytest.mark.slow
def test_long_context_layer_recipe_smoke_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    out = tmp_path / "layer.md"
    monkeypatch.setattr(sys, "argv", ["long_context_layer.py", "--device", "cpu", "--tokens", "96", "--chunk", "32",
                                      "--backends", "flash", "--out", str(out), "--small"])
    assert load("long_context_layer").main() == 0
    assert "| flash | 96 |" in out.read_text()
