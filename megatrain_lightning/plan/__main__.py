"""``python -m megatrain_lightning.plan model=... hardware=... [key=value ...]``: print the plan.

Composes the training config from the packaged ``conf/`` (as ``train.py`` would; ``data=synthetic`` unless
a data option or an experiment is given, so ``data.batch_size`` and ``data.seq_len`` are the micro-batch shape; a
mixture of experts left at the hardware profile's micro-batch gets the planner's pick, as train.py gives it) and
prints the verdict and the table. Exit 2 with one paragraph when it does not fit or an override is wrong.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    from ..conf_dir import config_dir
    from ..errors import ConfigError
    from ..hardware import resolve_hardware
    from ..schema import check_config, check_root, check_set, check_trainer_values
    from . import format_plan
    from .from_config import planned_run

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip().replace("``", "`"))
        return 0
    # An experiment's own data choice stands: a command-line data=synthetic would replace it.
    overrides = ([] if any(a.startswith(("data=", "experiment=")) for a in args) else ["data=synthetic"]) + args
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
        # as train.py: unknown top-level keys, a seed or pick_micro_batch of the wrong type, every value against the
        # constructor it goes to (the hardware's first: the others read ${hardware.*}), unset keys
        check_root(cfg)
        with open_dict(cfg):  # ${hydra:runtime.output_dir} needs a running Hydra app; the plan writes nothing
            cfg.paths.output_dir = "."
        check_config(cfg, groups=("hardware",))
        resolve_hardware(cfg)
        check_config(cfg, groups=("trainer", "data", "model", "strategy"))
        check_set(cfg, ("trainer", "model", "strategy"), "python -m megatrain_lightning.plan")  # no data is read
        check_trainer_values(cfg.trainer)
        plan = planned_run(cfg, overrides)  # a mixture of experts: the micro-batch train.py would pick
        print(format_plan(plan))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except MissingMandatoryValue as err:
        print(f"error: {err.full_key} must be set, e.g. python -m megatrain_lightning.plan {err.full_key}=...",
              file=sys.stderr)
        return 2
    except (OmegaConfBaseException, HydraException, ValueError) as err:  # a bad override: Hydra's own reason
        key = getattr(err, "full_key", None)  # OmegaConf's errors name the key on a line of their own
        lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("full_key:")]
        print(f"error: {key + ': ' if key else ''}{' '.join(lines[:2])}", file=sys.stderr)  # with Hydra's "+" hint
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
