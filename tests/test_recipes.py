"""The recipes run as documented (shortened where they take a step count)."""

from __future__ import annotations

import math

import pytest

from conftest import RECIPES, load_recipe as load

def test_every_recipe_opens_with_the_command_that_runs_it() -> None:
    for path in sorted(RECIPES.glob("*.py")) + sorted(RECIPES.glob("*.sh")):
        lines = path.read_text().splitlines()
        first = lines[1] if lines[0].startswith("#!") else lines[0]
        assert first.startswith(("# python recipes/", "# bash recipes/")), f"{path.name}: {first!r}"
        assert path.name in first, path.name


@pytest.mark.slow
def test_plain_python_recipe_trains_with_megatrain_strategy() -> None:
    loss = load("plain_python_megatrain").main(max_steps=40)
    assert loss < 0.6 * math.log(256)


@pytest.mark.slow
def test_moe_router_loss_recipe_matches_the_default_strategy() -> None:
    out = load("moe_router_loss").main(["--steps", "3", "--compare"])
    assert out["max_loss_rel_diff"] < 1e-5 and out["max_param_rel_diff"] < 1e-5
    assert len(out["megatrain"]["idle_experts_per_step"]) == 3
