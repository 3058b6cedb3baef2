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


def test_a_gpus_kv_cache_is_its_memory_share_less_weights_and_activation_peak():
    from testbed.models import GPUMemory

    memory = GPUMemory(80e9, 0.9, weight_bytes=16e9, activation_peak_bytes=4e9)
    assert memory.kv_cache_bytes == 80e9 * 0.9 - 16e9 - 4e9
    peakier = GPUMemory(80e9, 0.9, weight_bytes=16e9, activation_peak_bytes=6e9)
    assert peakier.kv_cache_bytes == memory.kv_cache_bytes - 2e9


def test_kv_blocks_come_from_a_fixed_budget_else_from_the_gpus_memory():
    from testbed.models import GPUMemory, num_kv_blocks

    spec = resolve_model("llama3-8b").spec()
    per_block = 16 * spec.kv_bytes_per_token("bfloat16")  # 2 MiB
    memory = GPUMemory(80e9, 0.9, spec.weight_bytes("bfloat16"), 4e9)
    assert num_kv_blocks(spec, "bfloat16", 16, memory=memory) == int(
        (72e9 - spec.weight_bytes("bfloat16") - 4e9) // per_block
    )
    assert num_kv_blocks(spec, "bfloat16", 16, 100 * per_block, memory) == 100  # a budget wins
    with pytest.raises(ValueError, match="needs kv_cache_bytes or the GPU's memory"):
        num_kv_blocks(spec, "bfloat16", 16)
    small = GPUMemory(16e9, 0.9, spec.weight_bytes("bfloat16"), 1e9)
    with pytest.raises(ValueError, match=r"no room for a KV cache: .* GiB of bfloat16 weights"):
        num_kv_blocks(spec, "bfloat16", 16, memory=small)
