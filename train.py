# python train.py [group=option ...] [key=value ...]      e.g. python train.py model=qwen2_5_0_5b data=synthetic
# python train.py -m model=qwen2_5_0_5b,qwen2_5_1_5b strategy=megatrain,single_device trainer.max_steps=20
"""Thin Hydra entry point: compose conf/, then megatrain_lightning.cli.train does the work.

A single run trains in this process. Under -m (multirun) each job re-runs this script in a child
process (megatrain_lightning.sweep), so a run killed by the out-of-memory killer cannot stop the
sweep, and the sweep ends with sweep_results.csv / .md in its directory.
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from megatrain_lightning import cli, sweep
from megatrain_lightning.blocks import BlockDetectionError
from megatrain_lightning.errors import ConfigError


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> dict:
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return sweep.run_job(cfg)
    try:
        return cli.train(cfg)
    except (ConfigError, BlockDetectionError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
