"""The one exception type for input a user can fix, and its one refinement for checkpoints.

`train.py` catches it and prints its message as a single line with a non-zero exit, so a typo in a
path or a model too big for the machine reads as an instruction, not as a traceback. Raise it only
for bad input (config values, paths, sizes, damaged files), never for bugs.
"""


class ConfigError(Exception):
    """Bad user input, with a message that names the setting to change."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded as it is (damaged, incomplete, or refused under
    ``weights_only=True``), raised before any model or optimizer state is touched. The message names
    the file and what to do (resume from an earlier checkpoint, or pass ``weights_only=False``)."""
