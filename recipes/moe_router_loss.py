# python recipes/moe_router_loss.py --arch gpt_oss --hidden 64 --layers 4 --experts 8 --top-k 2 --steps 8
"""A mixture of experts with its router's auxiliary loss, under MegaTrainStrategy (and, with --compare,
Lightning's default strategy): losses, step time, and the all-zero expert gradients the engine ships.

The model is a Hugging Face MoE (``--arch gpt_oss``, ``mixtral`` or ``qwen3_moe``) built from a config of
the given size with random weights, trained on random tokens (``--data random``, nothing to learn: its routers
drift) or on addition written out (``--data arithmetic``, ``"417+86=503\n"`` as bytes: a task it learns, the loss
falling) with ``output_router_logits=True`` and
``router_aux_loss_coef`` (HF's ``outputs.loss``). Per step it counts the experts of each layer that got no
token (from the router logits the loss was built from) and the bytes of their gradient slices, which the
engine ships with the rest of the block's slab (``docs/moe.md``). ``--coef 0`` turns the router loss off
(for the cost of the extra outputs; idle experts are then not counted). Prints one JSON line.

On the GPU: add ``--accelerator cuda --precision bf16-mixed`` (and a realistic size, e.g. ``--hidden 2880
--layers 4 --experts 32 --top-k 4 --micro-batch 4 --seq-len 2048``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from megatrain_lightning import MegaTrainStrategy


def hf_config(arch: str, hidden: int, layers: int, experts: int, top_k: int, coef: float, vocab: int) -> Any:
    import transformers

    heads = max(1, hidden // 64) if hidden >= 64 else 4
    kv_heads = max(d for d in range(1, heads // 4 + 1) if heads % d == 0) if heads >= 4 else 1  # divides heads
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=hidden // heads, num_experts_per_tok=top_k,
                  max_position_embeddings=1 << 16, output_router_logits=coef > 0, router_aux_loss_coef=coef,
                  attn_implementation="eager")
    if arch == "gpt_oss":
        return transformers.GptOssConfig(intermediate_size=hidden, num_local_experts=experts,
                                         layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                         + ["sliding_attention"] * (layers % 2), sliding_window=128, **common)
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=hidden, num_local_experts=experts, **common)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden,
                                           num_experts=experts, **common)
    raise ValueError(f"--arch {arch!r}: gpt_oss, mixtral or qwen3_moe")


class MoELM(pl.LightningModule):
    """A Hugging Face MoE causal LM on random tokens, counting per step the experts that got no token."""

    def __init__(self, config: Any, lr: float) -> None:
        super().__init__()
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.lr = lr
        self.idle: list[list[torch.Tensor]] = []  # per step, per MoE layer: experts without a token

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids)
        if out.router_logits:
            cfg = self.model.config
            n = getattr(cfg, "num_local_experts", None) or cfg.num_experts
            idle = []
            for logits in out.router_logits:
                hit = torch.zeros(n, dtype=torch.bool, device=logits.device)
                hit[logits.topk(cfg.num_experts_per_tok, dim=-1).indices.reshape(-1)] = True
                idle.append((~hit).sum())  # read after the run: no host sync in the step
            self.idle.append(idle)
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, fused=True)


class StepTimes(pl.Callback):
    megatrain_reads_weights = False

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *_: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)
        self.losses.append(float(outputs["loss"]))


def tokens(kind: str, rows: int, seq_len: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """``rows`` x ``seq_len`` token ids: uniform at random, or additions of operands below 1000 as bytes."""
    if kind == "random":
        return torch.randint(0, vocab, (rows, seq_len), generator=g)
    if kind != "arithmetic" or vocab < 128:
        raise ValueError(f"--data {kind!r} with --vocab {vocab}: random, or arithmetic with a vocab of 128 or more")
    need = rows * seq_len
    ops = torch.randint(0, 1000, (need // 6 + 1, 2), generator=g).tolist()  # a line is 6 to 12 bytes
    text = "".join(f"{a}+{b}={a + b}\n" for a, b in ops).encode()[:need]
    return torch.tensor(list(text), dtype=torch.long).view(rows, seq_len)


def run(args: argparse.Namespace, strategy: Any) -> dict[str, Any]:
    config = hf_config(args.arch, args.hidden, args.layers, args.experts, args.top_k, args.coef, args.vocab)
    pl.seed_everything(0, verbose=False)
    module = MoELM(config, args.lr)
    g = torch.Generator().manual_seed(1)
    data = tokens(args.data, args.steps * args.micro_batch, args.seq_len, args.vocab, g)
    timer = StepTimes()
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy, precision=args.precision,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer], num_sanity_val_steps=0, limit_val_batches=0)
    pl.seed_everything(0, verbose=False)
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=args.micro_batch, shuffle=False))
    layers = [m for m in module.model.modules() if hasattr(m, "mlp") and hasattr(m.mlp, "experts")]
    n = args.experts
    per_expert = [sum(p.numel() for p in layer.mlp.experts.parameters()) // n for layer in layers]
    blocks = sum(sum(p.numel() for p in layer.parameters()) for layer in layers)
    idle = [[int(k) for k in step] for step in module.idle]
    zero_bytes = [sum(k * e * 4 for k, e in zip(step, per_expert)) for step in idle]
    return {
        "losses": timer.losses,
        "step_s_median": statistics.median(timer.times[2:] or timer.times),
        "idle_experts_per_step": [sum(s) for s in idle],
        "block_grad_bytes_per_step_fp32": blocks * 4,
        "all_zero_expert_grad_bytes_per_step_fp32": zero_bytes,
        "state": {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="gpt_oss")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--coef", type=float, default=0.5, help="router_aux_loss_coef; 0 turns the router loss off")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--data", default="random", help="random (nothing to learn) or arithmetic (a task it learns)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--compare", action="store_true", help="also train under Lightning's default strategy")
    args = p.parse_args(argv)
    got = run(args, MegaTrainStrategy())
    out: dict[str, Any] = {"args": vars(args), "megatrain": {k: v for k, v in got.items() if k != "state"}}
    if args.compare:
        ref = run(args, "auto")
        out["native"] = {k: v for k, v in ref.items() if k != "state"}
        out["max_loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], got["losses"]))
        out["max_param_rel_diff"] = max(
            float((got["state"][k] - r).norm() / r.norm().clamp_min(1e-30)) for k, r in ref["state"].items())
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
