# python recipes/benchmark_packing.py [--steps 60] [--records 2000] [--max-length 256] [--batch-size 8]
"""Tokens/s of fine-tuning with and without packing, on chat data of mixed lengths, through train(cfg).

The data: multi-turn OpenAI-format conversations (one to three question/answer turns of varied length,
15 to about 250 tokens with the byte tokenizer), written once under outputs/benchmark_packing/. Both runs
train the same tiny Llama-shaped model (`model=tiny`) with `strategy=megatrain` on the CPU, the same
micro-batch of rows, for the same number of steps; tokens/s counts real tokens only (padding excluded), so
the ratio is the gain a user sees in samples per second. Padded rows are as wide as their batch's longest
sample; packed rows hold several samples up to `--max-length`, with per-sample block-diagonal attention.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from hydra import compose, initialize_config_dir

from megatrain_lightning.cli import train

REPO = Path(__file__).resolve().parent.parent


def write_data(path: Path, records: int, seed: int = 0) -> Path:
    """Conversations whose lengths vary as instruction data's do: mostly short, a long tail."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(records):
            messages = []
            for _ in range(rng.choice([1, 1, 2, 3])):
                a, b = rng.randint(0, 999), rng.randint(0, 999)
                words = " ".join(rng.choice(["first", "add", "then", "carry", "the", "digits"])
                                 for _ in range(int(rng.expovariate(1 / 6))))
                messages += [{"role": "user", "content": f"What is {a} plus {b}?"},
                             {"role": "assistant", "content": f"{words} The answer is: {a + b}".strip()}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def run(data: Path, packing: bool, steps: int, max_length: int, batch_size: int, out: Path) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True, overrides=[
            "hardware=cpu", "data=jsonl", f"data.path={data}", "data.val_size=0", f"data.max_length={max_length}",
            f"data.batch_size={batch_size}", f"data.packing={str(packing).lower()}", "data.prompt_template='{query}\\n'",
            "model.config.max_position_embeddings=512", f"trainer.max_steps={steps}", "trainer.callbacks.checkpoint=null",
            "trainer.callbacks.hf_export=null", f"paths.output_dir={out}",
        ])
    return train(cfg)


def measure(steps: int = 60, records: int = 2000, max_length: int = 256, batch_size: int = 8) -> dict[str, float]:
    """tokens/s padded, packed, and their ratio."""
    where = REPO / "outputs" / "benchmark_packing"
    data = write_data(where / f"chat_{records}.jsonl", records)
    padded = run(data, False, steps, max_length, batch_size, where / "padded")
    packed = run(data, True, steps, max_length, batch_size, where / "packed")
    return {"padded_tokens_per_s": padded["tokens_per_s"], "packed_tokens_per_s": packed["tokens_per_s"],
            "gain": packed["tokens_per_s"] / padded["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    result = measure(args.steps, args.records, args.max_length, args.batch_size)
    print(f"padded {result['padded_tokens_per_s']:,.0f} tokens/s, packed {result['packed_tokens_per_s']:,.0f} "
          f"tokens/s: {result['gain']:.2f}x")


if __name__ == "__main__":
    main()
