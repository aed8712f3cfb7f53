"""The one exception type for input a user can fix.

`train.py` catches it and prints its message as a single line with a non-zero exit, so a typo in a
path or a model too big for the machine reads as an instruction, not as a traceback. Raise it only
for bad input (config values, paths, sizes), never for bugs.
"""


class ConfigError(Exception):
    """Bad user input, with a message that names the setting to change."""
