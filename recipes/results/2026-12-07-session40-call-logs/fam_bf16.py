import sys, os, logging
root = sys.argv[1]; sys.path.insert(0, root + "/tests"); sys.path.insert(0, root)
import torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
for l in ("lightning", "lightning.pytorch"): logging.getLogger(l).setLevel(logging.WARNING)
torch.set_num_threads(1)
import megatrain_lightning; assert megatrain_lightning.__file__.startswith(root), megatrain_lightning.__file__
from conftest import fit
import test_compat_families as T
fams = sys.argv[2:] or sorted(T.FAMILIES)
for fam in fams:
    if not T._available(fam): continue
    f = lambda: T.Family(family=fam)
    try:
        ref = fit(f, None, precision="bf16-mixed", max_steps=3)
        got = fit(f, "megatrain", precision="bf16-mixed", max_steps=3)
    except Exception as e:
        print(f"RESULT {fam}: error {type(e).__name__}: {str(e)[:200]}"); continue
    d = max(abs(a - b) for a, b in zip(ref.losses, got.losses))
    rel = {k: ((ref.state[k].float() - got.state[k].float()).norm() / ref.state[k].float().norm().clamp_min(1e-30)).item() for k in ref.state if ref.state[k].is_floating_point()}
    k = max(rel, key=rel.get)
    print(f"RESULT {fam}: loss maxdiff {d:.3e}, state max rel {rel[k]:.3e} ({k})", flush=True)
