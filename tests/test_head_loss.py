"""The LM head's loss in chunks with each chunk's gradients taken in its forward (models/head_loss.py): the
values and gradients of the one-pass loss and of the per-chunk checkpoint it replaced, under fp32 and bf16
autocast, with a bias, a weight tied to the embedding, peft's LoRA on the head, a hook on the weight, a scaled or
accumulated backward, ignored targets; weights DeepSpeed or FSDP manage taking the checkpointed chunks; and
CausalLM trained with it under the strategy as under Lightning's default one."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from conftest import megatrain, run_parity
from megatrain_lightning.data.sft_batch import IGNORE_INDEX
from megatrain_lightning.models.head_loss import chunked_head_loss

V, D, N, CHUNK = 97, 16, 40, 7


def one_pass(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def checkpointed(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What CausalLM ran before: each chunk checkpointed, its head and loss run again in the backward."""
    return sum(checkpoint(partial(one_pass, head), h, t, use_reentrant=False)
               for h, t in zip(hidden.split(CHUNK), targets.split(CHUNK)))


def case(bias: bool = True, seed: int = 0) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(D, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) / D ** 0.5)
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    hidden = torch.randn(N, D, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[3:9] = IGNORE_INDEX  # a prompt; the chunk 7..13 is partly ignored, 0..6 partly
    targets[14:21] = IGNORE_INDEX  # a whole chunk ignored
    return head, hidden, targets


def grads(loss_fn: Any, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, scale: float = 1.0):
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    loss = loss_fn(head, hidden, targets)
    (loss * scale).backward()
    named = head.named_parameters()
    return loss.detach(), hidden.grad.clone(), {n: p.grad.clone() for n, p in named if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_values_and_gradients_of_the_one_pass_loss_and_of_the_checkpointed_chunks(autocast: bool) -> None:
    head, hidden, targets = case()
    ours = partial(chunked_head_loss, chunk=CHUNK)
    reference = grads(one_pass, head, hidden, targets)  # fp32, one pass
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = grads(ours, head, hidden, targets)
        before = grads(checkpointed, head, hidden, targets)
        whole = grads(one_pass, head, hidden, targets)
    # chunk for chunk the very ops the checkpoint's backward ran: the same loss and input gradient, bit for bit
    assert torch.equal(got[0], before[0]) and torch.equal(got[1], before[1])
    if not autocast:
        for name in ("weight", "bias"):  # summed over the chunks in another order
            torch.testing.assert_close(got[2][name], before[2][name], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(got[2][name], reference[2][name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], reference[1], rtol=1e-5, atol=1e-6)
        return
    # Under autocast the checkpointed chunks shared autocast's one bf16 cast of the weight, so autograd summed the
    # chunks' weight gradients in bf16 before the cast back; here each chunk's is summed in fp32: nearer the
    # fp32 one-pass gradient than both the checkpointed chunks and the bf16 one-pass loss
    def err(g: dict, name: str) -> float:
        return ((g[name] - reference[2][name]).norm() / reference[2][name].norm()).item()

    for name in ("weight", "bias"):
        assert err(got[2], name) < min(err(before[2], name), err(whole[2], name)) < 1e-2, name


def test_a_hook_on_the_weight_sees_one_gradient_and_a_scaled_or_accumulated_backward_is_exact() -> None:
    head, hidden, targets = case(bias=False)
    seen: list[torch.Tensor] = []
    handle = head.weight.register_hook(lambda g: seen.append(g.clone()))
    loss, _, g1 = grads(partial(chunked_head_loss, chunk=CHUNK), head, hidden, targets)
    handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], g1["weight"])
    _, _, g3 = grads(partial(chunked_head_loss, chunk=CHUNK), head, hidden, targets, scale=3.0)
    torch.testing.assert_close(g3["weight"], 3 * g1["weight"])
    # two backward passes add into .grad (gradient accumulation)
    head.zero_grad(set_to_none=True)
    for _ in range(2):
        chunked_head_loss(head, hidden, targets, CHUNK).backward()
    torch.testing.assert_close(head.weight.grad, 2 * g1["weight"])
    with torch.no_grad():  # evaluation: the loss alone, nothing kept
        assert torch.equal(chunked_head_loss(head, hidden, targets, CHUNK), loss)


def test_a_weight_tied_to_the_embedding_gets_both_gradients() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(V, D)
    head = nn.Linear(D, V, bias=False)
    head.weight = embed.weight
    ids = torch.randint(0, V, (N,))
    targets = torch.roll(ids, -1)

    def step(loss_fn: Any) -> torch.Tensor:
        embed.zero_grad(set_to_none=True)
        loss_fn(head, torch.tanh(embed(ids)), targets).backward()
        return embed.weight.grad.clone()

    torch.testing.assert_close(step(partial(chunked_head_loss, chunk=CHUNK)), step(one_pass), rtol=1e-5, atol=1e-6)


def test_peft_lora_on_the_head_trains_its_adapters_and_leaves_the_base_alone() -> None:
    peft = pytest.importorskip("peft")

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = case(bias=False)[0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm_head(x)

    _, hidden, targets = case()
    model = peft.get_peft_model(Head(), peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))
    got = grads(partial(chunked_head_loss, chunk=CHUNK), model, hidden, targets)
    want = grads(one_pass, model, hidden, targets)
    assert got[2].keys() == want[2].keys() and all("lora_" in n for n in got[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights", ["DeepSpeed ZeRO-3's (ds_id)", "FSDP's views (a tensor attribute)"])
def test_weights_a_sharding_engine_manages_take_the_checkpointed_chunks(
        weights: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed gathers its parameters only inside the module's forward and reduces their gradients in its own
    backward hooks; FSDP's flat parameter is seen through views: their chunks are checkpointed and run again in
    the backward, and the gradients are the one pass's."""
    from megatrain_lightning.models import head_loss

    head, hidden, targets = case(bias=False)
    if weights.startswith("DeepSpeed"):
        head.weight.ds_id = 0
        owner = head.weight
    else:
        owner = head.weight
        del head.weight
        head.weight = owner * 1.0  # a view-like non-leaf: its gradient reaches `owner` only through autograd
    calls: list[bool] = []
    monkeypatch.setattr(head_loss, "checkpoint", lambda *a, **k: calls.append(True) or checkpoint(*a, **k))
    loss = chunked_head_loss(head, hidden, targets, CHUNK)
    loss.backward()
    assert len(calls) == len(hidden.split(CHUNK))
    got_h, got_w = hidden.grad.clone(), owner.grad.clone()
    hidden.grad, owner.grad = None, None
    if weights.startswith("FSDP"):
        head.weight = owner * 1.0
    one_pass(head, hidden, targets).backward()
    torch.testing.assert_close(got_h, hidden.grad)
    torch.testing.assert_close(got_w, owner.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("one_intra_op_thread")
def test_causal_lm_with_its_chunked_loss_trains_under_the_strategy_as_under_the_default() -> None:
    from megatrain_lightning.models import CausalLM

    config = dict(model_type="qwen2", vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)

    class Module(CausalLM):
        def __init__(self) -> None:
            super().__init__(config=config, lr=3e-3, loss_chunk_tokens=24)

        def train_dataloader(self) -> Any:
            ids = torch.randint(0, 256, (32, 20), generator=torch.Generator().manual_seed(0))
            data = [{"input_ids": r, "labels": r} for r in ids]
            return torch.utils.data.DataLoader(data, batch_size=4)

    # Qwen2's key bias gets a gradient of rounding noise alone (a softmax does not see it): as tests/test_parity.py
    run_parity(Module, megatrain(keep_activations=1), max_steps=4, loose={"self_attn.k_proj.bias": 2e-4})


def test_the_fused_cross_entropy_is_autograds_value_and_gradient() -> None:
    """``cross_entropy_and_grad`` (compiled on a CUDA device under mixed precision) against autograd through
    ``F.cross_entropy``, bf16 and fp16 logits: gradients bit for bit eager, within an fp32 exp ulp compiled; ignored
    rows get no gradient and no loss even where their logits hold -inf (a masked vocabulary entry)."""
    from megatrain_lightning.models.head_loss import cross_entropy_and_grad

    targets = case()[2]
    compiled = torch.compile(cross_entropy_and_grad)
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(N, V, generator=g) * 3).to(dtype)
        logits[targets == IGNORE_INDEX, 0] = float("-inf")  # the row's picked index when ignored
        logits = logits.requires_grad_()
        loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        (want,) = torch.autograd.grad(loss, logits)
        for fn in (cross_entropy_and_grad, compiled):
            got_loss, got = fn(logits.detach(), targets)
            assert got.dtype == dtype and torch.isfinite(got_loss)
            torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
            if fn is cross_entropy_and_grad:
                assert torch.equal(got, want)
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-6)  # an fp32 exp ulp, rounded
            assert (got != want).float().mean() < 0.01 and not got[targets == IGNORE_INDEX].any()


@pytest.fixture
def fused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The compiled cross-entropy taken on the CPU too (as on a GPU under mixed precision), each use recorded."""
    import megatrain_lightning.models.head_loss as head_loss

    monkeypatch.setattr(head_loss, "FUSED_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(head_loss, "_fused_cross_entropy", None)
    used: list[torch.dtype] = []
    fused = head_loss._fused
    monkeypatch.setattr(head_loss, "_fused", lambda logits: used.append(logits.dtype) or fused(logits))
    return used


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("what", ["bias", "hidden frozen", "tied weight", "lora"])
def test_the_chunks_through_the_compiled_cross_entropy_train_as_through_autograds(
        fused_on_cpu: list[torch.dtype], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, what: str) -> None:
    """The chunks through the compiled cross-entropy (under autocast; a chunk wholly ignored, one partly) give
    autograd's loss and gradients: the head's backward takes the logits' gradient the compiled function made."""
    import megatrain_lightning.models.head_loss as head_loss

    head, hidden, targets = case(bias=what == "bias")
    if what == "hidden frozen":
        hidden = hidden.detach()
    if what == "tied weight":
        embed = nn.Embedding(V, D)
        head.weight = embed.weight
    if what == "lora":
        peft = pytest.importorskip("peft")

        class Head(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lm_head = head

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lm_head(x)

        head = peft.get_peft_model(Head(), peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))

    def run() -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        head.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_(hidden.requires_grad)
        with torch.autocast("cpu", dtype=dtype):
            loss = chunked_head_loss(head, h, targets, CHUNK)
        loss.backward()
        return loss.detach(), h.grad, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    compiled = run()
    assert fused_on_cpu == [dtype] * 6 and callable(head_loss._fused_cross_entropy)  # one call per chunk of 7
    monkeypatch.setattr(head_loss, "FUSED_DEVICES", ())
    eager = run()
    assert len(fused_on_cpu) == 12 and compiled[2].keys() == eager[2].keys() and compiled[2]
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=0)
    for got, want in [(compiled[1], eager[1])] + [(compiled[2][n], eager[2][n]) for n in eager[2]]:
        if want is None:
            assert got is None
        else:  # the logits' gradients within an fp32 exp ulp each, rounded to 16 bits, through the head's matmuls
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-5)


def test_a_failing_compile_of_the_loss_falls_back_to_its_eager_path(
        fused_on_cpu: list[torch.dtype], monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    import megatrain_lightning.models.head_loss as head_loss

    def fails(logits: torch.Tensor, targets: torch.Tensor) -> Any:
        raise torch._dynamo.exc.TorchDynamoException("inductor: no compiler\nmore")

    head, hidden, targets = case()
    monkeypatch.setattr(head_loss, "FUSED_DEVICES", ())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = grads(partial(chunked_head_loss, chunk=CHUNK), head, hidden, targets)
    monkeypatch.setattr(head_loss, "FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(head_loss, "_fused_cross_entropy", fails)
    fused_on_cpu.clear()
    with caplog.at_level("WARNING"), torch.autocast("cpu", dtype=torch.bfloat16):
        got = grads(partial(chunked_head_loss, chunk=CHUNK), head, hidden, targets)
    assert head_loss._fused_cross_entropy is False and len(fused_on_cpu) == 6  # asked each chunk; failed once
    assert [r.getMessage() for r in caplog.records if r.name == head_loss.__name__] == [
        "torch.compile failed on the loss (TorchDynamoException: inductor: no compiler); its eager path from here on"]
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])


def test_bad_targets_raise_through_the_compiled_cross_entropy_and_leave_it_on(fused_on_cpu: list[torch.dtype]) -> None:
    """A target outside the vocabulary is the data's error, not the compiler's: it propagates, the compiled path
    stays on."""
    import megatrain_lightning.models.head_loss as head_loss

    head, hidden, targets = case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked_head_loss(head, hidden, targets, CHUNK).backward()  # compiled first, with good targets
        targets[0] = V + 3
        with pytest.raises((RuntimeError, IndexError)):
            chunked_head_loss(head, hidden, targets, CHUNK)
    assert callable(head_loss._fused_cross_entropy)
