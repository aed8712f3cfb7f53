"""python with_stacks.py SECONDS train.py-overrides...: train.py, with every thread's stack on stderr every SECONDS."""
import faulthandler, runpy, sys
faulthandler.dump_traceback_later(float(sys.argv[1]), repeat=True, file=sys.stderr)
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
