"""Curves to look at: a run's loss, learning rate and exact match, and a sweep's runs side by side, as PNGs.

Read from what the runs already wrote (`logs/metrics.csv`, `metrics.json`), so plotting never touches
training. matplotlib is optional (`pip install 'megatrain-lightning[plot]'`); without it each function
logs one line saying so and returns None. Figures are drawn with the Agg canvas directly (no pyplot, no
global backend switch), so plotting is safe on a machine without a display and inside a library.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RUN_PNG = "curves.png"
SWEEP_PNG = "sweep_curves.png"
_NO_MATPLOTLIB = "no %s: matplotlib is not installed (pip install 'megatrain-lightning[plot]' for the curves)"


def read_metrics_csv(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Each column of a CSVLogger `metrics.csv` as (step, value) pairs, empty cells skipped."""
    series: dict[str, list[tuple[int, float]]] = {}
    if not path.is_file():
        return series
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                try:
                    series.setdefault(key, []).append((int(float(step)), float(value)))
                except ValueError:
                    continue
    return series


def _figure(panels: int) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * panels, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, panels, i + 1) for i in range(panels)]
    return fig, axes


def _lr_key(series: dict[str, Any]) -> str | None:
    return next((k for k in series if k.startswith("lr-")), None)


def plot_run(run_dir: str | Path) -> Path | None:
    """`<run_dir>/curves.png`: training and validation loss, learning rate, exact match against step."""
    run_dir = Path(run_dir)
    if importlib.util.find_spec("matplotlib") is None:
        log.info(_NO_MATPLOTLIB, RUN_PNG)
        return None
    series = read_metrics_csv(run_dir / "logs" / "metrics.csv")
    if "loss" not in series and "val/loss" not in series:
        log.info("no %s: %s has no loss logged", RUN_PNG, run_dir / "logs" / "metrics.csv")
        return None
    lr, em = _lr_key(series), series.get("val/exact_match")
    fig, axes = _figure(1 + bool(lr) + bool(em))
    ax = axes[0]
    if "loss" in series:  # logged every trainer.log_every_n_steps: none in a shorter run
        ax.plot(*zip(*series["loss"]), label="training loss", linewidth=1)
    if "val/loss" in series:
        ax.plot(*zip(*series["val/loss"]), "o-", label="validation loss")
    ax.set(xlabel="step", ylabel="loss", yscale="log", title="loss")
    ax.legend()
    i = 1
    if lr:
        axes[i].plot(*zip(*series[lr]))
        axes[i].set(xlabel="step", ylabel="learning rate", title=lr.removeprefix("lr-") + " learning rate")
        i += 1
    if em:
        axes[i].plot(*zip(*em), "o-")
        axes[i].set(xlabel="step", ylabel="exact match", ylim=(-0.02, 1.02), title="exact match (held out)")
    for a in axes:
        a.grid(alpha=0.3)
    out = run_dir / RUN_PNG
    fig.savefig(out, dpi=100)
    return out


def plot_sweep(sweep_dir: str | Path, rows: list[dict[str, Any]]) -> Path | None:
    """`<sweep_dir>/sweep_curves.png`: every run's training loss (and exact match, when validated) on one
    axis each, labelled by job and its overrides (else model and strategy); and tokens/s by run."""
    sweep_dir = Path(sweep_dir)
    if importlib.util.find_spec("matplotlib") is None:
        log.info(_NO_MATPLOTLIB, SWEEP_PNG)
        return None
    overrides = [str(row.get("overrides") or "").split() for row in rows]
    shared = set.intersection(*map(set, overrides)) if overrides else set()
    runs = []
    for row, own in zip(rows, overrides):
        job = str(row.get("job", ""))
        series = read_metrics_csv(sweep_dir / job / "logs" / "metrics.csv")
        differs = " ".join(o for o in own if o not in shared)  # what sets this run apart from the others
        label = f"{job}: {differs or str(row.get('model', '?')) + ' / ' + str(row.get('strategy', '?'))}"
        runs.append((label if len(label) <= 48 else label[:47] + "…", series, row))
    if not any("loss" in s or "val/loss" in s for _, s, _ in runs):
        log.info("no %s: no run of %s logged a loss", SWEEP_PNG, sweep_dir)
        return None
    with_em = any("val/exact_match" in s for _, s, _ in runs)
    fig, axes = _figure(2 + with_em)
    for label, series, _ in runs:
        if "loss" in series:
            axes[0].plot(*zip(*series["loss"]), label=label, linewidth=1)
        elif "val/loss" in series:  # a run too short to log its training loss
            axes[0].plot(*zip(*series["val/loss"]), "o--", label=f"{label} (validation)")
        if with_em and "val/exact_match" in series:
            axes[1].plot(*zip(*series["val/exact_match"]), "o-", label=label)
    axes[0].set(xlabel="step", ylabel="loss", yscale="log", title="loss")
    axes[0].legend(fontsize="small")
    if with_em:
        axes[1].set(xlabel="step", ylabel="exact match", ylim=(-0.02, 1.02), title="exact match (held out)")
        axes[1].legend(fontsize="small")
    bars = axes[-1]
    labels = [label for label, _, _ in runs]
    speeds = [float(r.get("tokens_per_s") or 0) for _, _, r in runs]
    bars.barh(range(len(runs)), speeds)
    bars.set_yticks(range(len(runs)), labels, fontsize="small")
    bars.invert_yaxis()
    bars.set(xlabel="tokens/s", title="throughput (0: failed)")
    for a in axes:
        a.grid(alpha=0.3)
    out = sweep_dir / SWEEP_PNG
    fig.savefig(out, dpi=100)
    return out

