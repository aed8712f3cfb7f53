"""CausalLM: the loss it trains on, the answers it decodes, the FLOPs it claims, how it is built."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from megatrain_lightning import cli
from megatrain_lightning.data import ByteTokenizer
from megatrain_lightning.data.sft_batch import IGNORE_INDEX
from megatrain_lightning.errors import ConfigError
from megatrain_lightning.models import CausalLM, ModelShape
from megatrain_lightning.models.build import hf_config, meta_model
from megatrain_lightning.models.demo_checkpoint import write_demo_checkpoint
from megatrain_lightning.models.lr_schedule import WarmupCosine

CONF = Path(__file__).resolve().parent.parent / "conf"
TINY = dict(
    model_type="llama", vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    pad_token_id=256, bos_token_id=257, eos_token_id=258,
)


def built(**kwargs) -> CausalLM:
    torch.manual_seed(0)
    module = CausalLM(name="t", config=TINY, **kwargs)
    module.configure_model()
    return module


def test_loss_is_next_token_cross_entropy_over_labelled_tokens_only() -> None:
    module = built()
    ids = torch.randint(0, 256, (3, 12))
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt
    labels[2, 9:] = IGNORE_INDEX  # padding
    ours = module.causal_lm_loss(ids, labels)
    theirs = module.model(input_ids=ids, labels=labels).loss  # Hugging Face's own shifted loss
    torch.testing.assert_close(ours, theirs)
    changed = ids.clone()
    changed[:, :4] = (changed[:, :4] + 1) % 256  # prompt tokens change the context, not the targets
    assert not torch.isclose(module.causal_lm_loss(changed, labels), ours)


def test_chunked_loss_matches_one_pass_in_value_and_gradient() -> None:
    ids = torch.randint(0, 256, (2, 16))
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    one, chunked = built(), built(loss_chunk_tokens=7)
    a, b = one.causal_lm_loss(ids, labels), chunked.causal_lm_loss(ids, labels)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b)
    for (name, p), q in zip(one.model.named_parameters(), chunked.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_batched_greedy_decoding_with_left_padding_equals_one_by_one() -> None:
    module = built()
    module.eval()
    prompts = [[257, 49, 43, 50, 61], [257, 49, 48, 43, 50, 48, 61], [257, 55, 61]]
    width = max(map(len, prompts))
    ids = torch.tensor([[256] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    together = module.greedy_decode(ids, mask, new_tokens=5)
    for i, p in enumerate(prompts):
        alone = module.greedy_decode(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), new_tokens=5)
        assert together[i].tolist() == alone[0].tolist()


def test_exact_match_compares_final_answers_up_to_the_stop() -> None:
    module = built()
    target = torch.tensor([[50, 258, IGNORE_INDEX, IGNORE_INDEX]] + [[50, 48, 258, IGNORE_INDEX]] * 3)  # "2", "20" x 3
    preds = torch.tensor([
        [50, 258, 55, 55],  # "2", then the stop: what follows it is not read
        [50, 48, 49, 258],  # "201": no stop after the answer, a digit too many
        [50, 49, 258, 258],  # "21": a wrong digit
        [61, 32, 50, 48],  # "= 20": the same final number, worded differently
    ])
    assert module.answers_match(preds, target).tolist() == [1.0, 0.0, 0.0, 1.0]
    module.exact_match.update(module.answers_match(preds, target))
    assert float(module.exact_match.compute()) == pytest.approx(0.5)


def test_flops_per_token_follows_the_formula() -> None:
    module = CausalLM(name="t", config=TINY)
    s = module.model_shape
    embed = 259 * 32
    per_layer = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * 32 * 64 + 2 * 32  # q, k+v (2 kv heads), o, mlp, norms
    assert s.total_params == embed + 2 * per_layer + 32
    assert s.active_params == s.total_params  # tied: the embedding counts once, as the LM head
    assert s.flops_per_token(10) == 6 * s.active_params + 12 * 2 * 4 * 8 * 10
    assert s.hardware_flops_per_token(10) == 8 * s.active_params + 16 * 2 * 4 * 8 * 10
    untied = ModelShape.of(meta_model(hf_config({**TINY, "tie_word_embeddings": False})))
    assert untied.active_params == untied.total_params - embed


def test_mixture_of_experts_counts_only_active_experts() -> None:
    cfg = dict(
        model_type="gpt_oss", vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
    )
    model = meta_model(hf_config(cfg), "eager")
    s = ModelShape.of(model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts > 0
    assert s.active_params == pytest.approx(s.total_params - 300 * 64 - experts + experts * 2 / 8, abs=2)


def test_random_init_is_built_once_on_meta_then_initialised_like_from_config() -> None:
    from transformers import AutoModelForCausalLM

    module = built()
    assert all(p.device.type == "cpu" for p in module.model.parameters())
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight  # re-tied
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(hf_config(TINY))
    for (name, b), rb in zip(module.model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb, msg=name)  # rotary inv_freq recomputed, not garbage
    for (name, p), rp in zip(module.model.named_parameters(), ref.parameters()):
        assert math.isclose(float(p.detach().std()), float(rp.detach().std()), rel_tol=0.3, abs_tol=1e-6), name


def test_schedule_warms_up_then_decays_per_step() -> None:
    module = built(lr=1.0, warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert isinstance(opt, torch.optim.AdamW) and conf["lr_scheduler"]["interval"] == "step"
    lrs = []
    for _ in range(16):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[9] == pytest.approx(0.55) and lrs[14:] == pytest.approx([0.1, 0.1])
    assert WarmupCosine(0, None, 0.1)(1000) == 1.0
    assert isinstance(built().configure_optimizers(), torch.optim.AdamW)  # no schedule asked, none made


def test_pretrained_checkpoint_loads_weights_and_its_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_demo_checkpoint(tmp_path / "ckpt")
    module = CausalLM(name="p", config=TINY, pretrained=str(path))  # pretrained wins over config
    assert not isinstance(module.tokenizer, ByteTokenizer)  # the checkpoint's own, via AutoTokenizer
    assert module.tokenizer.eos_token_id == 258 and module.tokenizer.decode(module.tokenizer.encode("1+2=3")) == "1+2=3"
    module.configure_model()
    ref = AutoModelForCausalLM.from_pretrained(path)
    for (name, p), rp in zip(module.model.named_parameters(), ref.parameters()):
        assert torch.equal(p, rp), name
    assert module.model_shape.total_params == sum(p.numel() for p in ref.parameters())


def test_a_checkpoint_directory_without_weights_is_refused_by_name(tmp_path: Path) -> None:
    """config.json without weight files: refused at construction, naming the directory and the fix (it failed in
    transformers' loader once validation had started: 2026-12-05's sweep); the planner reads the config alone."""
    import shutil

    from megatrain_lightning.errors import ConfigError
    from megatrain_lightning.models.build import pretrained_config

    path = write_demo_checkpoint(tmp_path / "ckpt")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(path / "config.json", bare / "config.json")
    with pytest.raises(ConfigError, match=re.escape(f"model.pretrained={bare} has a config.json but no weights")):
        CausalLM(name="p", pretrained=str(bare))
    assert pretrained_config(str(bare), weights=False).vocab_size == pretrained_config(str(path)).vocab_size


def test_finetune_experiment_on_local_checkpoint_and_jsonl(tmp_path: Path) -> None:
    ckpt = write_demo_checkpoint(tmp_path / "ckpt")
    rows = [{"query": f"{a}+{b}=", "response": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "experiment=finetune_jsonl", f"model.pretrained={ckpt}", f"data.path={tmp_path / 'train.jsonl'}",
                "hardware=cpu", "data.val_size=8", "data.prompt_template='{query}'", "trainer.max_steps=3",
                f"paths.output_dir={tmp_path / 'out'}",
            ],
            return_hydra_config=True,
        )
    metrics = cli.train(cfg)
    assert metrics["model"] == "pretrained" and metrics["strategy"] == "megatrain" and metrics["steps"] == 3
    assert metrics["exact_match"] is not None and metrics["micro_batch"] == 8
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["steps"] == 3


def test_finetune_on_packed_chat_data_exports_a_model_with_its_chat_template(tmp_path: Path) -> None:
    """The practitioner's path: an instruct-style checkpoint (ChatML template), multi-turn OpenAI-format data,
    packing, validation by exact match; the export loads with its tokenizer and template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = write_demo_checkpoint(tmp_path / "ckpt", chat=True)
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)},
                          {"role": "user", "content": "and doubled?"}, {"role": "assistant", "content": str(2 * (a + b))}]}
            for a in range(10) for b in range(10)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True, overrides=[
            "experiment=finetune_jsonl", f"model.pretrained={ckpt}", f"data.path={tmp_path / 'chat.jsonl'}",
            "hardware=cpu", "data.val_size=8", "data.packing=true", "data.max_length=128", "data.batch_size=4",
            "trainer.max_steps=3", f"paths.output_dir={tmp_path / 'out'}"])
    metrics = cli.train(cfg)
    assert metrics["steps"] == 3 and metrics["exact_match"] is not None and metrics["val_loss"] > 0
    assert metrics["seq_len"] <= 128 and metrics["micro_batch"] == 4
    tok = AutoTokenizer.from_pretrained(tmp_path / "out" / "hf")
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf").config.vocab_size == len(tok)


def test_configs_transformers_refuses_are_one_line_naming_the_key() -> None:
    """A misspelt model type gets the nearest one; a config its class validates away (heads not dividing the
    width) gets transformers' own reason in one line (both were Hydra-wrapped tracebacks)."""
    from megatrain_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape("model.config.model_type='lama' is not a transformers model type "
                                                    "(did you mean llama?)")):
        hf_config({**TINY, "model_type": "lama"})
    with pytest.raises(ConfigError, match=r"^model.config \(llama\) is refused by transformers: .*hidden size \(32\) "
                                          r"is not a multiple of the number of attention heads \(5\)"):
        hf_config({**TINY, "num_attention_heads": 5})


@pytest.mark.parametrize("override, named", [
    ({"lr": -1.0}, "model.lr=-1.0: a positive learning rate"),
    ({"lr": float("nan")}, "model.lr=nan"),
    ({"betas": (0.9, 1.5)}, "model.betas=[0.9, 1.5]: two numbers in [0, 1)"),
    ({"weight_decay": -0.1}, "model.weight_decay=-0.1: zero or more"),
    ({"min_lr_ratio": 2.0}, "model.min_lr_ratio=2.0"),
    ({"config": {**TINY, "num_hidden_layers": 0}}, "model.config.num_hidden_layers=0: the model needs at least one block"),
])
def test_settings_torch_would_refuse_later_are_refused_by_key(override: dict, named: str) -> None:
    """A bad optimizer setting or a model without blocks is refused at construction, naming the key (they ended
    in tracebacks from torch's AdamW and the block finder once the run had started: 2026-12-05's sweep)."""
    from megatrain_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(named)):
        CausalLM(**{"config": TINY, **override})


def test_a_model_config_key_nothing_reads_is_refused_with_the_likely_key() -> None:
    """AutoConfig keeps any key as an attribute: ``num_hidden_layer=2`` built the default 32 layers (found
    2026-12-07). A key neither the config class takes nor the model's code (or what every model inherits) reads is
    refused, naming the close key; keys the model's code reads though its config class does not take them (Qwen3-MoE's
    head_dim) and keys the shared model code reads (gradient_checkpointing) are kept."""
    with pytest.raises(ConfigError, match=re.escape("neither transformers' LlamaConfig nor the llama model reads: "
                                                    "num_hidden_layer (did you mean num_hidden_layers?)")):
        hf_config({**TINY, "num_hidden_layer": 1})
    with pytest.raises(ConfigError, match=re.escape("reads: layers. They would be kept and ignored")):
        hf_config({**TINY, "layers": 1})
    assert hf_config({"model_type": "qwen3_moe", "head_dim": 8}).head_dim == 8
    assert hf_config({**TINY, "gradient_checkpointing": False}).num_hidden_layers == TINY["num_hidden_layers"]
    assert hf_config({**TINY, "rope_theta": 5e5}).rope_parameters["rope_theta"] == 5e5  # taken into rope_parameters
