# python recipes/plain_python_megatrain.py
"""MegaTrainStrategy in your own LightningModule, in plain Python: no Hydra, no Hugging Face.

The only change from ordinary Lightning is `strategy=MegaTrainStrategy(...)` (or the registered
name, `strategy="megatrain"`, after `import megatrain_lightning`). The strategy finds the repeated
blocks itself (here: the `nn.ModuleList` of identical `Block`s), keeps every parameter, gradient
and Adam moment in host memory, and streams one block at a time through the device. The model
below learns to continue a short text, byte by byte; it runs in about half a minute on a CPU.
"""

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from megatrain_lightning import EngineConfig, MegaTrainStrategy

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters. "
).encode()


class Windows(Dataset):
    """Every `length`-byte window of the text (its own next-byte targets)."""

    def __init__(self, data: bytes, length: int) -> None:
        self.data, self.length = torch.tensor(list(data)), length

    def __len__(self) -> int:
        return len(self.data) - self.length - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i : i + self.length + 1]


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP: the unit MegaTrainStrategy streams."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)  # 3 x [B, T, H, D/H]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ByteLM(pl.LightningModule):
    """A small byte-level transformer; nothing in it knows about MegaTrain."""

    def __init__(self, dim: int = 128, depth: int = 4, heads: int = 4, context: int = 64, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # [B, T, 256]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # A plain torch AdamW: the strategy runs its update on the host, over the host-resident state.
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)


def main(max_steps: int = 150) -> float:
    pl.seed_everything(0)
    cuda = torch.cuda.is_available()
    model = ByteLM()
    loader = DataLoader(Windows(TEXT, 64), batch_size=32, shuffle=True, drop_last=True)
    trainer = pl.Trainer(
        strategy=MegaTrainStrategy(EngineConfig(slots=2)),  # 2 device slots: block i+1 copies in while block i computes
        accelerator="cuda" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, loader)
    loss = float(trainer.callback_metrics["loss"])
    print(f"final loss {loss:.3f} (uniform guessing: {math.log(256):.3f})")

    # The parameters are ordinary host tensors holding the trained weights: sample from them directly.
    model.eval()
    ids = torch.tensor([list(b"It is a truth")])
    with torch.no_grad():
        for _ in range(40):
            ids = torch.cat([ids, model(ids[:, -64:])[:, -1:].argmax(-1)], dim=1)
    print(bytes(ids[0].tolist()).decode(errors="replace"))
    return loss


if __name__ == "__main__":
    main()
