"""megatrain-lightning: train models far larger than GPU memory on one GPU with PyTorch Lightning.

``import megatrain_lightning`` registers the strategy name ``"megatrain"``, so that
``Trainer(strategy="megatrain")`` works; import it before building the Trainer.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .checkpoint_io import ShardedCheckpointIO
from .config import EngineConfig
from .export import export_hf
from .optim import HostAdamW
from .precision import MegaTrainPrecision
from .strategy import MegaTrainStrategy

if MegaTrainStrategy.strategy_name not in StrategyRegistry:
    MegaTrainStrategy.register_strategies(StrategyRegistry)

__all__ = ["MegaTrainStrategy", "EngineConfig", "MegaTrainPrecision", "HostAdamW", "ShardedCheckpointIO", "export_hf"]
__version__ = "0.1.0"
