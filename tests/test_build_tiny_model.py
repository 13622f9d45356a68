"""scripts/build_tiny_model.py: the random-weight Qwen3 the real engines serve, with any number of layers."""

from __future__ import annotations

import json

import pytest

from kvgate_testing.real_fleet import DEFAULT_MODEL_LAYERS, model_dir_for
from kvgate_testing.vllm import TINY_MODEL, TINY_MODEL_LAYERS
from scripts.build_tiny_model import MODEL_CONFIG, RECIPE_FILE, build


def test_build_writes_the_layers_asked_for_and_leaves_an_identical_build_alone(tmp_path):
    out = tmp_path / "model"
    assert build(out, layers=3) is True
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    assert config["hidden_size"] == MODEL_CONFIG["hidden_size"]
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").exists()
    assert json.loads((out / RECIPE_FILE).read_text())["config"]["num_hidden_layers"] == 3
    assert build(out, layers=3) is False  # same recipe: nothing rebuilt
    assert build(out, layers=4) is True  # another recipe replaces it
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4


def test_build_refuses_zero_layers(tmp_path):
    with pytest.raises(ValueError, match="--layers must be at least 1"):
        build(tmp_path / "model", layers=0)


def test_the_tests_model_and_the_routing_tiers_model_live_apart():
    assert MODEL_CONFIG["num_hidden_layers"] == TINY_MODEL_LAYERS
    assert model_dir_for(TINY_MODEL_LAYERS) == TINY_MODEL
    deep = model_dir_for(DEFAULT_MODEL_LAYERS)
    assert deep != TINY_MODEL and deep.parent == TINY_MODEL.parent and str(DEFAULT_MODEL_LAYERS) in deep.name


def test_the_prefill_preset_builds_qwen3_0_6b_widths_with_the_layers_asked_for(tmp_path):
    out = tmp_path / "prefill"
    assert build(out, layers=1, preset="prefill") is True
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (1024, 4, 128)
    assert config["num_hidden_layers"] == 1
    assert build(out, layers=1, preset="prefill") is False
    with pytest.raises(ValueError, match="unknown preset"):
        build(tmp_path / "other", preset="huge")
