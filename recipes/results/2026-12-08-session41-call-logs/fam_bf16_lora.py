"""Session 41: each family of tests/test_compat_families.py as a fine-tune: the model cast to bf16 (what
from_pretrained(torch_dtype=torch.bfloat16) gives), peft LoRA on every linear layer (r=8, dropout 0.05), 3 steps of
Lightning's bf16-mixed against strategy="megatrain". Usage: python fam_bf16_lora.py ROOT [family ...]"""
import os, sys, logging
root = sys.argv[1]; sys.path.insert(0, root + "/tests"); sys.path.insert(0, root)
import torch
logging.basicConfig(level=logging.WARNING, format="%(message)s")
torch.set_num_threads(1)
import megatrain_lightning; assert megatrain_lightning.__file__.startswith(root), megatrain_lightning.__file__
import peft
from conftest import fit
import test_compat_families as T


class LoraFamily(T.Family):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        base = self.model.to(torch.bfloat16) if os.environ.get("BASE", "bf16") == "bf16" else self.model
        self.model = peft.get_peft_model(base, peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=float(os.environ.get("DROP", "0.05")), target_modules="all-linear"))


fams = sys.argv[2:] or sorted(T.FAMILIES)
for fam in fams:
    if not T._available(fam):
        continue
    f = lambda: LoraFamily(family=fam)  # noqa: E731
    try:
        ref = fit(f, None, precision="bf16-mixed", max_steps=3)
        got = fit(f, "megatrain", precision="bf16-mixed", max_steps=3)
    except Exception as e:
        print(f"RESULT {fam}: error {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
    d = max(abs(a - b) for a, b in zip(ref.losses, got.losses))
    rel = {k: ((ref.state[k].float() - got.state[k].float()).norm() / ref.state[k].float().norm().clamp_min(1e-30)).item()
           for k in ref.state if ref.state[k].is_floating_point()}
    k = max(rel, key=rel.get)
    print(f"RESULT {fam}: loss maxdiff {d:.3e}, state max rel {rel[k]:.3e} ({k})", flush=True)
