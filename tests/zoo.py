"""Tiny model zoo for the parity tests: every model is built from a config, randomly initialised
from the global seed (the harness seeds before building), and never downloads anything.

Each zoo entry is a LightningModule whose hyperparameters pick the optimizer, scheduler, data
size and so on, so that one test can vary them without a new class. Data is a fixed random
token tensor made from its own `torch.Generator` (independent of the global RNG), served by a
`DataLoader` with `shuffle=False`, so that two runs see identical batches.

Models:
    llama        tiny Hugging Face Llama, causal LM loss
    qwen2        tiny Hugging Face Qwen2 with tied input/output embeddings
    gpt_oss      tiny Hugging Face GPT-OSS: mixture of experts (top-2 of 4), alternating
                 sliding-window / full attention, sequence (24) longer than the window (8)
    mixtral, qwen3_moe, qwen2_moe
                 tiny Hugging Face MoE LMs; like gpt_oss, `router_aux_loss_coef > 0` adds the
                 router's load-balancing loss (HF's own `outputs.loss`)
    encoder      nn.TransformerEncoder (batch_first, dropout 0.1 on in training), causal LM
    transformer  nn.Transformer encoder-decoder (decoder blocks take `memory` as a second
                 differentiable input), sequence reversal task
    user         the user's own nn.ModuleList of identical residual MLP blocks
    scaled       the same with a layer scale of shape (1, dim) and a dropout (what bf16-mixed reads in fp32)
    lora_gpt_oss peft's LoRA on the tiny GPT-OSS's attention (experts and their biases frozen)
    user_moe     the user's own hash-routed MoE blocks, experts stacked (3-d weights) or a ModuleList;
                 expert 3 gets no token in every odd micro-batch
    linear       an embedding and one nn.Linear: no repeated blocks (for the error test)
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 96


def random_tokens(n: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """`n` random token rows of length `seq_len`, from a private generator (global RNG untouched)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, seq_len), generator=g)


class ZooModule(pl.LightningModule):
    """Shared training logic: loss from `compute_loss`, optimizer/scheduler from hyperparameters.

    Args:
        optimizer: "adamw" or "sgd" (SGD with momentum).
        lr: base learning rate.
        weight_decay: AdamW / SGD weight decay (applied to every parameter unless `param_groups`).
        momentum: SGD momentum.
        adam_eps: AdamW eps. 1e-6 rather than torch's 1e-8: elements whose gradient is at the
            rounding level (query/key weights under near-uniform attention at init) would
            otherwise turn rounding differences into lr-sized steps. With 1e-8, torch's own fused
            and foreach AdamW end 1.8e-5 apart on the Llama param-group case; with 1e-6, 2e-7.
        adam_impl: torch AdamW implementation, "fused" (the arithmetic MegaTrain's host AdamW
            uses) or "foreach" (torch's default on CPU tensors, rounds differently).
        param_groups: two AdamW/SGD param groups: weight decay on matrices (ndim >= 2), none on
            norms and biases.
        scheduler: a step-wise (`interval="step"`) LambdaLR with warm-up and decay, or none.
        warmup_steps, schedule_steps: its linear warm-up and cosine decay lengths.
        n_train, n_val: number of training / validation samples.
        batch_size, seq_len: batch shape.
        data_seed: seed of the private generator that makes the data.
    """

    def __init__(
        self,
        optimizer: str = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        momentum: float = 0.9,
        adam_eps: float = 1e-6,
        adam_impl: str = "fused",
        param_groups: bool = False,
        scheduler: bool = True,
        warmup_steps: int = 3,
        schedule_steps: int = 24,
        n_train: int = 24,
        n_val: int = 0,
        batch_size: int = 4,
        seq_len: int = 16,
        data_seed: int = 1234,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Plain attributes, not buffers: they must not show up in state_dict().
        self.train_data = self.make_data(n_train, seq_len, data_seed)
        self.val_data = self.make_data(n_val, seq_len, data_seed + 1) if n_val > 0 else None
        self.val_losses: list[float] = []

    # ---- to be provided by each model -------------------------------------------------------
    def make_data(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        return random_tokens(n, seq_len, VOCAB, seed)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    # ---- Lightning hooks --------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.compute_loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss, prog_bar=False)
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.train_data), batch_size=self.hparams.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        assert self.val_data is not None, "n_val=0: this module has no validation data"
        return DataLoader(TensorDataset(self.val_data), batch_size=self.hparams.batch_size, shuffle=False)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params: Any
        if hp.param_groups:
            decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
            no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
            params = [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ]
        else:
            params = [p for p in self.parameters() if p.requires_grad]
        if hp.optimizer == "adamw":
            # Default fused=True: MegaTrain steps Adam(W) with torch's fused arithmetic, so the
            # comparison is bitwise-close; test_harness_accepts_other_adamw_implementation checks
            # that torch's foreach AdamW (which rounds differently) passes the same tolerances.
            impl = {"foreach": {"foreach": True}, "fused": {"fused": True}}[hp.adam_impl]
            opt = torch.optim.AdamW(
                params, lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95), eps=hp.adam_eps, **impl
            )
        elif hp.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        else:
            raise ValueError(f"unknown optimizer {hp.optimizer!r}")
        if not hp.scheduler:
            return opt
        schedule = partial(warmup_decay, warmup=hp.warmup_steps, total=hp.schedule_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


def warmup_decay(step: int, warmup: int = 3, total: int = 24) -> float:
    """LR multiplier: linear warm-up over `warmup` steps, then cosine decay to 10% at `total`
    (module level, so that checkpoints can pickle the scheduler)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(step - warmup, total - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------
# Hugging Face causal LMs
# ---------------------------------------------------------------------------------------------
class HFCausalLM(ZooModule):
    """Causal LM loss of a Hugging Face `*ForCausalLM` on random tokens (labels = inputs).

    The model is called as a user would call it: `use_cache` is left at the config default (True),
    so a streaming strategy has to switch the KV cache off itself.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = self.build_model()

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (input_ids,) = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss


class TinyLlama(HFCausalLM):
    def build_model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        return LlamaForCausalLM(config)


class TinyQwen2(HFCausalLM):
    def build_model(self) -> nn.Module:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
        model = Qwen2ForCausalLM(config)
        assert model.lm_head.weight is model.model.embed_tokens.weight, "embeddings are not tied"
        return model


class HFMoE(HFCausalLM):
    """A Hugging Face mixture-of-experts causal LM. ``router_aux_loss_coef > 0`` turns the router's
    auxiliary (load-balancing) loss on: ``config.output_router_logits=True``, and HF's ``outputs.loss``
    is the LM loss plus that coefficient times the loss of the router logits its hooks recorded."""

    def __init__(self, router_aux_loss_coef: float = 0.0, experts_implementation: str = "eager", **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def router_kwargs(self) -> dict[str, Any]:
        """The router loss and the experts' implementation (transformers' `eager` loop unless one is given)."""
        coef = self.hparams.router_aux_loss_coef
        return {"output_router_logits": coef > 0, "router_aux_loss_coef": coef,
                "experts_implementation": self.hparams.experts_implementation}


class TinyGptOss(HFMoE):
    """GPT-OSS: 4 experts, top-2 routing, layers alternating sliding-window (8) / full attention,
    sequence length 24 > window, attention sinks, biases; router loss with ``router_aux_loss_coef``."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("seq_len", 24)
        super().__init__(**kwargs)

    def build_model(self) -> nn.Module:
        from transformers import GptOssConfig, GptOssForCausalLM

        config = GptOssConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=32,
            head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_implementation="eager",
            **self.router_kwargs(),
        )
        assert self.hparams.seq_len > config.sliding_window
        return GptOssForCausalLM(config)


class TinyMixtral(HFMoE):
    """Mixtral: 3 layers of 4 experts, top-2 routing (softmax before top-k), no router bias."""

    def build_model(self) -> nn.Module:
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            attn_implementation="eager",
            **self.router_kwargs(),
        )
        return MixtralForCausalLM(config)


class TinyQwen3Moe(HFMoE):
    """Qwen3-MoE: 3 layers, the middle one dense (``mlp_only_layers``), 4 experts top-2 with normalised
    top-k weights, q/k norms."""

    def build_model(self) -> nn.Module:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            max_position_embeddings=64,
            attn_implementation="eager",
            **self.router_kwargs(),
        )
        return Qwen3MoeForCausalLM(config)


class TinyQwen2Moe(HFMoE):
    """Qwen2-MoE: 2 layers of 4 experts top-2 plus a gated shared expert."""

    def build_model(self) -> nn.Module:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            attn_implementation="eager",
            **self.router_kwargs(),
        )
        return Qwen2MoeForCausalLM(config)


class LlamaLM(HFCausalLM):
    """A Llama-shaped model of any size (the GPU tests), on one of two tasks:

    task="random":  uniform random tokens over the whole vocabulary (nothing to learn; parity only)
    task="pattern": each row repeats a random pattern of `period` tokens drawn from the first
                    `alphabet` token ids; learnable twice over: the unigram statistics (loss falls
                    from ln(vocab) to ln(alphabet)) and then copying from one period back.
    """

    def __init__(
        self,
        hidden_size: int = 256,
        num_layers: int = 6,
        intermediate_size: int = 688,
        num_heads: int = 8,
        vocab_size: int = 1024,
        task: str = "random",
        period: int = 16,
        alphabet: int = 256,
        attn_implementation: str = "sdpa",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    def make_data(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        hp = self.hparams
        if hp.task == "random":
            return random_tokens(n, seq_len, hp.vocab_size, seed)
        if hp.task == "pattern":
            pattern = random_tokens(n, hp.period, min(hp.alphabet, hp.vocab_size), seed)
            reps = -(-seq_len // hp.period)
            return pattern.repeat(1, reps)[:, :seq_len].contiguous()
        raise ValueError(f"unknown task {hp.task!r}")

    def build_model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        hp = self.hparams
        config = LlamaConfig(
            vocab_size=hp.vocab_size,
            hidden_size=hp.hidden_size,
            intermediate_size=hp.intermediate_size,
            num_hidden_layers=hp.num_layers,
            num_attention_heads=hp.num_heads,
            num_key_value_heads=hp.num_heads,
            max_position_embeddings=max(2048, hp.seq_len),
            tie_word_embeddings=False,
            attn_implementation=hp.attn_implementation,
        )
        return LlamaForCausalLM(config)


# ---------------------------------------------------------------------------------------------
# torch.nn transformer modules (nn.MultiheadAttention: compare these with SGD, see the tests)
# ---------------------------------------------------------------------------------------------
class EncoderLM(ZooModule):
    """Embedding + learned positions + nn.TransformerEncoder (causal mask, dropout 0.1) + head."""

    def __init__(self, d_model: int = 32, nhead: int = 4, num_layers: int = 3, dropout: float = 0.1, **kwargs: Any) -> None:
        kwargs.setdefault("optimizer", "sgd")
        kwargs.setdefault("lr", 0.05)
        super().__init__(**kwargs)
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(self.hparams.seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=2 * d_model, dropout=dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (tokens,) = batch
        x, y = tokens[:, :-1], tokens[:, 1:]
        T = x.shape[1]
        h = self.embed(x) + self.pos[:T]
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=h.device, dtype=h.dtype)
        h = self.encoder(h, mask=mask, is_causal=True)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class Seq2SeqTransformer(ZooModule):
    """nn.Transformer encoder-decoder learning to reverse a sequence (teacher forcing, BOS = 0)."""

    def __init__(
        self, d_model: int = 32, nhead: int = 4, num_layers: int = 2, dropout: float = 0.0, **kwargs: Any
    ) -> None:
        kwargs.setdefault("optimizer", "sgd")
        kwargs.setdefault("lr", 0.05)
        kwargs.setdefault("seq_len", 12)
        super().__init__(**kwargs)
        self.src_embed = nn.Embedding(VOCAB, d_model)
        self.tgt_embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(self.hparams.seq_len, d_model) * 0.02)
        self.transformer = nn.Transformer(
            d_model,
            nhead,
            num_encoder_layers=num_layers,
            num_decoder_layers=num_layers,
            dim_feedforward=2 * d_model,
            dropout=dropout,
            batch_first=True,
        )
        self.head = nn.Linear(d_model, VOCAB)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (src,) = batch
        tgt = src.flip(1)
        tgt_in = torch.cat([torch.zeros_like(tgt[:, :1]), tgt[:, :-1]], dim=1)  # BOS-shifted
        T = src.shape[1]
        s = self.src_embed(src) + self.pos[:T]
        t = self.tgt_embed(tgt_in) + self.pos[:T]
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(T, device=s.device, dtype=s.dtype)
        h = self.transformer(s, t, tgt_mask=tgt_mask, tgt_is_causal=True)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))


# ---------------------------------------------------------------------------------------------
# A user's own blocks
# ---------------------------------------------------------------------------------------------
class ResidualMLPBlock(nn.Module):
    """x + W2 GELU(W1 LayerNorm(x))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class UserBlocks(ZooModule):
    """Embedding + nn.ModuleList of ResidualMLPBlock + LayerNorm + head, token-wise task
    (target = (7 * x + 3) mod V)."""

    def __init__(self, dim: int = 32, hidden: int = 64, num_blocks: int = 4, **kwargs: Any) -> None:
        kwargs.setdefault("lr", 3e-3)
        super().__init__(**kwargs)
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([ResidualMLPBlock(dim, hidden) for _ in range(num_blocks)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        y = (7 * x + 3) % VOCAB
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class ScaledBlock(nn.Module):
    """x + gamma * dropout(MLP(LayerNorm(x))): a layer scale of shape (1, dim), read by a ``mul`` (in fp32 under
    Lightning's bf16-mixed), and a dropout, so that the step run again must draw the masks the first attempt drew."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.gamma = nn.Parameter(0.5 + 0.1 * torch.randn(1, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class ScaledBlocks(UserBlocks):
    """UserBlocks of ScaledBlock; ``frozen_scale``: the layer scales frozen."""

    def __init__(self, frozen_scale: bool = False, dropout: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = nn.ModuleList([ScaledBlock(32, 64, dropout) for _ in range(len(self.blocks))])
        for block in self.blocks:
            block.gamma.requires_grad_(not frozen_scale)


class LoraGptOss(TinyGptOss):
    """peft's LoRA on GPT-OSS's attention: the experts, their biases among them, frozen."""

    def build_model(self) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        return get_peft_model(super().build_model(), config)


class HashMoEBlock(nn.Module):
    """x + sum_e [token routed to e] * W2_e GELU(W1_e LayerNorm(x)), each token routed to expert
    ``token_id % n_experts`` (hash routing: no learned router, so which experts a batch leaves without
    tokens is known from the data). As Hugging Face's expert loops, only experts with tokens run.

    experts="stacked": the experts' weights are 3-d parameters (as HF's ``*Experts`` modules): an expert
    without tokens gets an exactly zero slice of a gradient. experts="list": an ``nn.ModuleList`` of
    ``nn.Linear`` pairs: an expert without tokens is not in the graph, its gradients are None.
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, experts: str) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.stacked = experts == "stacked"
        self.norm = nn.LayerNorm(dim)
        if self.stacked:
            self.w1 = nn.Parameter(torch.randn(n_experts, hidden, dim) / math.sqrt(dim))
            self.w2 = nn.Parameter(torch.randn(n_experts, dim, hidden) / math.sqrt(hidden))
        else:
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(n_experts))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = torch.zeros_like(x)
        route = tokens % self.n_experts
        for e in range(self.n_experts):
            hit = route == e
            if not bool(hit.any()):
                continue  # an expert without tokens is not run (a host sync, as in HF's expert loops)
            if self.stacked:
                y = F.linear(F.gelu(F.linear(h[hit], self.w1[e])), self.w2[e])
            else:
                y = self.experts[e](h[hit])
            out = out.index_put((hit,), y)
        return x + out


class UserMoE(ZooModule):
    """Embedding + nn.ModuleList of HashMoEBlock + LayerNorm + head, token-wise task (target =
    (7 * x + 3) mod V). The data leaves expert 3 (tokens = 3 mod 4) without tokens in every odd
    micro-batch: its residue-3 tokens are moved to residue 2 there."""

    def __init__(self, experts: str = "stacked", dim: int = 16, hidden: int = 24, num_blocks: int = 3,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([HashMoEBlock(dim, hidden, 4, experts) for _ in range(num_blocks)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def make_data(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        tokens = random_tokens(n, seq_len, VOCAB, seed)
        b = self.hparams.batch_size
        for start in range(b, n, 2 * b):  # odd micro-batches: no token for expert 3
            rows = tokens[start : start + b]
            rows[rows % 4 == 3] -= 1
        return tokens

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        y = (7 * x + 3) % VOCAB
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, x)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class LinearOnly(ZooModule):
    """An embedding and one nn.Linear: no repeated blocks, nothing a streaming strategy could stream."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        return F.cross_entropy(self.head(self.embed(x)).reshape(-1, VOCAB), x.reshape(-1))


ZOO: dict[str, Callable[..., ZooModule]] = {
    "llama": TinyLlama,
    "qwen2": TinyQwen2,
    "gpt_oss": TinyGptOss,
    "mixtral": TinyMixtral,
    "qwen3_moe": TinyQwen3Moe,
    "qwen2_moe": TinyQwen2Moe,
    "encoder": EncoderLM,
    "transformer": Seq2SeqTransformer,
    "user": UserBlocks,
    "user_moe": UserMoE,
    "linear": LinearOnly,
}
