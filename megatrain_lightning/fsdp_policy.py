"""Which modules the FSDP baseline wraps (and checkpoints): every transformer layer, by class name.

Lightning's FSDPStrategy takes a set of layer classes, which would tie each config to one model
family; Hugging Face names every decoder layer `<Model>DecoderLayer`, so matching the name's suffix
covers Llama, Qwen, Mistral and GPT-OSS with one config.
"""

from __future__ import annotations

from torch import nn


class LayerClassPolicy:
    """An FSDP auto-wrap / activation-checkpointing policy: wrap modules whose class name ends in `suffix`.

    One FSDP unit per layer is the usual trade: a layer's parameters are gathered just before it
    runs and freed after, so peak device memory is about one layer plus activations.

    Args:
        suffix: class-name ending of the modules to wrap.
    """

    def __init__(self, suffix: str = "DecoderLayer") -> None:
        self.suffix = suffix

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int = 0) -> bool:
        # torch's functional policy protocol: when `recurse`, say whether to look inside (always);
        # otherwise, whether to wrap this module.
        return True if recurse else type(module).__name__.endswith(self.suffix)
