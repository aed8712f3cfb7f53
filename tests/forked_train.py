# python tests/forked_train.py CASES.json   (tests/test_train_cli.py's bad-input runs)
"""`python train.py ARGS` once per case, each in a child forked from one process that imported train.py first.

Each case is what a user's `python train.py ARGS` is, less the interpreter's start-up and the imports (torch,
Lightning, Hydra, transformers: about 5 s of CPU each, paid here once instead of once per case). A child sets its
own address-space limit, runs train.py's Hydra entry point with its arguments in its working directory, and
exits with the code the command would have exited with; its stdout and stderr go to files the test reads.

CASES.json: {"cwd": dir, "address_space": bytes, "cases": {name: [arg, ...]}}; writes dir/NAME.out, NAME.err and
NAME.rc (and NAME.s: seconds from the end of the shared imports to the child's exit).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import resource
import runpy
import sys
import time
import traceback
from pathlib import Path

TRAIN = Path(__file__).resolve().parent.parent / "train.py"


def child(cwd: Path, name: str, args: list[str], address_space: int) -> int:
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    os.chdir(cwd)
    sys.path[0] = str(TRAIN.parent)  # what `python train.py` puts first: the script's directory, not tests/
    for fd, suffix in ((1, "out"), (2, "err")):
        f = os.open(cwd / f"{name}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [str(TRAIN), *args]
    try:
        runpy.run_path(str(TRAIN), run_name="__main__")  # as `python train.py` runs it; its imports are loaded
        return 0
    except SystemExit as e:  # as the interpreter ends on it: an int is the code, anything else is printed, code 1
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # what the interpreter would print for an uncaught exception, and its exit code
        traceback.print_exc()
        return 1
    finally:
        atexit._run_exitfuncs()  # the interpreter's exit runs them (os._exit below would not)
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    cwd, address_space = Path(spec["cwd"]), int(spec["address_space"])
    load = importlib.util.spec_from_file_location("train", TRAIN)
    train = importlib.util.module_from_spec(load)
    load.loader.exec_module(train)  # the imports every case shares
    started = time.perf_counter()
    pids = {}
    for name, args in spec["cases"].items():
        pid = os.fork()
        if pid == 0:
            os._exit(child(cwd, name, args, address_space))
        pids[pid] = name
    while pids:
        pid, status = os.wait()
        name = pids.pop(pid)
        (cwd / f"{name}.rc").write_text(str(os.waitstatus_to_exitcode(status)))
        (cwd / f"{name}.s").write_text(f"{time.perf_counter() - started:.3f}")


if __name__ == "__main__":
    main()
