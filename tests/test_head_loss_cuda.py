"""The chunked LM-head loss on the GPU under bf16 autocast (skipped without CUDA): the cross-entropy and its
gradient compiled as one function (models/head_loss.py) against autograd's path, at Qwen3's vocabulary."""

from __future__ import annotations

import pytest
import torch

import megatrain_lightning.models.head_loss as head_loss
from megatrain_lightning.models.head_loss import chunked_head_loss

pytestmark = [pytest.mark.cuda]


def test_cuda_chunked_loss_with_the_compiled_cross_entropy_matches_autograds(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden_size, vocab, chunk = 3000, 256, 151936, 1024  # chunks of 1024, 1024, 952 rows
    head = torch.nn.Linear(hidden_size, vocab, bias=False, device="cuda")
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden_size, device="cuda", generator=g) / hidden_size ** 0.5)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=g) * 2
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    targets[100:400] = -100

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head.weight.grad = None
        h = hidden.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = chunked_head_loss(head, h, targets, chunk)
        loss.backward()
        return loss.detach(), h.grad, head.weight.grad

    compiled = run()
    assert callable(head_loss._fused_cross_entropy), "the compiled cross-entropy did not run"
    monkeypatch.setattr(head_loss, "_fused", lambda logits: None)
    eager = run()
    rel = [((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(compiled, eager)]
    print(f"compiled cross-entropy against autograd's (loss, hidden grad, weight grad): {rel}")
    assert rel[0] < 1e-6 and rel[1] < 1e-5 and rel[2] < 1e-5  # H100, 2026-12-05: 0.0, 1.2e-06, 4.7e-07
