"""Where the device memory of test (b) goes: allocated after each fit, and the live blocks at each back-off."""
import gc, sys, collections
sys.path.insert(0, "tests")
import torch
from test_auto_placement_cuda import PlainQwen, CUDA, _free
from conftest import fit, megatrain
from megatrain_lightning.config import STREAMING
from megatrain_lightning import auto_placement

torch.cuda.memory._record_memory_history(max_entries=200000)
GiB = 2**30

def top_blocks(label, n=12):
    snap = torch.cuda.memory._snapshot()
    live = collections.Counter()
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = [f for f in b.get("frames", []) if "megatrain" in f["filename"] or "transformers" in f["filename"] or "test" in f["filename"] or "lightning" in f["filename"]]
            key = " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames[:4]) or "?"
            live[key] += b["size"]
    print(f"== {label}: allocated {torch.cuda.memory_allocated()/GiB:.2f} GiB", flush=True)
    for k, s in live.most_common(n):
        print(f"   {s/GiB:7.3f} GiB  {k}")

factory = lambda: PlainQwen(layers=12, batch=8, seq=2048, steps=4)
_free(); top_blocks("start")
ref = fit(factory, megatrain(**STREAMING), max_steps=4, **CUDA)
peak = torch.cuda.max_memory_reserved()
_free(); top_blocks(f"after ref fit (its peak reserved {peak/GiB:.2f})")
print("RunResult fields:", [k for k in vars(ref)] if hasattr(ref, "__dict__") else type(ref))
orig = auto_placement.AutoPlacement.out_of_memory
def wrapped(self):
    gc.collect()
    top_blocks(f"at back-off {self.backed_off + 1}")
    return orig(self)
auto_placement.AutoPlacement.out_of_memory = wrapped
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min((peak * 1.15 + 3 * GiB) / total, 1.0))
try:
    got = fit(factory, "megatrain", max_steps=4, **CUDA)
    print("summary", got.trainer.strategy.placement_summary)
except Exception as e:
    print("FAILED", type(e).__name__, str(e)[:300]); gc.collect(); top_blocks("at the failure")
finally:
    torch.cuda.set_per_process_memory_fraction(1.0)
_free(); top_blocks("after the auto fit")
