"""A LightningModule around any Hugging Face causal LM: the model every config in conf/model/ builds.

Training is causal-LM cross-entropy over the tokens whose label is not -100 (answers, not prompts
or padding); packed rows come with `position_ids` that restart per sample, from which block-diagonal
masks confine attention to each sample (`packed_inputs`). Validation logs the loss on the held-out samples (`val/loss`) and greedily decodes each
held-out question's answer, scoring exact match on the final answer (`val/exact_match`, see
`data/answers.py`: MetaMathQA's "The answer is:", GSM8K's "####", else the last number). The network itself is created in `configure_model`, inside the strategy's
init context, so a strategy decides where its weights live; the constructor only builds a meta-device
copy to count parameters (which the fit check and the TFLOPS figure need before any allocation).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from typing_extensions import override

from megatrain_lightning.data.answers import same_answer
from megatrain_lightning.data.sft_batch import IGNORE_INDEX
from megatrain_lightning.errors import ConfigError
from megatrain_lightning.models.build import (
    hf_config, load_pretrained, materialize, meta_model, pretrained_config, route_experts,
)
from megatrain_lightning.models.chunked_mlp import chunk_mlp
from megatrain_lightning.models.head_loss import chunked_head_loss
from megatrain_lightning.models.lr_schedule import WarmupCosine
from megatrain_lightning.models import sink_attention
from megatrain_lightning.models.model_shape import ModelShape
from megatrain_lightning.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def packed_inputs(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                  position_ids: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """Model kwargs (and labels) that keep each sample of packed rows to itself.

    `position_ids` restart at 0 for each sample. Flash-attention (varlen) takes the rows as one row whose
    position ids restart per sample, and derives the sample boundaries itself. Every other kernel gets
    the block-diagonal causal masks built by transformers' own mask functions (from the same position
    ids: SDPA a [B, 1, T, T] bool mask, eager a float one, flex a BlockMask), and the sliding-window one
    as well where the model has sliding layers; they cost B x T x T elements each, and SDPA runs its
    masked kernel instead of the plain causal one. Models that build one mask per layer type (`layer_types`
    in the config: Qwen2/3, GPT-OSS) take them as a mapping, the others (Llama, Mistral) as one tensor.
    Labels: the flattened row's are the same set of targets (each sample's first label is already -100).
    """
    config = model.config
    impl = str(getattr(config, "_attn_implementation", "") or "")
    if impl.startswith("flash_attention"):
        return {"input_ids": input_ids.reshape(1, -1), "position_ids": position_ids.reshape(1, -1)}, labels.reshape(1, -1)
    try:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    except ImportError:
        import transformers

        raise ConfigError(f"data.packing=true needs transformers >= 4.56 (masks from position ids); this is "
                          f"{transformers.__version__}: upgrade it or set data.packing=false") from None
    dtype = model.get_input_embeddings().weight.dtype  # what transformers derives an eager mask's fill from
    shape_only = torch.empty((*input_ids.shape, 0), dtype=dtype, device=input_ids.device)  # [B, T, 0]
    # (config, inputs_embeds, attention_mask, cache) by position: transformers 5 renamed the last one
    # (`past_key_values` in 5.17-5.20, `cache` by 5.25)
    args = (config, shape_only, None, None)
    full = create_causal_mask(*args, position_ids=position_ids)
    sliding = (create_sliding_window_causal_mask(*args, position_ids=position_ids)
               if getattr(config, "sliding_window", None) else None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        mask: Any = {t: sliding if t == "sliding_attention" else full for t in set(layer_types)}
    else:
        mask = sliding if sliding is not None else full
    return {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": mask}, labels


class CausalLM(pl.LightningModule):
    """Hugging Face causal LM trained with AdamW, validated by exact match of greedy answers.

    Args:
        name: a label for logs and sweep tables (e.g. `qwen2_5_7b`).
        config: transformers config as a dict with `model_type`; random init. Ignored when
            `pretrained` is set.
        pretrained: local Hugging Face checkpoint directory (weights + tokenizer); no downloads.
            Under MegaTrainStrategy its safetensors are read block by block straight into the host
            store (peak: the store plus about one block); elsewhere through `from_pretrained`.
        lr: peak AdamW learning rate.
        betas: AdamW moment decay rates.
        weight_decay: AdamW decoupled weight decay, applied to matrices only (not norms/biases).
        warmup_steps: linear warmup length in optimizer steps.
        decay_steps: cosine decay ends here (usually `trainer.max_steps`); None keeps the rate constant.
        min_lr_ratio: final learning rate as a fraction of `lr`.
        loss_chunk_tokens: compute the LM head and loss this many tokens at a time, each chunk's
            gradients taken right after its forward (`models/head_loss.py`), so that `[tokens, vocab]`
            logits never exist at once (with a 150 K vocabulary they are the largest activation).
            None: one pass, simplest when the logits fit. Chunks apply the plain
            output embedding, right for every family configured here (Llama, Qwen, Mistral,
            GPT-OSS), not for models that rescale logits after it (Gemma's soft-capping).
        attn_implementation: transformers attention backend (`sdpa`, `eager`, `flash_attention_2`);
            None lets the model pick (GPT-OSS needs `eager` for its attention sinks).
        experts_implementation: how mixture-of-experts layers run (transformers' `eager`, `grouped_mm`,
            `batched_mm`, ...); None: `grouped_mm_gather` (transformers' grouped_mm with a backward of gathers
            and GEMMs, `models/expert_routing.py`). Dense models ignore it.
        mlp_chunk_tokens: run each decoder layer's MLP over chunks of this many tokens, each chunk's
            intermediate activations freed before the next (`models/chunked_mlp.py`): a layer's working
            set then stops growing with 8-12 x intermediate bytes per token (at 7B and 256 K tokens, ~60 GB
            less), for one more MLP forward per backward. Exact. None: the MLP runs as it is.
    """

    # configure_model builds on the meta device under every strategy (materialised at once where the strategy
    # gives a real device), so MegaTrainStrategy's block-by-block init draws what the default strategy's does
    meta_init_matches_eager = True
    # what training_step and validation_step log (train.py checks a checkpoint's monitor against them)
    logged_metrics = ("loss", "val/loss", "val/exact_match")

    def __init__(
        self,
        name: str = "custom",
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        loss_chunk_tokens: int | None = None,
        attn_implementation: str | None = "sdpa",
        mlp_chunk_tokens: int | None = None,
        experts_implementation: str | None = None,
    ) -> None:
        super().__init__()
        if config is None and pretrained is None:
            raise ConfigError("set model.config (random init) or model.pretrained=/path/to/hf_checkpoint")
        if config is not None and pretrained is not None:
            log.info("model.pretrained=%s is set: model.config is ignored", pretrained)
        _check_optimizer_settings(lr, betas, weight_decay, warmup_steps, min_lr_ratio)
        self.save_hyperparameters()
        self.hf_config = pretrained_config(pretrained) if pretrained else hf_config(dict(config))
        layers = getattr(self.hf_config.get_text_config(), "num_hidden_layers", None)
        if isinstance(layers, int) and layers < 1:
            raise ConfigError(f"model.config.num_hidden_layers={layers}: the model needs at least one block to "
                              "train (the strategy streams its blocks), e.g. model.config.num_hidden_layers=2")
        self.hf_config.use_cache = False  # no KV cache: training recomputes, and decoding here is cache-free
        self.tokenizer = load_tokenizer(pretrained)
        vocab = self.hf_config.get_text_config().vocab_size
        if len(self.tokenizer) > vocab:
            raise ConfigError(f"tokenizer has {len(self.tokenizer)} tokens but model vocab_size={vocab}")
        meta = route_experts(meta_model(self.hf_config, self._attn_impl()), experts_implementation)
        self.model_shape = ModelShape.of(meta)
        # Kept outside the module tree (a meta tensor there would confuse device moves) and reused
        # by configure_model, so a random-init model is constructed exactly once.
        self.__dict__["_meta_model"] = meta
        self.model: torch.nn.Module | None = None
        self.exact_match = MeanMetric()  # of 0/1 per held-out sample

    def _attn_impl(self) -> str | None:
        impl = self.hparams.attn_implementation
        if impl == "sdpa" and self.hf_config.model_type == "gpt_oss":
            # transformers' SDPA has no attention sinks (it refuses GPT-OSS): the same function through SDPA's
            # fused kernels (models/sink_attention.py), exactly eager attention's softmax with the sinks
            return sink_attention.NAME
        return impl

    @override
    def configure_model(self) -> None:
        if self.model is not None:  # validate-then-fit calls this hook twice
            return
        if self.hparams.pretrained:
            model = route_experts(load_pretrained(self.hparams.pretrained, self._attn_impl()),
                                  self.hparams.experts_implementation)
            model.train()  # from_pretrained returns eval mode; Lightning keeps whatever mode it finds
        else:
            meta = self.__dict__.pop("_meta_model", None)
            if meta is None or torch.get_default_dtype() != torch.float32:
                meta = route_experts(meta_model(self.hf_config, self._attn_impl()),  # under the precision's dtype
                                     self.hparams.experts_implementation)
            device = torch.get_default_device()  # the strategy's init device (meta: it materialises later)
            model = meta if device.type == "meta" else materialize(meta, device)
        model.config.use_cache = False
        if self.hparams.mlp_chunk_tokens is not None:
            chunk_mlp(model, self.hparams.mlp_chunk_tokens)
        self.model = model

    @override
    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        return self.model(input_ids=input_ids, **kwargs)

    def causal_lm_loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy of each next token whose label is not -100.

        `position_ids` (packed rows): restarting at 0 for each sample, they confine attention to each
        sample (`packed_inputs`).
        """
        # Rows are right-padded: under the causal mask no real token sees a pad, so no attention mask
        # is passed (and SDPA keeps its causal fast path); pads and prompts are out of the loss via labels.
        kwargs: dict[str, Any] = {"input_ids": input_ids}
        if position_ids is not None:
            kwargs, labels = packed_inputs(self.model, input_ids, labels, position_ids)
        targets = labels[:, 1:].reshape(-1)  # [B*(T-1)]: position t predicts token t+1
        chunk = self.hparams.loss_chunk_tokens
        if chunk is None or targets.numel() <= chunk:
            logits = self.model(**kwargs).logits  # [B, T, V]
            return F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets, ignore_index=IGNORE_INDEX
            )
        hidden = self.model.get_decoder()(**kwargs).last_hidden_state[:, :-1]  # [B, T-1, D]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        total = chunked_head_loss(self.model.get_output_embeddings(), hidden, targets, chunk)
        return total / (targets != IGNORE_INDEX).sum().clamp(min=1)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.causal_lm_loss(batch["input_ids"], batch["labels"], batch.get("position_ids"))
        self.log("loss", loss, prog_bar=True)
        return loss

    @torch.no_grad()
    def greedy_decode(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, new_tokens: int,
                      stop_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Up to `new_tokens` greedy continuations of left-padded prompts: [batch, <= new_tokens].

        With `stop_ids`, decoding ends early once every row has produced one of them (a host sync per
        token; what follows a row's stop is left as generated). No KV cache: every step re-runs the whole
        (short) sequence. Quadratic in the answer length, and fine for validation answers of a few dozen
        tokens; it also means no cache state for a streaming strategy to manage.
        """
        ids, mask = prompt_ids, prompt_mask
        padded = not bool(mask.all())  # a host sync, once per batch: lets unpadded batches skip the mask
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        out = []
        for _ in range(new_tokens):
            kwargs: dict[str, Any] = {}
            if padded:
                kwargs = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
            logits = self.model(input_ids=ids, logits_to_keep=1, **kwargs).logits[:, -1]  # [B, V]
            nxt = logits.argmax(-1)
            out.append(nxt)
            if stop_ids is not None:
                done |= torch.isin(nxt, stop_ids)
                if bool(done.all()):  # host sync: once per generated token
                    break
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], dim=1)
        return torch.stack(out, dim=1)

    def answers_match(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per row, whether the decoded prediction (up to its first stop token) has the target's final answer.

        The stop tokens are `<eos>` and the last token of each target (the chat template's end-of-turn).
        """
        stops = {int(self.tokenizer.eos_token_id)}
        refs = []
        for row in target.tolist():
            row = [t for t in row if t != IGNORE_INDEX]
            stops.add(row[-1])
            refs.append(row)
        hits = []
        for pred, ref in zip(preds.tolist(), refs):
            cut = next((i for i, t in enumerate(pred) if t in stops), len(pred))
            text = self.tokenizer.decode(pred[:cut], skip_special_tokens=True)
            hits.append(same_answer(text, self.tokenizer.decode(ref, skip_special_tokens=True)))
        return torch.tensor(hits, dtype=torch.float32)

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        target = batch["target_ids"]  # [B, A]: answer + <eos> (or end-of-turn), -100 past its end
        rows = target.shape[0]
        if "labels" in batch:
            loss = self.causal_lm_loss(batch["input_ids"], batch["labels"])
            self.log("val/loss", loss, prog_bar=False, batch_size=rows)
        last = (target != IGNORE_INDEX).sum(1) - 1
        stop_ids = torch.unique(torch.cat([target[torch.arange(rows), last],
                                           torch.tensor([self.tokenizer.eos_token_id], device=target.device)]))
        preds = self.greedy_decode(batch["prompt_ids"], batch["prompt_mask"], target.shape[1], stop_ids)
        self.exact_match.update(self.answers_match(preds, target).to(self.exact_match.device))
        self.log("val/exact_match", self.exact_match, prog_bar=True, batch_size=rows)

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        if hp.weight_decay > 0:  # decay matrices only: decaying norm gains and biases only hurts
            groups: Any = [
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": hp.weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ]
        else:
            groups = params
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        if hp.warmup_steps == 0 and hp.decay_steps is None:
            return optimizer
        schedule = WarmupCosine(hp.warmup_steps, hp.decay_steps, hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _check_optimizer_settings(lr: float, betas: Any, weight_decay: float, warmup_steps: int,
                              min_lr_ratio: float) -> None:
    """Refuse, naming the key, AdamW settings that torch refuses only later with a traceback (after the data
    is read) and a final learning-rate share outside [0, 1] (the schedule would end above model.lr)."""
    problems = []
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        problems.append(f"model.lr={lr}: a positive learning rate, e.g. model.lr=3e-4")
    if not (len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        problems.append(f"model.betas={list(betas)}: two numbers in [0, 1), e.g. model.betas=[0.9,0.95]")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        problems.append(f"model.weight_decay={weight_decay}: zero or more, e.g. model.weight_decay=0.1")
    if warmup_steps < 0:
        problems.append(f"model.warmup_steps={warmup_steps}: zero or more")
    if not 0 <= min_lr_ratio <= 1:
        problems.append(f"model.min_lr_ratio={min_lr_ratio}: the final learning rate's share of model.lr, in [0, 1]")
    if problems:
        raise ConfigError("; ".join(problems))
