# python recipes/finetune_local_checkpoint.py [--checkpoint DIR] [--data FILE.jsonl] [hydra overrides ...]
"""Fine-tune a local Hugging Face checkpoint on MetaMathQA-format JSONL, from Python.

With your own files:
    python recipes/finetune_local_checkpoint.py --checkpoint ~/models/Qwen2.5-7B --data metamathqa.jsonl \
        hardware=auto trainer.max_steps=1000
which is the same run as
    python train.py experiment=finetune_jsonl model.pretrained=~/models/Qwen2.5-7B data.path=metamathqa.jsonl ...

Without arguments it makes a demo of both (a tiny random Llama with a byte-level tokenizer, and
addition questions as `query`/`response` records) under outputs/recipe_finetune/, so it runs
offline anywhere. It shows the programmatic path: compose the same configs train.py uses, then
call the plain `train(cfg)` function, which returns the run's metrics.
"""

import argparse
import json
import random
from pathlib import Path

from hydra import compose, initialize_config_dir

from megatrain_lightning.cli import train
from megatrain_lightning.models.demo_checkpoint import write_demo_checkpoint

REPO = Path(__file__).resolve().parent.parent


def demo_files(where: Path) -> tuple[Path, Path]:
    """A tiny checkpoint and 1,600 MetaMathQA-style records (distinct questions), written once."""
    ckpt, data = where / "checkpoint", where / "train.jsonl"
    if not (ckpt / "config.json").is_file():
        write_demo_checkpoint(ckpt, hidden_size=128, layers=2)
    if not data.is_file():
        pairs = [(a, b) for a in range(40) for b in range(40)]
        random.Random(0).shuffle(pairs)
        with open(data, "w") as f:
            for a, b in pairs:
                f.write(json.dumps({"query": f"What is {a}+{b}?", "response": f"The answer is: {a + b}"}) + "\n")
    return ckpt, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="local Hugging Face checkpoint directory (weights + tokenizer)")
    parser.add_argument("--data", help="JSON/JSONL file with query/response records")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = parser.parse_args()
    out = REPO / "outputs" / "recipe_finetune"
    overrides = []
    if args.checkpoint is None or args.data is None:
        ckpt, data = demo_files(out)
        # The demo: short answers, a bare prompt, a higher learning rate than a real fine-tune wants.
        overrides = ["data.prompt_template='Q: {query}\\nA: '", "model.lr=2e-3", "trainer.max_steps=600",
                     "trainer.val_check_interval=200", "data.batch_size=32", "data.max_length=64"]
    ckpt, data = Path(args.checkpoint or ckpt), Path(args.data or data)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=["experiment=finetune_jsonl", f"model.pretrained={ckpt}", f"data.path={data}",
                       f"paths.output_dir={out / 'run'}", *overrides, *args.overrides],
            return_hydra_config=True,  # lets train() name the chosen configs in its metrics
        )
    metrics = train(cfg)
    print(f"exact match {metrics['exact_match_start']:.1%} -> {metrics['exact_match']:.1%}; "
          f"metrics in {out / 'run' / 'metrics.json'}")


if __name__ == "__main__":
    main()
