"""The one model resolver (testbed/models.py): what a model config names."""

from __future__ import annotations

import json

import pytest

from testbed.build import model_spec
from testbed.config_schema import compose_config
from testbed.errors import InputError
from testbed.models import resolve_model


def checkpoint(folder, hidden: int = 64):
    """An HF folder's config.json of a small Llama (weights are not read here)."""
    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 500,
        "max_position_embeddings": 256,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_path_over_an_entry_with_a_shape_loads_that_folder_named_after_it(tmp_path):
    folder = checkpoint(tmp_path / "my-llama", hidden=96)
    cfg = compose_config(["model=dummy-llama", f"model.path={folder}"])  # dummy: its own shape
    model = resolve_model(dict(cfg.model))
    assert model.folder == folder and model.name == "my-llama"
    assert model.spec().hidden_size == 96 and model.spec().name == "my-llama"
    assert model_spec(cfg.model).name == "my-llama"  # what the run is labelled and profiled as


def test_an_entry_that_names_its_folder_keeps_its_name(tmp_path):
    folder = checkpoint(tmp_path / "weights")
    model = resolve_model({"name": "mine", "path": str(folder), "hf_config": None})
    assert (model.name, model.folder) == ("mine", folder)


def test_a_model_path_that_is_not_a_checkpoint_is_an_input_error(tmp_path):
    cfg = compose_config([f"model.path={tmp_path / 'nothing'}"])
    with pytest.raises(InputError, match=r"model=dummy-llama: no config\.json at"):
        model_spec(cfg.model)
