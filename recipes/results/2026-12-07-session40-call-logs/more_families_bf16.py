import sys, logging, warnings
root = sys.argv[1]; sys.path.insert(0, root + "/tests"); sys.path.insert(0, root)
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
for l in ("lightning", "lightning.pytorch"): logging.getLogger(l).setLevel(logging.ERROR)
import transformers
from conftest import fit
from zoo import ZooModule, random_tokens
V = 64
EAGER = False
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
TYPES = {
    "mistral": {}, "qwen3": dict(head_dim=8), "phi3": {}, "gemma2": dict(head_dim=8), "olmo2": {}, "cohere": {},
    "starcoder2": {}, "stablelm": {}, "granite": {}, "gpt_neox": dict(rotary_pct=0.5), "falcon": {},
    "phi": {}, "mixtral": dict(num_local_experts=4, num_experts_per_tok=2), "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2), "glm": dict(head_dim=8), "helium": dict(head_dim=8), "smollm3": {},
    "exaone4": {}, "ernie4_5": {}, "seed_oss": dict(head_dim=8), "arcee": {}, "ministral": {}, "apertus": {},
}
class M(ZooModule):
    def __init__(self, mtype="mistral", **kw):
        kw.setdefault("n_train", 12); kw.setdefault("scheduler", False); kw.setdefault("lr", 1e-3)
        super().__init__(**kw)
        cfg = transformers.AutoConfig.for_model(mtype, **{**BASE, **TYPES[mtype]})
        self.model = transformers.AutoModelForCausalLM.from_config(cfg, **({"experts_implementation": "eager"} if EAGER else {}))
    def make_data(self, n, s, seed): return random_tokens(n, s, V, seed)
    def compute_loss(self, batch):
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss
from functools import partial
EAGER = "eager" in sys.argv; args = [a for a in sys.argv[2:] if a != "eager"]
for t in (args or TYPES):
    f = partial(M, mtype=t)
    try:
        ref = fit(f, None, precision="bf16-mixed", max_steps=3)
        got = fit(f, "megatrain", precision="bf16-mixed", max_steps=3)
    except Exception as e:
        print(f"RESULT {t}: error {type(e).__name__}: {str(e)[:200]}", flush=True); continue
    d = max(abs(a - b) for a, b in zip(ref.losses, got.losses))
    rel = {k: ((ref.state[k].float() - got.state[k].float()).norm() / ref.state[k].float().norm().clamp_min(1e-30)).item() for k in ref.state if ref.state[k].is_floating_point()}
    k = max(rel, key=rel.get)
    print(f"RESULT {t}: loss maxdiff {d:.3e}, state max rel {rel[k]:.3e} ({k})", flush=True)
