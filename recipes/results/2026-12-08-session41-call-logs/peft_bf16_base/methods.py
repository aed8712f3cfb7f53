"""Peft configs for a tiny Llama (peft 0.21.2) and a LightningModule around them; session 41: the base cast to bf16
before get_peft_model (what from_pretrained(torch_dtype=torch.bfloat16) gives; peft keeps the adapters in fp32).
MT_ROOT: the checkout whose package and tests run (default: this one)."""
import sys
import os
ROOT = os.environ.get("MT_ROOT") or os.path.abspath(os.path.join(os.path.dirname(__file__), *[".."] * 4))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
from typing import Any
import torch
from compat_zoo import CausalLMModule, build_causal_lm

ATTN = ["q_proj", "v_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def config(method: str):
    import peft as P
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0)
    return {
        "lora-attn": lambda: P.LoraConfig(**lora, target_modules=ATTN),
        "lora-mlp": lambda: P.LoraConfig(**lora, target_modules=MLP),
        "dora": lambda: P.LoraConfig(**lora, target_modules=ATTN, use_dora=True),
        "ia3": lambda: P.IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", "down_proj"],
                                   feedforward_modules=["down_proj"]),
        "prompt": lambda: P.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "loha": lambda: P.LoHaConfig(r=4, alpha=8, target_modules=ATTN),
        "lokr": lambda: P.LoKrConfig(r=4, alpha=8, target_modules=ATTN),
        "adalora": lambda: P.AdaLoraConfig(init_r=4, target_r=2, total_step=6, lora_alpha=8, lora_dropout=0.0,
                                           target_modules=ATTN),
        "vera": lambda: P.VeraConfig(r=4, target_modules=ATTN, vera_dropout=0.0),
        "boft": lambda: P.BOFTConfig(boft_block_size=4, target_modules=ATTN, boft_dropout=0.0),
        "oft": lambda: P.OFTConfig(r=0, oft_block_size=8, target_modules=ATTN),
        "fourierft": lambda: P.FourierFTConfig(n_frequency=16, target_modules=ATTN),
        "hra": lambda: P.HRAConfig(r=4, target_modules=ATTN),
        "c3a": lambda: P.C3AConfig(block_size=8, target_modules=ATTN),
        "randlora": lambda: P.RandLoraConfig(r=4, target_modules=ATTN),
        "shira": lambda: P.ShiraConfig(r=4, target_modules=ATTN),
        "miss": lambda: P.MissConfig(r=4, target_modules=ATTN),
        "gralora": lambda: P.GraloraConfig(r=4, gralora_k=2, target_modules=ATTN),
        "waveft": lambda: P.WaveFTConfig(n_frequency=16, target_modules=ATTN),
        "ln_tuning": lambda: P.LNTuningConfig(target_modules=["input_layernorm", "post_attention_layernorm"]),
        "vblora": lambda: P.VBLoRAConfig(r=4, target_modules=ATTN, num_vectors=16, vector_length=8, vblora_dropout=0.0),
        "delora": lambda: P.DeloraConfig(r=4, target_modules=ATTN),
        "road": lambda: P.RoadConfig(target_modules=ATTN, group_size=8),
        # extras
        "trainable_tokens": lambda: P.TrainableTokensConfig(token_indices=[1, 2, 3], target_modules=["embed_tokens"]),
        "unilora": lambda: P.UniLoraConfig(r=4, target_modules=ATTN),
        "lily": lambda: P.LilyConfig(r=4, target_modules=ATTN),
        "psoft": lambda: P.PsoftConfig(r=4, target_modules=ATTN),
        "hira": lambda: P.HiraConfig(r=4, target_modules=ATTN),
        "pvera": lambda: P.PveraConfig(r=4, target_modules=ATTN),
        "frod": lambda: P.FrodConfig(target_modules=ATTN),
        "glora": lambda: P.GloraConfig(r=4, target_modules=ATTN),
        "beft": lambda: P.BeftConfig(target_modules=ATTN),
        "deft": lambda: P.DeftConfig(target_modules=ATTN),
        "peanut": lambda: P.PeanutConfig(target_modules=ATTN),
        "shadow": lambda: P.ShadowConfig(target_modules=ATTN),
        "supertuning": lambda: P.SupertuningConfig(target_modules=ATTN),
        "osf": lambda: P.OSFConfig(effective_rank=8, target_modules=ATTN),
        "tinylora": lambda: P.TinyLoraConfig(r=4, target_modules=ATTN),
        "lora-pissa": lambda: P.LoraConfig(**lora, target_modules=ATTN, init_lora_weights="pissa"),
        "lora-rslora-bias": lambda: P.LoraConfig(**lora, target_modules=ATTN, use_rslora=True, lora_bias=True),
        "lora-embed": lambda: P.LoraConfig(**lora, target_modules=["embed_tokens", "q_proj"]),
        # with dropout
        "lora-drop": lambda: P.LoraConfig(**{**lora, "lora_dropout": 0.1}, target_modules=ATTN + MLP),
        "dora-drop": lambda: P.LoraConfig(**{**lora, "lora_dropout": 0.1}, target_modules=ATTN, use_dora=True),
        "adalora-drop": lambda: P.AdaLoraConfig(init_r=4, target_r=2, total_step=6, lora_alpha=8, lora_dropout=0.1,
                                                target_modules=ATTN),
        "vera-drop": lambda: P.VeraConfig(r=4, target_modules=ATTN, vera_dropout=0.1),
        "boft-drop": lambda: P.BOFTConfig(boft_block_size=4, target_modules=ATTN, boft_dropout=0.1),
        "vblora-drop": lambda: P.VBLoRAConfig(r=4, target_modules=ATTN, num_vectors=16, vector_length=8,
                                              vblora_dropout=0.1),
        "loha-drop": lambda: P.LoHaConfig(r=4, alpha=8, target_modules=ATTN, rank_dropout=0.1, module_dropout=0.0),
        "lokr-drop": lambda: P.LoKrConfig(r=4, alpha=8, target_modules=ATTN, rank_dropout=0.1),
        "oft-drop": lambda: P.OFTConfig(r=0, oft_block_size=8, target_modules=ATTN, module_dropout=0.1),
    }[method]()


class AnyPeftLM(CausalLMModule):
    def __init__(self, method: str = "lora-attn", **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def build(self):
        import peft
        base = build_causal_lm(self.hparams.arch)
        base.config.use_cache = False
        base = base.to(torch.bfloat16)
        return peft.get_peft_model(base, config(self.hparams.method))


METHODS = ["lora-attn", "lora-mlp", "dora", "ia3", "prompt", "loha", "lokr", "adalora", "vera", "boft", "oft",
           "fourierft", "hra", "c3a", "randlora", "shira", "miss", "gralora", "waveft", "ln_tuning", "vblora",
           "delora", "road"]

EXTRAS = ["trainable_tokens", "unilora", "lily", "psoft", "hira", "pvera", "frod", "glora", "beft", "deft", "peanut",
          "shadow", "supertuning", "osf", "tinylora", "lora-pissa", "lora-rslora-bias", "lora-embed"]
DROPS = ["lora-drop", "dora-drop", "adalora-drop", "vera-drop", "boft-drop", "vblora-drop", "loha-drop", "lokr-drop",
         "oft-drop"]
