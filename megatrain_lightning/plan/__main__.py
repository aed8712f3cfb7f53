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
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    from ..conf_dir import config_dir
    from ..errors import ConfigError
    from ..schema import check_root, check_set
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
        check_root(cfg)  # as train.py: unknown top-level keys, a seed or pick_micro_batch of the wrong type
        check_set(cfg, ("trainer", "model", "strategy"), "python -m megatrain_lightning.plan")  # no data is read
        plan = planned_run(cfg, overrides)  # a mixture of experts: the micro-batch train.py would pick
        print(format_plan(plan))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except MissingMandatoryValue as err:
        print(f"error: {err.full_key} must be set, e.g. python -m megatrain_lightning.plan {err.full_key}=...",
              file=sys.stderr)
        return 2
    except (OmegaConfBaseException, HydraException, ValueError) as err:  # a bad override: Hydra's own one-line reason
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
