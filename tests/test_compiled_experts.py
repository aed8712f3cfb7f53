"""Blocks with Hugging Face's experts run through torch.compile (``compile_blocks``, ``engine/compiled.py``).

Blocks whose experts run transformers' eager loop compile around them (a graph break each side, the experts eager,
under their own selective checkpoint in a kept block); grouped GEMM experts without biases (Qwen3-MoE's) compile
inside the block's graph; biased ones (GPT-OSS's) around it. On the CPU in fp32 each trains as Lightning's default
strategy does (weights to 1e-4, as tests/test_compiled_blocks.py), with the router loss on too, and with
transformers' recording hooks installed after the blocks compiled. (A file of its own so that pytest-xdist's
--dist loadfile runs it beside the dense compiled-block tests: together they were a quarter of the suite's test time
on one worker.) Compiled with inductor's graphs but no kernels written (conftest's ``compile_without_codegen``);
tests/test_recipes.py compiles GPT-OSS layers around and with their experts with inductor itself.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from conftest import LOSS_RTOL, assert_parity, fit, megatrain
from zoo import ZOO

from megatrain_lightning.engine.compiled import CompiledBlocks
from megatrain_lightning.models import expert_routing  # noqa: F401  registers experts_implementation="grouped_mm_gather"

pytestmark = pytest.mark.usefixtures("one_intra_op_thread", "compile_without_codegen")


def test_which_blocks_compile_around_experts() -> None:
    """Asked to compile, blocks with Hugging Face's ``*Experts`` on transformers' eager loop compile around them
    (GPT-OSS's, Qwen3-MoE's sparse layers; its dense ``mlp_only_layers`` whole), a block routing to experts some
    other way whole; left open, the same, except that a block routing to experts without an ``*Experts`` module
    stays eager. Grouped GEMM experts compile inside their blocks' graphs, but for biased ones (GPT-OSS)."""
    from megatrain_lightning.engine.compiled import experts_of, has_experts

    gpt_oss, qwen3_moe, llama = ZOO["gpt_oss"](), ZOO["qwen3_moe"](), ZOO["llama"]()
    assert all([type(m).__name__ for m in experts_of(b)] == ["GptOssExperts"] for b in gpt_oss.model.model.layers)
    layers = list(qwen3_moe.model.model.layers)
    assert [bool(experts_of(b)) for b in layers] == [True, False, True]
    assert not any(has_experts(b) for b in llama.model.model.layers)
    routed = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(2)])
    for b in routed:
        b.num_experts = 4  # a router of the user's own (no *Experts module)
    assert all(has_experts(b) and not experts_of(b) for b in routed)
    original = type(layers[0]).forward
    compiled = CompiledBlocks(True, checked={0, 1, 2}, blocks=layers)
    assert compiled.around_experts == {0, 2} and not compiled.whole
    assert [compiled.runs(i, original) for i in range(3)] == [True, True, True]
    assert all("forward" in b.mlp.experts.__dict__ for b in (layers[0], layers[2]))
    compiled.close()
    assert not any("forward" in b.mlp.experts.__dict__ for b in (layers[0], layers[2]))
    left_open = CompiledBlocks(True, checked={0, 1, 2}, blocks=layers, auto=True)
    assert left_open.eager == set() and left_open.around_experts == {0, 2}
    assert [left_open.runs(i, original) for i in range(3)] == [True, True, True]
    left_open.close()
    assert CompiledBlocks(True, checked={0}, blocks=list(routed), auto=True).eager == {0, 1}
    whole = CompiledBlocks(True, checked={0}, blocks=list(routed))
    assert whole.eager == set() and whole.around_experts == set() and whole.whole
    # grouped GEMM experts without biases compile inside their blocks' graphs; GPT-OSS's (biased) around them
    gathered = list(ZOO["qwen3_moe"](experts_implementation="grouped_mm_gather").model.model.layers)
    inside = CompiledBlocks(True, checked={0, 1, 2}, blocks=gathered, auto=True)
    assert inside.eager == set() and inside.around_experts == set() and inside.whole
    assert not any("forward" in b.mlp.experts.__dict__ for b in (gathered[0], gathered[2]))
    biased = list(ZOO["gpt_oss"](experts_implementation="grouped_mm_gather").model.model.layers)
    assert CompiledBlocks(True, checked=set(), blocks=biased, auto=True).around_experts == set(range(len(biased)))


MOE = {
    "gpt_oss, grouped_mm_gather": partial(ZOO["gpt_oss"], experts_implementation="grouped_mm_gather"),
    "qwen3_moe, transformers' grouped_mm": partial(ZOO["qwen3_moe"], experts_implementation="grouped_mm"),
    "mixtral, transformers' eager loop": ZOO["mixtral"],
}
INSIDE = {"qwen3_moe, transformers' grouped_mm"}  # compiled inside the blocks' graphs (engine/compiled.inside_graphs)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MOE))
def test_blocks_with_experts_compiled_around_them_train_as_the_default_strategy(
        case: str, compiled_calls: list, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Compiled around their experts (eager, a graph break each side): streamed, kept whole and kept saving
    matmul outputs (the experts under their own selective checkpoint, recomputed in the backward on the weights
    the forward read), at parity with Lightning's default strategy; the experts' own forward back after the fit.
    Grouped GEMM experts without biases (Qwen3-MoE's here) compile inside the block's graph: the same parity."""
    from megatrain_lightning.engine import compiled as compiled_module

    checkpointed: set[bool] = set()  # a set, added to once per value: dynamo guards on what a traced call mutates
    saving = compiled_module.saving_matmuls  # (a list appended to at each call: the block compiled again, three times)

    def counted(fn: Any, *inputs: Any, **kwargs: Any) -> Any:
        compiling = torch.compiler.is_compiling()
        if compiling not in checkpointed:
            checkpointed.add(compiling)
        return saving(fn, *inputs, **kwargs)

    monkeypatch.setattr(compiled_module, "saving_matmuls", counted)
    on_host: list[str] = []  # an experts call that read the module's own (host) parameters, not the bound weights
    factory = partial(MOE[case], optimizer="adamw", lr=3e-3)
    experts_class = type(next(m for m in factory().modules() if type(m).__name__.endswith("Experts")))
    forward = experts_class.forward

    def reads_bound_weights(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and any(isinstance(p, torch.nn.Parameter) for p in self._parameters.values()):
            on_host.append(type(self).__name__)
        return forward(self, *args, **kwargs)

    fullgraph: list[bool] = []  # each compilation: whole (a kept dense block's checkpoint inside) or around experts
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **kw: fullgraph.append(kw.get("fullgraph", False)) or compile_(fn, **kw))
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ref = fit(factory, None, max_steps=3)
    monkeypatch.setattr(experts_class, "forward", reads_bound_weights)
    for kept_saves in ("matmuls", "all"):  # 2 blocks kept (Qwen3-MoE: a sparse and its dense one), the rest streamed
        got = fit(factory, megatrain(compile_blocks=True, keep_activations=2, kept_saves=kept_saves), max_steps=3)
        assert_parity(ref, got, LOSS_RTOL, 1e-4, None)
        assert not any("forward" in m.__dict__ for m in got.module.modules() if type(m).__name__.endswith("Experts"))
    # transformers 5.17's CPU grouped_mm (a loop over the experts) has a backward AOT autograd cannot trace
    # (.tolist(); 5.2x made it an op): a kept block compiled whole with its checkpoint then runs eager, one warning
    untraceable = case in INSIDE and not hasattr(torch.ops.transformers, "grouped_mm_fallback_backward")
    assert ("torch.compile failed" not in caplog.text) or untraceable, caplog.text
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    assert {(False, False), (True, False), (True, True)} <= set(compiled_calls)
    dense_kept = case.startswith("qwen3_moe")  # its dense block (mlp_only_layers) is kept too: checkpoint inside
    if case in INSIDE:  # grouped GEMM experts without biases: inside the block's graph, checkpoint and all
        assert False not in checkpointed and True in fullgraph and (True in checkpointed or untraceable)
    else:
        assert False in checkpointed  # the experts' checkpoint ran, eager, in a kept block
        assert (True in checkpointed) == (True in fullgraph) == dense_kept  # a checkpoint traced into one graph
    assert not on_host, on_host  # its recompute too read the weights the forward read


@pytest.mark.slow
@pytest.mark.parametrize(("case", "keep", "kept_saves"), [("gpt_oss, grouped_mm_gather", 1, "matmuls"),
                                                          ("qwen3_moe, transformers' grouped_mm", 1, "all"),
                                                          ("qwen3_moe, transformers' grouped_mm", 3, "matmuls")])
def test_router_loss_trains_compiled_as_the_default_strategy(case: str, keep: int, kept_saves: str, caplog: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With the router loss on (HF's recording hooks append each router's logits), blocks still compile: dynamo
    breaks the graph at the hook, the logits come out of the graph before it, and they carry their gradient (the
    block's Function returns them). A kept block compiled whole with its checkpoint (Qwen3-MoE's saving matmul
    outputs) has no place to break: transformers' collector is read as a plain attribute there, one compilation
    for every layer. Parity with the default strategy; compiled calls ran while recording, in the forward (no
    grad) and the recompute, and the whole kept block's, with no failure."""
    from megatrain_lightning.engine import side_outputs

    recorded: list[bool] = []  # grad enabled, for each compiled call made while recording
    whole: list[Any] = []  # the compiled function of each call compiled as one graph while recording
    call = CompiledBlocks.call

    def counted(self: CompiledBlocks, block: int, original: Any, module: Any, args: tuple, kwargs: dict,
                matmuls_only: bool = False) -> Any:
        if side_outputs.recording():
            recorded.append(torch.is_grad_enabled())
            if self._fullgraph(block, matmuls_only):
                whole.append(original)
        return call(self, block, original, module, args, kwargs, matmuls_only)

    monkeypatch.setattr(CompiledBlocks, "call", counted)
    factory = partial(MOE[case], optimizer="adamw", lr=3e-3, router_aux_loss_coef=0.5)
    torch._dynamo.reset()
    ref = fit(factory, None, max_steps=3)
    torch._dynamo.utils.counters.clear()
    got = fit(factory, megatrain(compile_blocks=True, keep_activations=keep, kept_saves=kept_saves), max_steps=3)
    assert_parity(ref, got, LOSS_RTOL, 1e-4, None)
    assert bool(whole) == (case in INSIDE and kept_saves == "matmuls")
    # transformers 5.17's CPU grouped_mm has a backward AOT autograd cannot trace (as in the test above): the whole
    # block's first compiled call fails, one warning, and it runs eager from there
    untraceable = bool(whole) and not hasattr(torch.ops.transformers, "grouped_mm_fallback_backward")
    assert ("torch.compile failed" not in caplog.text) or untraceable, caplog.text
    if whole and not untraceable:  # every block kept, compiled whole in steps 2-3 (the first call is eager), in 2
        # graphs: the MoE layers' (0 and 2: one, though the collector's lists differ in length between them) and the
        # dense layer's (1)
        assert len(whole) == 2 * 3 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    elif not whole:  # streamed blocks: forward and recompute
        assert {False, True} <= set(recorded), recorded


@pytest.mark.slow
def test_recording_hooks_installed_after_blocks_compiled() -> None:
    """transformers installs its recording hooks lazily, at the first call that records: blocks of the same class
    compiled before in the process (a run without the router loss) had none. Dynamo's default does not guard on
    hooks, so those graphs ran without them: a compiled kept block's logits missing from the loss (silently where
    other layers still recorded; here none did, and transformers' loss fails on the empty tuple), a streamed block's
    recompute refused. Compiled blocks guard on their submodules' hooks: the run with the router loss after one
    without it trains as Lightning's default strategy."""
    case = "qwen3_moe, transformers' grouped_mm"
    torch._dynamo.reset()
    placement = {"compile_blocks": True, "keep_activations": 3, "kept_saves": "all"}
    fit(partial(MOE[case], optimizer="adamw", lr=3e-3), megatrain(**placement), max_steps=3)
    factory = partial(MOE[case], optimizer="adamw", lr=3e-3, router_aux_loss_coef=0.5)
    ref = fit(factory, None, max_steps=3)
    assert_parity(ref, fit(factory, megatrain(**placement), max_steps=3), LOSS_RTOL, 1e-4, None)
