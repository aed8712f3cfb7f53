"""The planner: host bytes, device bytes and step time of a MegaTrainStrategy run, before allocating.

    python -m megatrain_lightning.plan model=qwen2_5_7b hardware=h200 [data.seq_len=4096 ...]

Everything here is arithmetic on a :class:`PlanShape` (counts and widths read off a meta-device model), a
:class:`Workload`, an :class:`~megatrain_lightning.config.EngineConfig` and a hardware profile's ceilings.
Modules: ``shape``, ``run`` (workload + engine config), ``memory`` (bytes), ``timing`` (seconds), ``fit``
(the plan and the one fit check), ``placement`` (the placement chosen where a config leaves it open),
``report`` (the table), ``from_config`` (a composed ``conf/`` config).
Lightning-free.
"""

from .fit import Plan, check_baseline_host, device_state_warning, make_plan, resolve
from .from_config import plan_from_config
from .memory import GB, GIB
from .report import format_plan, verdict
from .run import Run, Workload
from .shape import PlanShape

__all__ = ["GB", "GIB", "Plan", "PlanShape", "Run", "Workload", "check_baseline_host", "device_state_warning",
           "format_plan", "make_plan", "plan_from_config", "resolve", "verdict"]
