"""Every config under conf/ composes, points at real code, and the models in it have the right sizes.

Composition uses Hydra's compose API on the real conf/ directory, with the same group overrides a
user would type, so a typo in any YAML, a broken interpolation or a renamed class fails here.
"""

from __future__ import annotations

import importlib.util
import re
import resource
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_method
from omegaconf import DictConfig, ListConfig, OmegaConf

from megatrain_lightning import cli
from megatrain_lightning.errors import ConfigError
from megatrain_lightning.hardware import HardwareProfile, resolve_hardware
from megatrain_lightning.schema import check_config

CONF = Path(__file__).resolve().parent.parent / "conf"
YAMLS = sorted(p.relative_to(CONF).as_posix() for p in CONF.rglob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml") if p.stem not in ("default", "pretrained"))

# Published totals (billions) and, for mixtures of experts, parameters active per token.
PUBLISHED = {
    "llama3_8b": (8.03, None),
    "qwen2_5_0_5b": (0.494, None),
    "qwen2_5_1_5b": (1.54, None),
    "qwen2_5_3b": (3.09, None),
    "qwen2_5_7b": (7.62, None),
    "qwen2_5_14b": (14.77, None),
    "qwen2_5_32b": (32.76, None),
    "qwen2_5_72b": (72.7, None),
    "qwen3_8b": (8.19, None),
    "mistral_7b": (7.24, None),
    "gpt_oss_20b": (20.9, 3.6),
    "gpt_oss_120b": (116.8, 5.1),
    "qwen3_30b_a3b": (30.5, 3.04),  # published 3.3 B active counts the input embedding (0.31 B); ModelShape does not
    "tiny": (0.000558, None),
}


def compose_train(*overrides: str, tmp: str = "/tmp/megatrain-test-out") -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        # With the hydra node: train() reads the group choices (model=..., strategy=...) from it.
        return compose(config_name="train", overrides=[*overrides, f"paths.output_dir={tmp}"], return_hydra_config=True)


def overrides_for(rel: str) -> list[str]:
    """The command-line overrides that select the config file `rel` (e.g. `model/tiny.yaml`)."""
    if "/" not in rel:
        return []
    group, name = rel.rsplit("/", 1)
    return [f"{group.replace('/', '.')}={name.removesuffix('.yaml')}"]


def targets(node: Any) -> list[str]:
    if isinstance(node, DictConfig):
        found = [str(node["_target_"])] if "_target_" in node else []
        return found + [t for k in node if k != "_target_" for t in targets(node._get_node(k))]
    if isinstance(node, ListConfig):
        return [t for i in range(len(node)) for t in targets(node._get_node(i))]
    return []


def test_conf_tree_has_every_group_and_option() -> None:
    names = set(YAMLS)
    for group in ("model", "data", "hardware", "strategy", "trainer", "experiment"):
        assert any(n.startswith(f"{group}/") for n in names), group
    for hw in ("gh200", "h200", "h200_126g", "h100", "a100_pcie", "rtx3090", "cpu", "auto"):
        assert f"hardware/{hw}.yaml" in names
    for s in ("megatrain", "single_device", "fsdp_cpu_offload", "deepspeed_zero3_offload"):
        assert f"strategy/{s}.yaml" in names
    assert set(PUBLISHED) == set(MODELS)


@pytest.mark.parametrize("rel", YAMLS)
def test_every_yaml_composes_and_resolves(rel: str) -> None:
    """Composes with its option selected; every interpolation resolves (`???` = left to the user)."""
    over = overrides_for(rel)
    if not rel.startswith("hardware/"):
        over.append("hardware=cpu")  # a fixed profile, so that `${hardware.*}` has values
    cfg = compose_train(*over)
    if rel.endswith("default.yaml") and rel.startswith(("model/", "hardware/")):
        return  # abstract bases: their `???` fields are filled by the variants
    resolve_hardware(cfg)
    check_config(cfg)  # every value has the type its constructor's parameter declares
    own = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])  # Hydra's node is Hydra's to resolve
    OmegaConf.to_container(own, resolve=True, throw_on_missing=False)


@pytest.mark.parametrize("rel", YAMLS)
def test_every_target_is_importable(rel: str) -> None:
    found = targets(OmegaConf.load(CONF / rel))
    for target in found:
        assert callable(get_method(target)), target


def test_every_yaml_has_a_target_or_is_a_variant() -> None:
    """Group configs that instantiate something name a real class, directly or through `default.yaml`."""
    for rel in YAMLS:
        raw = OmegaConf.load(CONF / rel)
        if rel == "train.yaml" or rel.startswith("experiment/"):
            continue
        assert "_target_" in raw or "default" in list(raw.get("defaults", [])), rel


@pytest.mark.parametrize("name", MODELS)
def test_model_config_instantiates_on_meta_device_with_published_size(name: str) -> None:
    cfg = compose_train(f"model={name}", "hardware=cpu")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    module = cli.instantiate(cfg.model)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 512, f"instantiating {name} allocated about {grown_mib:.0f} MiB"
    assert module.model is None  # the real network comes only in configure_model
    meta = module.__dict__["_meta_model"]
    assert all(p.is_meta for p in meta.parameters())
    total, active = PUBLISHED[name]
    shape = module.model_shape
    assert shape.total_params / 1e9 == pytest.approx(total, rel=0.01)
    assert shape.active_params / 1e9 == pytest.approx(active if active else shape.active_params / 1e9, rel=0.03)
    assert shape.active_params <= shape.total_params


def test_hardware_profiles_instantiate() -> None:
    for rel in YAMLS:
        if rel.startswith("hardware/") and rel != "hardware/default.yaml":
            cfg = compose_train(*overrides_for(rel))
            hw = resolve_hardware(cfg)
            assert isinstance(hw, HardwareProfile)
            assert hw.host_memory_gb > 0 and hw.device_memory_gb > 0 and hw.peak_bf16_tflops > 0
            assert hw.slots >= 2 and hw.micro_batch >= 1 and hw.seq_len >= 1
            assert cfg.hardware.slots == hw.slots  # written back for `${hardware.*}` readers


@pytest.mark.parametrize("strategy", ["megatrain", "single_device", "fsdp_cpu_offload"])
def test_strategies_instantiate(strategy: str) -> None:
    cfg = compose_train(f"strategy={strategy}", "hardware=cpu")
    hw = resolve_hardware(cfg)
    built = cli.build_strategy(cfg.strategy, hw, plan=None)
    assert type(built).__name__ == cfg.strategy._target_.rsplit(".", 1)[-1]
    if strategy == "megatrain":  # the engine node became the strategy's typed config
        from megatrain_lightning import EngineConfig

        assert isinstance(built.config, EngineConfig) and built.config.slots == hw.slots


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed")
def test_deepspeed_baseline_without_deepspeed_says_how_to_get_it(tmp_path: Path) -> None:
    cfg = compose_train("strategy=deepspeed_zero3_offload", tmp=str(tmp_path))
    with pytest.raises(ConfigError, match=r"strategy=deepspeed_zero3_offload needs the deepspeed package.*pip install deepspeed"):
        cli.train(cfg)
    assert not (tmp_path / "run_info.json").exists()  # refused before the model was even counted


def test_fsdp_policy_wraps_each_decoder_layer() -> None:
    from megatrain_lightning.fsdp_policy import LayerClassPolicy

    cfg = compose_train("model=qwen2_5_0_5b", "hardware=cpu")
    meta = cli.instantiate(cfg.model).__dict__["_meta_model"]
    policy = LayerClassPolicy()
    wrapped = [m for m in meta.modules() if policy(m, recurse=False)]
    assert len(wrapped) == meta.config.num_hidden_layers
    assert policy(meta, recurse=True)


def test_experiments_only_list_changes() -> None:
    for rel in YAMLS:
        if rel.startswith("experiment/"):
            text = (CONF / rel).read_text()
            assert text.splitlines()[0].startswith("# @package _global_"), rel


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.max_steps=abc", "trainer.max_steps='abc': expected an integer (Trainer's max_steps is int), e.g. trainer.max_steps=-1"),
    ("trainer.precision=31", "trainer.precision=31: expected one of"),
    ("model.lr=fast", "model.lr='fast': expected a number (CausalLM's lr is float), e.g. model.lr=0.0003"),
    ("strategy.engine.slots=two", "strategy.engine.slots='two': expected an integer or null (EngineConfig's slots is int | None)"),
    ("strategy.meta_init=maybe", "strategy.meta_init='maybe': expected true or false"),
    ("data.batch_size=[1,2]", "data.batch_size=[1, 2]: expected an integer"),
    ("+data.batch_sise=4", "data.batch_sise: ArithmeticDataModule has no parameter 'batch_sise' (did you mean data.batch_size?)"),
    ("trainer.callbacks.checkpoint.mode=3", "trainer.callbacks.checkpoint.mode=3: expected a string (RunCheckpoint's mode is str)"),
])
def test_values_of_the_wrong_type_are_named_with_what_is_expected(override: str, message: str) -> None:
    cfg = compose_train(override, "hardware=cpu")
    resolve_hardware(cfg)
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"slots": "2"}, "slots='2': a whole number of device slots, >= 2"),
    ({"slots": True}, "slots=True: a whole number of device slots, >= 2"),
    ({"slots": 1}, "slots=1: at least 2 device slots"),
    ({"keep_activations": True}, "keep_activations=True: a number of blocks, >= 0"),
    ({"overlap_next_forward": "false"}, "overlap_next_forward='false': True or False"),
    ({"overlap_optimizer": None}, "overlap_optimizer=None: True or False"),
    ({"pin_memory": "no"}, "pin_memory='no': True or False (None: chosen for the machine)"),
    ({"bf16_grads": 1}, "bf16_grads=1: True or False"),
])
def test_engine_config_in_python_refuses_values_of_the_wrong_type(kwargs: dict, message: str) -> None:
    """A string 'false' is truthy: taken as given it would mean the opposite. Named with what is expected."""
    from megatrain_lightning import EngineConfig

    with pytest.raises(ValueError, match="EngineConfig: " + re.escape(message)):
        EngineConfig(**kwargs)


def test_hardware_precisions_are_lightnings() -> None:
    """HardwareProfile checks hardware.precision against its own copy of what Lightning's Trainer takes (the core
    imports nothing from Lightning): the two stay the same."""
    import typing

    from lightning.fabric import connector

    from megatrain_lightning.hardware import _PRECISIONS

    lightning = {v for arm in typing.get_args(connector._PRECISION_INPUT) for v in typing.get_args(arm)}
    assert set(_PRECISIONS) == lightning
