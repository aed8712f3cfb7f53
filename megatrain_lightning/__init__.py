"""megatrain-lightning: train models far larger than GPU memory on one GPU with PyTorch Lightning.

``import megatrain_lightning`` registers the strategy name ``"megatrain"``, so that
``Trainer(strategy="megatrain")`` works; import it before building the Trainer.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from .checkpoint_io import ShardedCheckpointIO
from .config import EngineConfig
from .export import export_hf
from .optim import HostAdamW
from .precision import MegaTrainPrecision
from .strategy import MegaTrainStrategy

if MegaTrainStrategy.strategy_name not in StrategyRegistry:
    MegaTrainStrategy.register_strategies(StrategyRegistry)


def _fabric_refusal(*args: object, **kwargs: object) -> None:
    raise TypeError('strategy="megatrain" is a strategy of the Lightning Trainer; Lightning Fabric is not supported. '
                    'Train a LightningModule with lightning.pytorch.Trainer(strategy="megatrain").')


# Fabric(strategy="megatrain") would otherwise read "invalid strategy name ... must be a string"
if MegaTrainStrategy.strategy_name not in FABRIC_STRATEGIES:
    FABRIC_STRATEGIES.register(MegaTrainStrategy.strategy_name, _fabric_refusal, description="not supported: use the Trainer")

__all__ = ["MegaTrainStrategy", "EngineConfig", "MegaTrainPrecision", "HostAdamW", "ShardedCheckpointIO", "export_hf"]
__version__ = "0.1.0"
