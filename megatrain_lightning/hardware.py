"""Hardware profiles: what a machine offers, and the strategy defaults that follow from it.

Profiles live in `conf/hardware/*.yaml` (one per machine type, inheriting `default.yaml`);
`hardware=auto` calls `detect()`, which picks the profile matching the GPU's name and replaces its
memory sizes with the ones measured on this machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from . import host_memory
from .conf_dir import config_dir
from .errors import ConfigError

GB = 1e9
# what Lightning's Trainer(precision=...) takes (lightning.fabric.connector._PRECISION_INPUT: the core imports nothing
# from Lightning)
_PRECISIONS = ("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
               "32-true", "64-true", "64", "32", "16", "bf16", 64, 32, 16)

# GPU name fragments → profile file, most specific first.
_NAME_TO_PROFILE = (("GH200", "gh200"), ("H200", "h200"), ("H100", "h100"), ("A100", "a100_pcie"), ("3090", "rtx3090"))
PINNED_FRACTION = 0.8  # most of the measured host memory that auto detection lets be pinned
_PROFILES_DIR = config_dir() / "hardware"


@dataclass(frozen=True)
class HardwareProfile:
    """One machine type.

    Args:
        name: the profile's name, as in `hardware=<name>`.
        accelerator: Lightning accelerator, `cuda` or `cpu`.
        device: the device a single-device strategy uses (`cuda:0`, `cpu`).
        precision: Lightning precision for this device (`bf16-mixed` on GPUs, `32-true` on CPUs).
        device_memory_gb: memory of one device.
        host_memory_gb: host RAM; the fit check compares the training state against it.
        link_gb_per_s: host→device copy bandwidth with pinned memory (what streaming is bound by).
        peak_bf16_tflops: dense bf16 peak of one device, the denominator of MFU.
        slots: device weight slots for MegaTrainStrategy: 2 double-buffers; more prefetch deeper
            on slow links at one block of device memory each.
        micro_batch: rows per step for throughput data (synthetic, packed text, JSONL).
        seq_len: tokens per row for throughput data; a long enough micro-batch hides each block's
            copy behind its compute.
        pinned_budget_gb: most host memory to pin; above it MegaTrainStrategy runs with pageable
            buffers (about 8x slower copies) rather than starve the machine.
        host_adam_gparams_per_s: fused fp32 AdamW on the host, G params/s (the planner's host
            optimizer ceiling; memory-bandwidth bound, so it scales with the host's DRAM bandwidth).
        device_update_gparams_per_s: the update of what MegaTrainStrategy updates on the device
            (``update_on_device``), G params/s: its bf16 gradients widened to fp32, torch's fused fp32 AdamW, the
            new weights cast into their bf16 slots (device-memory-bandwidth bound, on the compute stream: it adds
            to the step's device time).
    """

    name: str
    accelerator: str
    device: str
    precision: str
    device_memory_gb: float
    host_memory_gb: float
    link_gb_per_s: float
    peak_bf16_tflops: float
    slots: int
    micro_batch: int
    seq_len: int
    pinned_budget_gb: float
    host_adam_gparams_per_s: float = 1.0  # unknown host: a conservative guess; profiles set their own
    device_update_gparams_per_s: float = 30.0  # a profile that does not say: a conservative guess; profiles set their own

    def __post_init__(self) -> None:
        """Values every planner ratio and the strategy divide by or allocate with, refused by key here rather than as
        a ZeroDivisionError (or a run on the wrong device) later."""
        if self.accelerator not in ("cuda", "cpu"):
            raise ConfigError(f"hardware.accelerator={self.accelerator!r}: expected cuda or cpu")
        if not str(self.device).startswith(self.accelerator):
            fix = "cuda:0" if self.accelerator == "cuda" else "cpu"
            raise ConfigError(f"hardware.device={self.device!r} is not a {self.accelerator} device (hardware."
                              f"accelerator={self.accelerator}): set it to {fix}")
        if self.precision not in _PRECISIONS:
            raise ConfigError(f"hardware.precision={self.precision!r}: expected one of Lightning's precisions "
                              f"({', '.join(str(p) for p in _PRECISIONS if isinstance(p, str) and '-' in p)})")
        for key in ("device_memory_gb", "host_memory_gb", "link_gb_per_s", "slots", "micro_batch", "seq_len",
                    "host_adam_gparams_per_s", "device_update_gparams_per_s"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"hardware.{key}={value!r}: expected a positive number")
        for key in ("peak_bf16_tflops", "pinned_budget_gb"):  # 0: unknown peak (no MFU) / pin nothing
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"hardware.{key}={value!r}: expected a number >= 0")


def measured_host_memory_gb() -> float:
    """Host memory this process may hold (MemTotal, or its cgroup's limit if lower), in GB."""
    return host_memory.total_bytes() / GB


def load_profile(name: str, profiles_dir: Path = _PROFILES_DIR) -> HardwareProfile:
    """A profile from its YAML file, merged over the group's `default.yaml` as Hydra would."""
    base = OmegaConf.load(profiles_dir / "default.yaml")
    own = OmegaConf.load(profiles_dir / f"{name}.yaml")
    merged = OmegaConf.merge(base, own)
    for key in ("defaults", "_target_"):
        merged.pop(key, None)
    return HardwareProfile(**OmegaConf.to_container(merged, resolve=True))


# Device memory outside torch's allocator (CUDA context, cuBLAS workspaces), unavailable to tensors: the
# planner subtracts it from a profile's device memory (plan/memory.py).
CUDA_CONTEXT_GB = 1.0


def usable_device_memory_gb() -> float:
    """GPU 0's memory as a run here may use it: what is free now (another process's share is not), plus the
    CUDA context the planner subtracts (:data:`CUDA_CONTEXT_GB`), at most the device's total."""
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return min(total / GB, free / GB + CUDA_CONTEXT_GB)


def detect(host_memory_gb: float | None = None, device_memory_gb: float | None = None) -> HardwareProfile:
    """The profile of this machine: matched by GPU name, memory sizes measured unless given (the device's:
    what is free now, :func:`usable_device_memory_gb`).

    Without CUDA this is the `cpu` profile. An unknown GPU gets the `h200` profile's defaults with
    its own memory and no peak (MFU is then not reported): set `hardware=<profile>` or override
    `hardware.peak_bf16_tflops` for a better one.
    """
    import torch

    host = host_memory_gb or measured_host_memory_gb()
    if not torch.cuda.is_available():
        base = load_profile("cpu")
        return dataclasses.replace(base, name="auto(cpu)", host_memory_gb=host, device_memory_gb=device_memory_gb or host)
    gpu = torch.cuda.get_device_name(0)
    match = next((p for frag, p in _NAME_TO_PROFILE if frag in gpu), None)
    base = load_profile(match or "h200")
    return dataclasses.replace(
        base,
        name=f"auto({match or gpu})",
        device_memory_gb=device_memory_gb or usable_device_memory_gb(),
        host_memory_gb=host,
        peak_bf16_tflops=base.peak_bf16_tflops if match else 0.0,
        # The profile's budget assumes its own host; never page-lock most of a smaller one.
        pinned_budget_gb=min(base.pinned_budget_gb, PINNED_FRACTION * host),
    )


def resolve_hardware(cfg: Any) -> HardwareProfile:
    """Instantiate ``cfg.hardware`` (running detection for ``auto``) and write it back into ``cfg``.

    Other groups interpolate ``${hardware.slots}`` and the like; after this they read the detected
    numbers, which ``auto.yaml`` cannot know when it is composed. Idempotent.
    """
    import hydra
    from hydra.errors import InstantiationException
    from omegaconf import open_dict

    try:
        profile = hydra.utils.instantiate(cfg.hardware, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):  # a value HardwareProfile refuses, by key
            raise cause from None
        if isinstance(cause, TypeError):  # a missing or unknown field of the profile
            raise ConfigError(f"hardware: {str(cause).splitlines()[0]}") from None
        raise
    if not isinstance(profile, HardwareProfile):
        raise ConfigError(f"hardware config gave a {type(profile).__name__}, not a HardwareProfile")
    with open_dict(cfg):
        cfg.hardware = OmegaConf.create({"_target_": f"{__name__}.HardwareProfile", **dataclasses.asdict(profile)})
    return profile
