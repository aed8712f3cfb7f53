"""Hardware profiles: what a machine offers, and the strategy defaults that follow from it.

Profiles live in `conf/hardware/*.yaml` (one per machine type, inheriting `default.yaml`);
`hardware=auto` calls `detect()`, which picks the profile matching the GPU's name and replaces its
memory sizes with the ones measured on this machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

GB = 1e9

# GPU name fragments → profile file, most specific first.
_NAME_TO_PROFILE = (("GH200", "gh200"), ("H200", "h200"), ("A100", "a100_pcie"), ("3090", "rtx3090"))
PINNED_FRACTION = 0.8  # most of the measured host memory that auto detection lets be pinned
_PROFILES_DIR = Path(__file__).resolve().parent.parent / "conf" / "hardware"


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


def measured_host_memory_gb() -> float:
    """Physical host memory (MemTotal), in GB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def load_profile(name: str, profiles_dir: Path = _PROFILES_DIR) -> HardwareProfile:
    """A profile from its YAML file, merged over the group's `default.yaml` as Hydra would."""
    base = OmegaConf.load(profiles_dir / "default.yaml")
    own = OmegaConf.load(profiles_dir / f"{name}.yaml")
    merged = OmegaConf.merge(base, own)
    for key in ("defaults", "_target_"):
        merged.pop(key, None)
    return HardwareProfile(**OmegaConf.to_container(merged, resolve=True))


def detect(host_memory_gb: float | None = None, device_memory_gb: float | None = None) -> HardwareProfile:
    """The profile of this machine: matched by GPU name, memory sizes measured unless given.

    Without CUDA this is the `cpu` profile. An unknown GPU gets the `h200` profile's defaults with
    its own memory and no peak (MFU is then not reported): set `hardware=<profile>` or override
    `hardware.peak_bf16_tflops` for a better one.
    """
    import dataclasses

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
        device_memory_gb=device_memory_gb or torch.cuda.get_device_properties(0).total_memory / GB,
        host_memory_gb=host,
        peak_bf16_tflops=base.peak_bf16_tflops if match else 0.0,
        # The profile's budget assumes its own host; never page-lock most of a smaller one.
        pinned_budget_gb=min(base.pinned_budget_gb, PINNED_FRACTION * host),
    )
