"""`experts_implementation="grouped_mm_gather"` (models/expert_routing.py, issue 18): transformers' grouped_mm
experts with a backward made of gathers and GEMMs.

* The same outputs and gradients as transformers' own `grouped_mm` and `eager` experts on tiny Mixtral,
  Qwen3-MoE, Qwen2-MoE and GPT-OSS (biases, interleaved and transposed expert weights), fp32 on the CPU.
* Its backward runs no `index_put` (the op whose CUDA kernel took 23 % of a GPT-OSS step); `grouped_mm`'s does.
* It trains under the strategy as under Lightning's default strategy, router loss included.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import fit, megatrain, rel_diff, run_parity
from megatrain_lightning.models import expert_routing
from zoo import ZOO

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MOES = ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"]
GATHER = expert_routing.NAME


def model_of(name: str, experts: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = ZOO[name](experts_implementation=experts, router_aux_loss_coef=0.5).build_model()
    assert model.config._experts_implementation == experts  # transformers took it (no fallback to eager)
    return model


class _Ops(TorchDispatchMode):
    """The names of the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def forward_backward(model: torch.nn.Module, ops: _Ops | None = None):
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (3, 24))
    out = model(input_ids=ids, labels=ids)
    loss = out.loss
    if ops is None:
        loss.backward()
    else:
        with ops:
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), loss.detach(), grads


@pytest.mark.parametrize("name", MOES)
def test_same_outputs_and_gradients_as_transformers_experts(name: str) -> None:
    ref_logits, ref_loss, ref_grads = forward_backward(model_of(name, "grouped_mm"))
    eager_logits, _, eager_grads = forward_backward(model_of(name, "eager"))
    logits, loss, grads = forward_backward(model_of(name, GATHER))
    assert torch.equal(logits, ref_logits), "the forward is transformers' grouped_mm, value for value"
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() == eager_grads.keys()
    experts = [k for k in grads if ".experts." in k]
    assert experts and (name != "gpt_oss" or any(k.endswith("_bias") for k in experts))
    for k in grads:
        assert rel_diff(ref_grads[k], grads[k]) < 1e-6, k
        assert rel_diff(eager_grads[k], grads[k]) < 1e-5, k
    assert rel_diff(eager_logits, logits) < 1e-5


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_backward_runs_no_index_put(name: str) -> None:
    seen = {}
    for experts in ("grouped_mm", GATHER):
        ops = _Ops()
        forward_backward(model_of(name, experts), ops)
        seen[experts] = {n for n in ops.names if "index_put" in n}
    assert seen["grouped_mm"], "transformers' grouped_mm backward scatters with index_put (the test can fail)"
    assert not seen[GATHER], seen[GATHER]


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("option", [{}, {"keep_activations": 2, "kept_saves": "matmuls"}], ids=["streamed", "kept-matmuls"])
def test_trains_as_under_the_default_strategy(name: str, option: dict) -> None:
    run_parity(partial(ZOO[name], optimizer="adamw", lr=3e-3, scheduler=True, router_aux_loss_coef=0.5,
                       experts_implementation=GATHER), megatrain(**option))


def test_expert_parallel_is_refused() -> None:
    model = model_of("qwen3_moe", GATHER)
    experts = model.model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="grouped_mm_gather.*expert parallelism"):
        forward_backward(model)


def test_the_strategy_names_grouped_mm_gather_for_a_module_on_grouped_mm() -> None:
    """A user's own module on transformers' default experts gets one line naming the faster backward; a module
    already on it, or a dense one, gets none."""
    from megatrain_lightning.setup_checks import experts_hint

    hint = experts_hint(ZOO["gpt_oss"](experts_implementation="grouped_mm"))
    assert hint is not None and "GptOssForCausalLM" in hint and "set_experts_implementation('grouped_mm_gather')" in hint
    assert experts_hint(ZOO["gpt_oss"](experts_implementation=GATHER)) is None
    assert experts_hint(ZOO["llama"]()) is None


def test_grouped_mm_bias_experts_and_kept_matmul_outputs_refused_or_kept_whole() -> None:
    """transformers' grouped_mm adds GPT-OSS's expert biases into the matmul outputs in place, which torch's
    selective recompute refuses at the first backward: asked for, kept_saves='matmuls' is refused at setup with
    the module and the fix; left to the strategy, kept blocks keep everything (and train exactly)."""
    from megatrain_lightning.errors import ConfigError
    from megatrain_lightning.setup_checks import in_place_expert_bias

    factory = partial(ZOO["gpt_oss"], optimizer="adamw", lr=3e-3, experts_implementation="grouped_mm")
    assert in_place_expert_bias(factory()) == "GptOssExperts"
    assert in_place_expert_bias(ZOO["gpt_oss"](experts_implementation=GATHER)) is None
    assert in_place_expert_bias(ZOO["qwen3_moe"](experts_implementation="grouped_mm")) is None  # no biases
    with pytest.raises(ConfigError, match="GptOssExperts.*grouped_mm_gather.*kept_saves='all'"):
        fit(factory, megatrain(keep_activations=2, kept_saves="matmuls"), max_steps=1)
    _, got = run_parity(factory, megatrain(keep_activations=2))
    assert got.trainer.strategy.config.kept_saves == "all"


class _Outputs(TorchDispatchMode):
    """(dtype, shape) of every tensor the aten ops dispatched while active return."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves(out)
        self.made += [(t.dtype, tuple(t.shape)) for t in leaves if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_fp32_tokens_into_bf16_experts_repeat_in_bf16(name: str) -> None:
    """Under autocast the strategy hands bf16 experts an fp32 residual stream: the k-fold rows are made in bf16
    (the grouped GEMM's own cast, made before the repeat), with transformers' values in the forward and in every
    gradient, and no fp32 tensor of (token, expert) rows x hidden in the forward or the backward."""
    torch.manual_seed(2)
    tokens = 40
    results, made = {}, {}
    for experts in ("grouped_mm", GATHER):
        module = model_of(name, experts).model.layers[0].mlp.experts.to(torch.bfloat16)
        k, hidden = module.config.num_experts_per_tok, module.config.hidden_size
        torch.manual_seed(3)
        x = torch.randn(tokens, hidden, requires_grad=True)
        index = torch.stack([torch.randperm(module.num_experts)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k).softmax(-1).to(torch.bfloat16).requires_grad_()
        seen = _Outputs()
        with seen:
            out = module(x, index, weights)
            (out.float() * torch.linspace(-1, 1, hidden)).sum().backward()
        results[experts] = (out.detach(), x.grad, weights.grad, {n: p.grad for n, p in module.named_parameters()})
        made[experts] = [s for dtype, s in seen.made if dtype == torch.float32 and s == (tokens * k, hidden)]
    ref, got = results["grouped_mm"], results[GATHER]
    assert torch.equal(ref[0], got[0]), "the forward is transformers' value for value"
    assert rel_diff(ref[1], got[1]) < 1e-6 and torch.equal(ref[2], got[2])
    for n, g in ref[3].items():
        if n.endswith("_bias"):  # transformers accumulates the bias rows in bf16 (index_put); ours in an fp32 GEMM
            assert rel_diff(g, got[3][n]) < 2e-2, n
        else:
            assert torch.equal(g, got[3][n]), n
    assert made["grouped_mm"], "transformers repeats the fp32 rows (the test can fail)"
    assert not made[GATHER], made[GATHER]
