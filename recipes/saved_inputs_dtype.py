# python recipes/saved_inputs_dtype.py [--steps 100] [--out recipes/results/<today>-cpu-saved-inputs-dtype.md]
"""What storing saved block inputs in bf16 (``saved_inputs_dtype="compute"``) does to training, on the CPU.

The forward runs each block on its fp32 input; the backward recomputes it from the bf16 rounding of that
input (relative error <= 2^-9 per element), so the recomputed activations, and the gradients taken from
them, differ slightly from the ones the forward had. Two measurements:

1. one Llama decoder layer under bf16 autocast: how far the recompute from the rounded input moves the
   layer's residual update and its weight gradients, next to how far bf16 autocast itself already moves
   them from fp32 (the noise every bf16-mixed run accepts);
2. ``--steps`` optimizer steps of a 4-layer Llama on packed text (this repository's docs, byte tokens)
   under bf16-mixed with MegaTrainStrategy: saved inputs fp32 (the reference) against bf16 on the device
   and bf16 offloaded to the host (the same rounding: must match each other bit for bit), and, for scale,
   the same run in fp32 (32-true), i.e. how far bf16-mixed itself moves the losses.

Writes a markdown table (date, machine, versions, the exact settings, raw per-step losses at the end).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, SEQ, BATCH, LR = 4, 128, 512, 4, 2, 256, 4, 1e-3


def layer_effect(tokens: int = 1024, hidden: int = 512, seed: int = 0) -> dict[str, float]:
    """One Llama layer (hidden 512, intermediate 1376, 8 heads), bf16 autocast: relative differences."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=tokens)
    cfg._attn_implementation = "sdpa"
    layer, rope = LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)
    x = torch.randn(1, tokens, hidden)  # an fp32 residual stream
    upstream = torch.randn(1, tokens, hidden)
    pos = rope(x, torch.arange(tokens)[None])

    def run(inp: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(inp, position_embeddings=pos)
        (out.float() * upstream).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in layer.parameters()])
        return (out.float() - inp).detach(), grads  # the residual update, all weight gradients

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).double().norm() / b.double().norm())

    upd_fp32, g_fp32 = run(x, autocast=False)
    upd, g = run(x, autocast=True)
    upd_r, g_r = run(x.bfloat16().float(), autocast=True)
    return {"input rounding: residual update": rel(upd_r, upd), "input rounding: weight gradients": rel(g_r, g),
            "bf16 autocast vs fp32: residual update": rel(upd, upd_fp32),
            "bf16 autocast vs fp32: weight gradients": rel(g, g_fp32)}


class Losses:
    def __init__(self) -> None:
        import lightning.pytorch as pl

        class Recorder(pl.Callback):
            megatrain_reads_weights = False

            def __init__(self, out: list[float]) -> None:
                self.out = out

            def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:  # noqa: ANN001
                self.out.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

        self.values: list[float] = []
        self.callback = Recorder(self.values)


def train(steps: int, strategy: str, precision: str, **engine: object) -> tuple[list[float], dict[str, torch.Tensor]]:
    import lightning.pytorch as pl

    from megatrain_lightning import EngineConfig, MegaTrainStrategy
    from megatrain_lightning.data import PackedTextDataModule
    from megatrain_lightning.models import CausalLM

    pl.seed_everything(0, verbose=False)
    config = dict(model_type="llama", vocab_size=259, hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=SEQ, tie_word_embeddings=True, pad_token_id=256, bos_token_id=257,
                  eos_token_id=258)
    module = CausalLM(name="tiny4", config=config, lr=LR, warmup_steps=10, decay_steps=steps, loss_chunk_tokens=None)
    data = PackedTextDataModule(str(ROOT / "docs"), seq_len=SEQ, batch_size=BATCH)
    losses = Losses()
    strat = MegaTrainStrategy(engine=EngineConfig(**engine)) if strategy == "megatrain" else "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strat, precision=precision, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         callbacks=[losses.callback], deterministic=True)
    pl.seed_everything(0, verbose=False)
    trainer.fit(module, datamodule=data)
    return losses.values, {k: v.detach().clone() for k, v in module.state_dict().items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=f"recipes/results/{datetime.date.today()}-cpu-saved-inputs-dtype.md")
    args = ap.parse_args()
    torch.set_num_threads(2)

    effect = layer_effect()
    runs = {
        "bf16-mixed, saved inputs fp32 (reference)": ("megatrain", "bf16-mixed", dict()),
        "bf16-mixed, saved inputs bf16 on the device": ("megatrain", "bf16-mixed", dict(saved_inputs_dtype="compute")),
        "bf16-mixed, saved inputs bf16 offloaded": ("megatrain", "bf16-mixed",
                                                     dict(saved_inputs_dtype="compute", offload_inputs=True)),
        "32-true, saved inputs fp32": ("megatrain", "32-true", dict()),
    }
    results = {name: train(args.steps, *spec[:2], **spec[2]) for name, spec in runs.items()}
    ref_name = next(iter(results))
    ref_losses, ref_state = results[ref_name]

    def state_diff(state: dict[str, torch.Tensor]) -> float:
        num = sum(float((state[k].double() - ref_state[k].double()).norm() ** 2) for k in ref_state)
        den = sum(float(ref_state[k].double().norm() ** 2) for k in ref_state)
        return (num / den) ** 0.5

    lines = [
        "# bf16 saved block inputs (`saved_inputs_dtype=\"compute\"`): the loss difference on the CPU",
        "",
        f"- date: {datetime.date.today()}; machine: {platform.node()} ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads), CPU only; python {sys.version.split()[0]}, torch {torch.__version__}",
        f"- command: `python recipes/saved_inputs_dtype.py --steps {args.steps}`",
        f"- model: Llama, {LAYERS} layers, hidden {HIDDEN}, intermediate {INTER}, {HEADS} heads ({KV_HEADS} kv), tied "
        f"byte embeddings (259); AdamW lr {LR}, 10 warm-up steps, cosine decay; data: this repository's docs/*.md "
        f"packed into rows of {SEQ} byte tokens, micro-batch {BATCH}; seed 0, deterministic",
        "",
        "## One layer (hidden 512, 1024 tokens, bf16 autocast): relative L2 differences",
        "",
        "| what | relative difference |",
        "| --- | --- |",
        *[f"| {k} | {v:.2e} |" for k, v in effect.items()],
        "",
        f"## {args.steps} steps: losses against the reference ({ref_name})",
        "",
        "| run | first loss | last loss | max abs loss diff | mean abs loss diff | max rel loss diff | final weights rel diff |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (losses, state) in results.items():
        diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
        rels = [d / abs(b) for d, b in zip(diffs, ref_losses)]
        lines.append(f"| {name} | {losses[0]:.6f} | {losses[-1]:.6f} | {max(diffs):.2e} | {sum(diffs) / len(diffs):.2e} "
                     f"| {max(rels):.2e} | {state_diff(state):.2e} |")
    lines += ["", "Raw per-step losses:", ""]
    for name, (losses, _) in results.items():
        lines.append(f"- {name}: " + " ".join(f"{v:.6f}" for v in losses))
    text = "\n".join(lines) + "\n"
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
