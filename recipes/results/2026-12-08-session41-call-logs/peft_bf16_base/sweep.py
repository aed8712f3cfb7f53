import sys, json, logging, time, traceback, warnings
sys.path.insert(0, __import__("os").path.dirname(__file__))
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from functools import partial
from methods import AnyPeftLM, DROPS, EXTRAS, METHODS
from conftest import fit, rel_diff
import megatrain_lightning  # noqa

msgs = []
class H(logging.Handler):
    def emit(self, rec):
        msgs.append(rec.getMessage())
lg = logging.getLogger("megatrain_lightning.strategy")
lg.setLevel(logging.INFO); lg.addHandler(H())
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

methods = sys.argv[1:] or METHODS + EXTRAS + DROPS
out = {}
try:
    out = json.load(open(__import__("os").path.join(__import__("os").path.dirname(__file__), "" + __import__("os").environ.get("OUT_NAME", "sweep") + ".json")))
except Exception:
    pass
for m in methods:
    t0 = time.time()
    factory = partial(AnyPeftLM, method=m, arch="llama")
    rec = {}
    try:
        ref = fit(factory, None, precision="bf16-mixed", max_steps=6)
        msgs.clear()
        got = fit(factory, "megatrain", precision="bf16-mixed", max_steps=6)
        widened = [s for s in msgs if "outside autocast" in s]
        rec["ref_losses"] = ref.losses; rec["got_losses"] = got.losses
        rec["loss_max_abs"] = max(abs(a - b) for a, b in zip(ref.losses, got.losses)) if len(ref.losses) == len(got.losses) else None
        rec["n_losses"] = (len(ref.losses), len(got.losses))
        diffs = {}
        for k, r in ref.state.items():
            g = got.state.get(k)
            if g is None:
                diffs[k] = "missing"; continue
            if r.is_floating_point():
                if g.dtype != r.dtype or g.shape != r.shape:
                    diffs[k] = f"dtype/shape {g.dtype}{tuple(g.shape)} vs {r.dtype}{tuple(r.shape)}"; continue
                diffs[k] = rel_diff(r.cpu(), g.cpu())
            else:
                diffs[k] = 0.0 if torch.equal(r.cpu(), g.cpu()) else float("inf")
        num = {k: v for k, v in diffs.items() if isinstance(v, float)}
        worst = max(num, key=num.get)
        rec["state_max_rel"] = num[worst]; rec["state_worst"] = worst
        rec["state_nonzero"] = sorted([(k, v) for k, v in num.items() if v > 0], key=lambda kv: -kv[1])[:8]
        rec["state_other"] = {k: v for k, v in diffs.items() if not isinstance(v, float)}
        rec["widened"] = widened
        rec["trainable_dtypes"] = sorted({str(p.dtype) for p in ref.module.parameters() if p.requires_grad})
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        rec["tb"] = traceback.format_exc()[-2000:]
    rec["secs"] = time.time() - t0
    out[m] = rec
    json.dump(out, open(__import__("os").path.join(__import__("os").path.dirname(__file__), "" + __import__("os").environ.get("OUT_NAME", "sweep") + ".json"), "w"), indent=1)
    print(m, {k: rec.get(k) for k in ("loss_max_abs", "state_max_rel", "state_worst", "error", "secs")},
          "widened:", [w[:200] for w in rec.get("widened", [])], flush=True)
