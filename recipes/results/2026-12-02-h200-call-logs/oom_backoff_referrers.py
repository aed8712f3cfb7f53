"""Who holds the kept blocks' graphs of a failed attempt (test (b) of test_auto_placement_cuda.py)."""
import gc, sys, types, weakref
sys.path.insert(0, "tests")
import torch
from test_auto_placement_cuda import PlainQwen, CUDA, _free
from conftest import fit, megatrain
from megatrain_lightning.config import STREAMING
from megatrain_lightning import auto_placement
from megatrain_lightning.engine import block as block_mod

GiB = 2**30
kept = []
forward = block_mod.StreamedBlock.forward
def recording(ctx, *args):
    outs = forward(ctx, *args)
    if ctx.kept is not None:
        kept.append((weakref.ref(ctx.kept[0][0]), weakref.ref(ctx.kept[1][0]) if ctx.kept[1] else None))
    return outs
block_mod.StreamedBlock.forward = staticmethod(recording)

def describe(o):
    if isinstance(o, dict):
        return f"dict keys {list(o)[:8]}"
    if isinstance(o, (list, tuple)):
        return f"{type(o).__name__} len {len(o)}"
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_filename.split('/')[-1]}:{o.f_lineno} {o.f_code.co_name}"
    return type(o).__name__ + (f" {o.__qualname__}" if hasattr(o, "__qualname__") else "")

def chain(obj, depth=0, seen=None):
    seen = seen if seen is not None else set()
    if depth > 4:
        return
    for r in gc.get_referrers(obj):
        if id(r) in seen or r is kept or isinstance(r, types.FrameType) and r.f_code.co_name in ("chain", "report"):
            continue
        seen.add(id(r))
        print("   " + "  " * depth + describe(r))
        if len(seen) < 60:
            chain(r, depth + 1, seen)

def report(label):
    gc.collect()
    alive = [(o(), i() if i else None) for o, i in kept if o() is not None]
    print(f"== {label}: allocated {torch.cuda.memory_allocated()/GiB:.2f} GiB; kept graphs alive {len(alive)} of {len(kept)}", flush=True)
    if alive:
        out, inp = alive[0]
        print("  referrers of an alive kept output:"); chain(out)
        if inp is not None:
            print("  referrers of its input leaf:"); chain(inp)
    kept.clear()

factory = lambda: PlainQwen(layers=12, batch=8, seq=2048, steps=4)
_free()
ref = fit(factory, megatrain(**STREAMING), max_steps=4, **CUDA)
peak = torch.cuda.max_memory_reserved()
del ref; _free()
orig = auto_placement.AutoPlacement.out_of_memory
def wrapped(self):
    report(f"at back-off {self.backed_off + 1}")
    return orig(self)
auto_placement.AutoPlacement.out_of_memory = wrapped
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min((peak * 1.15 + 3 * GiB) / total, 1.0))
try:
    got = fit(factory, "megatrain", max_steps=4, **CUDA)
    print("summary", got.trainer.strategy.placement_summary)
except Exception as e:
    print("FAILED", type(e).__name__, str(e)[:200])
finally:
    torch.cuda.set_per_process_memory_fraction(1.0)
