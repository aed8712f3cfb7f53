"""Check a composed config against the typed constructors it names, before anything is built.

The configs have no schema of their own: each node's ``_target_`` is a real class or function, and its
signature is the schema (DESIGN.md section 7). This walks every node with a ``_target_`` and compares
each value with the annotation of the parameter it goes to, for the annotations that say something a
YAML value can be checked against (int, float, bool, str, None, ``Literal``, and unions of those), so
that ``trainer.max_steps=abc`` reads as one line naming the key and what it expects, not as a traceback
from deep inside Lightning. A key that the target does not take is refused the same way. Values it
cannot judge (classes, containers, ``Any``) are left to the constructor.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatrain_lightning.errors import ConfigError

_SIMPLE = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


def _arms(annotation: Any) -> list[Any] | None:
    """The simple types (or Literal values, as tuples) an annotation allows; None when it allows anything else."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        arms: list[Any] = []
        for a in typing.get_args(annotation):
            sub = _arms(a)
            if sub is None:
                return None
            arms += sub
        return arms
    if origin is typing.Literal:
        return [tuple(typing.get_args(annotation))]
    if annotation in _SIMPLE:
        return [annotation]
    import types

    if isinstance(annotation, types.UnionType):
        return _arms(typing.Union[tuple(annotation.__args__)])  # `int | None` written with `|`
    return None


def _matches(value: Any, arm: Any) -> bool:
    if isinstance(arm, tuple):  # Literal
        return any(value == v and type(value) is type(v) for v in arm)
    if arm is bool:
        return isinstance(value, bool)
    if arm is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if arm is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if arm is type(None):
        return value is None
    return isinstance(value, arm)


def _expected(arms: list[Any]) -> str:
    words = []
    for arm in arms:
        words.append("one of " + ", ".join(map(repr, arm)) if isinstance(arm, tuple) else _SIMPLE[arm])
    return " or ".join(dict.fromkeys(words))


def _signature(target: str) -> tuple[str, inspect.Signature, dict[str, Any]] | None:
    try:
        obj = get_object(target)
    except Exception:
        return None  # an unimportable target: instantiate says so in its own words
    fn = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve here: check none of this target's values
        hints = {}
    return getattr(obj, "__qualname__", target), sig, hints


def check_node(node: DictConfig, key: str) -> None:
    """Check ``node`` (at ``key``, e.g. ``trainer``) and the nodes with a ``_target_`` inside it."""
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    found = _signature(str(target)) if target else None
    for name in node.keys() if isinstance(node, DictConfig) else range(len(node)):
        full = f"{key}.{name}"
        if isinstance(name, str) and name.startswith("_"):
            continue
        if OmegaConf.is_missing(node, name):
            continue  # `???`: train() says which value to set
        try:
            value = node[name]
        except OmegaConfBaseException as err:
            raise ConfigError(f"{full}: {str(err).splitlines()[0]}") from None
        if found is None:
            if isinstance(value, (DictConfig, ListConfig)):
                check_node(value, full)
            continue
        qualname, sig, hints = found
        params = sig.parameters
        if name not in params:
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                names = [p for p in params if p not in ("self", "args", "kwargs")]
                close = difflib.get_close_matches(str(name), names, n=1)
                hint = f"did you mean {key}.{close[0]}?" if close else f"it takes: {', '.join(names)}"
                raise ConfigError(f"{full}: {qualname} has no parameter {name!r} ({hint})")
            continue
        arms = _arms(hints.get(name, inspect.Parameter.empty))
        plain = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
        if arms and not any(_matches(plain, a) for a in arms):
            example = params[name].default
            raise ConfigError(
                f"{full}={_yaml(plain)}: expected {_expected(arms)} ({qualname}'s {name} is {_describe(hints[name])})"
                + (f", e.g. {full}={_yaml(example)}" if example is not inspect.Parameter.empty else "")
            )
        if isinstance(value, (DictConfig, ListConfig)):
            check_node(value, full)


def _yaml(value: Any) -> str:
    """A value as one would type it after `key=` (null, true, 3e-4, 'a string')."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value) if isinstance(value, str) else str(value)


def _describe(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return text or str(annotation).replace("typing.", "")


# conf/train.yaml's top-level keys (experiments set groups' keys and hydra's); `+key=...` adds any other silently
ROOT_KEYS = ("model", "data", "hardware", "strategy", "trainer", "seed", "ckpt_path", "pick_micro_batch", "paths", "hydra")


def check_root(cfg: DictConfig) -> None:
    """Refuse a top-level key train.py does not read (``+ckpt_paht=...`` would otherwise be ignored), a seed
    that is not an integer and a ``pick_micro_batch`` that is not a boolean."""
    for key in cfg:
        if key not in ROOT_KEYS:
            close = difflib.get_close_matches(str(key), ROOT_KEYS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"its top-level keys: {', '.join(ROOT_KEYS)}"
            raise ConfigError(f"{key}: train.py reads no top-level setting {key!r} ({hint}); a group's setting is "
                              "written group.key=value, e.g. trainer.max_steps=10")
    seed = cfg.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed={seed!r}: expected an integer, e.g. seed=0")
    pick = cfg.get("pick_micro_batch", True)
    if not isinstance(pick, bool):
        raise ConfigError(f"pick_micro_batch={pick!r}: expected true or false (false: a mixture of experts keeps the "
                          "hardware profile's micro-batch)")


def check_config(cfg: DictConfig, groups: tuple[str, ...] = ("hardware", "trainer", "data", "model", "strategy")) -> None:
    """Type-check the config groups of a composed training config (ConfigError on the first problem). The
    order matters where one value is interpolated into another (`model.decay_steps: ${trainer.max_steps}`):
    the key a user set is the one named."""
    for group in groups:
        node = cfg.get(group)
        if isinstance(node, DictConfig):
            check_node(node, group)


def _unset(node: DictConfig | ListConfig, path: str) -> list[str]:
    """The ``???`` keys under ``node``, without resolving interpolations (OmegaConf.missing_keys resolves them)."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    out = []
    for k in keys:
        child, name = node._get_node(k), f"{path}.{k}"
        if OmegaConf.is_missing(node, k):
            out.append(name)
        elif isinstance(child, (DictConfig, ListConfig)) and not child._is_missing() and not child._is_none():
            out += _unset(child, name)
    return out


def check_set(cfg: DictConfig, groups: tuple[str, ...], command: str) -> None:
    """Every mandatory (``???``) key of ``groups`` that the composed config leaves unset, and a model with
    neither ``config`` nor ``pretrained``, in one message before anything is built (not one per run)."""
    keys = [k for g in groups if isinstance(cfg.get(g), DictConfig) for k in _unset(cfg[g], g)]
    model = cfg.get("model") if "model" in groups else None
    needs_weights = (isinstance(model, DictConfig) and "model.pretrained" not in keys
                     and model.get("config") is None and model.get("pretrained") is None)
    if not keys and not needs_weights:
        return
    parts = [f"{', '.join(keys)} must be set, e.g. {command} {' '.join(k + '=...' for k in keys)}"] if keys else []
    if needs_weights:
        parts.append("set model.config (random init) or model.pretrained=/path/to/hf_checkpoint, "
                     "or pick a model with its config (model=tiny, model=qwen2_5_7b, ...)")
    raise ConfigError("; ".join(parts))


def check_trainer_values(node: DictConfig) -> None:
    """Values of the right type that Lightning would still fail on, deep inside, named with the fix."""
    def bad(key: str, value: Any, want: str) -> ConfigError:
        return ConfigError(f"trainer.{key}={value!r}: expected {want}")

    devices = node.get("devices")
    if isinstance(devices, int) and not isinstance(devices, bool) and devices < 1 and devices != -1:
        raise bad("devices", devices, "a positive number of devices (or -1 or \"auto\": all of them)")
    steps = node.get("max_steps", -1)
    if isinstance(steps, int) and (steps == 0 or steps < -1):
        raise bad("max_steps", steps, "a positive number of optimizer steps (or -1: by max_epochs)")
    for key in ("log_every_n_steps", "accumulate_grad_batches"):
        value = node.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise bad(key, value, "a positive integer")
    clip = node.get("gradient_clip_val")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip < 0:
        raise bad("gradient_clip_val", clip, "a positive number (or null: no clipping; Lightning skips values <= 0)")
    interval = node.get("val_check_interval")
    if isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval <= 0:
        raise bad("val_check_interval", interval, "a positive number of steps (or a fraction of an epoch, <= 1.0)")
