"""Where block weights and saved inputs live on the device: the rotating and fixed slots, the kept blocks, the
weight stream filling the slots and the input offload. Laid out when the engine is built and replaced between
steps when a placement is chosen (``auto_placement.py``); every placement gives the same result bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import PLACEMENT_FIELDS, EngineConfig
from .offload import InputOffload
from .prefetch import WeightStream
from .slots import DeviceSlots


def lay_out(engine: Any, config: EngineConfig) -> None:
    """``engine.keep``, ``engine.weights`` (its slots) and ``engine.offload`` for ``config`` (filled)."""
    n_blocks = len(engine.blocks)
    engine.keep = set(range(n_blocks - config.keep_activations, n_blocks))
    cached = config.fixed_blocks(n_blocks)  # kept blocks and the cached ones (the first the device updates)
    stores = engine.stores
    slots = DeviceSlots(config.slots, max(s.numel for s in stores), engine.compute_dtype, engine.device,
                        fixed=[(b, stores[b].numel) for b in cached], master_dtype=stores[0].dtype,
                        wide_numel=max(s.layout.wide_numel for s in stores))
    engine.weights = WeightStream(stores, slots, engine.streams, engine.stats, engine.keep, engine.updates.wait_for,
                                  ahead=lambda block: engine.device_update.ahead(block))
    engine.offload = InputOffload(engine.streams, engine.pins, config.offloaded_blocks(n_blocks),
                                  engine.compute_dtype if config.saved_inputs_dtype == "compute" else None)


def replace(engine: Any, config: EngineConfig) -> None:
    """Between steps: the placement fields of ``config`` from now on; the host state is untouched.

    Sync point: the engine settles (every update of the last step run) and the device finishes what it has
    queued, so that no kernel or copy still reads the old slots; their memory goes back to the device.
    """
    config = dataclasses.replace(engine.config, **{f: getattr(config, f) for f in (*PLACEMENT_FIELDS, "update_on_device")})
    config = config.for_blocks(len(engine.blocks)).filled()
    engine.settle()
    if engine.streams.cuda:
        torch.cuda.synchronize(engine.device)
    recorded = engine.weights.recorded
    engine.weights.close()
    engine.device_update.release()
    engine.meter.memory.release_cached()
    engine.config = config
    lay_out(engine, config)
    engine.weights.learn(recorded)  # the call order the last micro-batch showed, under the new kept set
