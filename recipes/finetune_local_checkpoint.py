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
call the plain `train(cfg)` function, which returns the run's metrics. Give both --checkpoint and
--data, or neither: one alone is refused (the demo's other half would stand in for the missing one).
Bad input ends as it does in train.py: `error: <one paragraph>` on stderr and exit code 2.
"""

import argparse
import json
import random
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, OverrideParseException

from megatrain_lightning.blocks import BlockDetectionError
from megatrain_lightning.cli import train
from megatrain_lightning.errors import ConfigError
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


def main(argv: list[str] | None = None) -> dict:
    """Parse `argv` (default: the command line), compose the configs and train; returns the run's metrics."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="local Hugging Face checkpoint directory (weights + tokenizer)")
    parser.add_argument("--data", help="JSON/JSONL file with query/response records")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = parser.parse_args(argv)
    if (args.checkpoint is None) != (args.data is None):
        given, missing = ("--checkpoint", "--data") if args.data is None else ("--data", "--checkpoint")
        parser.error(f"{given} without {missing}: give both --checkpoint DIR and --data FILE.jsonl to fine-tune "
                     f"your own, or neither for the demo (a tiny checkpoint and addition questions)")
    out = REPO / "outputs" / "recipe_finetune"
    overrides = []
    if args.checkpoint is None:
        ckpt, data = demo_files(out)
        # The demo: short answers, a bare prompt, a higher learning rate than a real fine-tune wants.
        overrides = ["data.prompt_template='Q: {query}\\nA: '", "model.lr=2e-3", "trainer.max_steps=600",
                     "trainer.val_check_interval=200", "data.batch_size=32", "data.max_length=64"]
    else:
        ckpt, data = Path(args.checkpoint), Path(args.data)
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(
                config_name="train",
                overrides=["experiment=finetune_jsonl", f"model.pretrained={ckpt}", f"data.path={data}",
                           f"paths.output_dir={out / 'run'}", *overrides, *args.overrides],
                return_hydra_config=True,  # lets train() name the chosen configs in its metrics
            )
        metrics = train(cfg)
    except (ConfigCompositionException, OverrideParseException, ConfigError, BlockDetectionError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"exact match {metrics['exact_match_start']:.1%} -> {metrics['exact_match']:.1%}; "
          f"metrics in {Path(cfg.paths.output_dir) / 'metrics.json'}")
    return metrics


if __name__ == "__main__":
    main()
