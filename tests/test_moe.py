"""Mixture-of-experts models under MegaTrainStrategy (issue 18), CPU fp32 parity with Lightning's default
strategy through the public API:

* router auxiliary losses (``output_router_logits=True``, ``router_aux_loss_coef > 0``, the loss being HF's
  own ``outputs.loss``) on tiny Mixtral, Qwen3-MoE, Qwen2-MoE and GPT-OSS: the router logits recorded inside
  a streamed block get their gradient (``engine/side_outputs.py``), recomputed, kept, kept saving matmuls
  only, offloaded; with accumulation, clipping and validation; other recorded outputs (attentions) too;
* experts that get no tokens in a step: with 3-d expert weights (every HF MoE) their slice of the gradient
  is exactly zero, and AdamW decays their moments and weights; with a ``ModuleList`` of experts their
  gradients are None, and AdamW leaves them alone: the strategy does what the default strategy does.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from conftest import fit, megatrain, rel_diff, run_parity
from megatrain_lightning.engine import side_outputs
from zoo import ZOO, TinyGptOss, TinyMixtral

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

COEF = 0.5  # large, so that the router loss moves the routers well beyond the tolerances
ROUTERS = {"mixtral": "mlp.gate.weight", "qwen3_moe": "mlp.gate.weight", "qwen2_moe": "mlp.gate.weight",
           "gpt_oss": "mlp.router.weight"}


def moe(name: str, coef: float = COEF, **kwargs: Any) -> Any:
    return partial(ZOO[name], optimizer="adamw", lr=3e-3, scheduler=True, router_aux_loss_coef=coef, **kwargs)


# ---------------------------------------------------------------------------------------------
# router auxiliary losses
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_router_loss_parity(name: str) -> None:
    """HF's ``outputs.loss`` with the load-balancing loss trains as under the default strategy; the routers
    end far from where the same run without the router loss leaves them (the parity is not vacuous)."""
    ref, got = run_parity(moe(name))
    without = fit(moe(name, coef=0.0))
    routers = [k for k in ref.state if k.endswith(ROUTERS[name])]
    assert routers
    assert all(rel_diff(ref.state[k], without.state[k]) > 1e-3 for k in routers)


# Qwen3-MoE's middle layer is dense (records nothing): kept and recomputed blocks with and without records.
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("option", [
    {"keep_activations": 2},
    {"keep_activations": 2, "kept_saves": "matmuls"},
    {"offload_inputs": True},
], ids=["kept", "kept-matmuls", "offload"])
def test_router_loss_parity_kept_and_offloaded(name: str, option: dict[str, Any]) -> None:
    run_parity(moe(name), megatrain(**option))


def test_router_loss_with_accumulation_clipping_and_validation() -> None:
    """Two micro-batches per step, clipping (the step after the backward), a validation pass (no grad:
    the blocks record straight into the collector) between steps."""
    factory = moe("gpt_oss", n_val=4)
    run_parity(factory, accumulate_grad_batches=2, gradient_clip_val=0.5, max_steps=4,
               limit_val_batches=1, val_check_interval=4)


class RecordingMixtral(TinyMixtral):
    """A loss from every output HF records: attentions (recorded by hooks inside the blocks, like the
    router logits) and hidden states (recorded by hooks on the blocks themselves), besides the router loss."""

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (input_ids,) = batch
        out = self.model(input_ids=input_ids, labels=input_ids, output_attentions=True, output_hidden_states=True)
        assert len(out.attentions) == 3 and len(out.hidden_states) == 4 and len(out.router_logits) == 3
        attention = sum(a.pow(2).mean() for a in out.attentions)
        return out.loss + 0.5 * attention + 0.01 * out.hidden_states[1].pow(2).mean()


@pytest.mark.parametrize("option", [{}, {"keep_activations": 1}], ids=["recomputed", "kept"])
def test_every_recorded_output_gets_its_gradient(option: dict[str, Any]) -> None:
    run_parity(partial(RecordingMixtral, optimizer="adamw", lr=3e-3, router_aux_loss_coef=COEF),
               megatrain(**option))


def test_router_loss_refused_without_the_known_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers that records router logits some other way (4.x wraps forwards) is refused, naming
    the module, what is missing and the two fixes."""
    import megatrain_lightning.setup_checks as setup_checks

    monkeypatch.setattr(setup_checks, "recorder_known", lambda: False)
    with pytest.raises(ValueError, match=r"GptOssForCausalLM has config.output_router_logits=True.*"
                                         r"output_capturing.*Upgrade transformers.*output_router_logits=False"):
        fit(moe("gpt_oss"), "megatrain", max_steps=1)


def test_a_recompute_that_records_otherwise_is_an_error() -> None:
    """Exact or refused: a block whose recompute records a different number of tensors than its forward
    did cannot give them their gradients."""
    import transformers.utils.output_capturing as oc

    token = oc._active_collector.set({"router_logits": []})
    try:
        x = torch.ones(2)
        out, recorded, tensors = side_outputs.capture(lambda: oc._active_collector.get()["router_logits"].append(x))
        assert recorded is not None and tensors == [x]
        assert oc._active_collector.get()["router_logits"] == []  # taken out until the Function returns them
        recorded.put_back([x * 2])
        assert torch.equal(oc._active_collector.get()["router_logits"][0], x * 2)
    finally:
        oc._active_collector.reset(token)

    def twice() -> None:
        oc._active_collector.get()["router_logits"].extend([x, x])

    _, again = side_outputs.recompute(recorded, lambda: oc._active_collector.get()["router_logits"].append(x), 0)
    assert again == [x]
    with pytest.raises(RuntimeError, match="block 0's recompute recorded other outputs than its forward"):
        side_outputs.recompute(recorded, twice, 0)
    assert oc._active_collector.get() is None  # the recompute's collector is gone


# ---------------------------------------------------------------------------------------------
# experts without tokens
# ---------------------------------------------------------------------------------------------
class DeadExpertGptOss(TinyGptOss):
    """GPT-OSS whose routers never pick expert 3 (router bias -100; top-2 of 4)."""

    def build_model(self) -> torch.nn.Module:
        model = super().build_model()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.router.bias[3] = -100.0
        return model


def test_hf_expert_without_tokens_decays_as_native_adamw() -> None:
    """3-d expert weights: an expert without tokens gets a zero slice of its tensor's gradient, so AdamW's
    moments stay zero and its weights only decay, step after step, as under the default strategy."""
    lr, wd, steps = 3e-3, 0.1, 8
    factory = partial(DeadExpertGptOss, optimizer="adamw", lr=lr, weight_decay=wd, scheduler=False,
                      router_aux_loss_coef=COEF)
    ref, got = run_parity(factory, max_steps=steps)
    for run in (ref, got):
        for i in range(4):
            key = f"model.model.layers.{i}.mlp.experts.gate_up_proj"
            init, final = run.init_state[key][3], run.state[key][3]
            assert torch.allclose(final, init * (1 - lr * wd) ** steps, rtol=1e-6, atol=0)
            assert rel_diff(run.init_state[key][0], run.state[key][0]) > 1e-3  # a used expert trains


@pytest.mark.parametrize("experts", ["stacked", "list"])
def test_expert_without_tokens_in_a_step_matches_native(experts: str) -> None:
    """Expert 3 gets no token in every odd step. Stacked experts: a zero gradient, moments decay; a
    ModuleList: None, AdamW skips it (no decay of moments or weights) under the default strategy, and so
    under this one, both on the overlapped path and when a hook sees the gradients (which are None, or
    present, exactly where the default strategy's are)."""
    factory = partial(ZOO["user_moe"], experts=experts, optimizer="adamw", lr=3e-3, weight_decay=0.1)
    run_parity(factory)
    ref, got = run_parity(factory, record_grad_norms=True)
    seen = [sorted(k for k in step if ".3." in k or k.endswith(("w1", "w2"))) for step in ref.recorder.grad_norms]
    if experts == "list":
        assert seen[0] and not seen[1], "expert 3 has gradients in even steps only"
    assert [sorted(s) for s in got.recorder.grad_norms] == [sorted(s) for s in ref.recorder.grad_norms]
    for r, g in zip(ref.recorder.grad_norms, got.recorder.grad_norms):
        assert all(abs(g[k][1] - r[k][1]) <= 1e-5 * abs(r[k][1]) + 1e-12 for k in r)
