"""Where the Hydra configs are: ``conf/`` at the top of the project, shipped inside the package as data.

In a source checkout ``megatrain_lightning/conf`` is a link to the top-level ``conf/``; a wheel carries the
files themselves (``pyproject.toml``'s package data), so an installed package composes the same configs.
"""

from __future__ import annotations

from pathlib import Path


def config_dir() -> Path:
    """The directory holding ``train.yaml`` and the config groups."""
    return Path(__file__).resolve().parent / "conf"
