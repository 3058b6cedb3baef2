"""A model's dummy weights written as an HF folder (what vLLM loads in mode=vllm)
are the weights mode=real builds, and transformers reads them as the same model."""

from __future__ import annotations

import json

import torch

from testbed.engine.factory import engine_model
from testbed.engine.hf_export import hf_folder
from testbed.engine.model_config import ModelConfig
from testbed.engine.weights import build_model
from testbed.models import ResolvedModel, resolve_model
from tests.engine.helpers import run_prefill

PROMPT = [1, 17, 250, 3, 99, 42, 7, 7, 8, 120, 33, 5]


def small(tie: bool) -> ResolvedModel:
    base = resolve_model("dummy-llama")
    config = {**base.hf_config, "num_hidden_layers": 2, "tie_word_embeddings": tie}
    return ResolvedModel(f"tiny-{tie}", config, None, "test")


def test_the_folder_holds_the_dummy_weights_of_the_seed(tmp_path):
    for tie in (True, False):
        model = small(tie)
        folder = hf_folder(model, seed=3, cache=tmp_path)
        cfg, _, _ = engine_model(model)
        dummy = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=3)
        loaded = build_model(
            ModelConfig.from_path(folder), folder, torch.float32, torch.device("cpu")
        )
        for (name, a), (_, b) in zip(dummy.named_parameters(), loaded.named_parameters()):
            assert torch.equal(a, b), name
        assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is tie
        other = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=4)
        assert not torch.equal(other.model.embed_tokens.weight, loaded.model.embed_tokens.weight)


def test_a_folder_is_written_once_per_config_and_seed(tmp_path):
    model = small(True)
    first = hf_folder(model, seed=0, cache=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert hf_folder(model, seed=0, cache=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert hf_folder(model, seed=1, cache=tmp_path) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.name, hf_folder(model, seed=1, cache=tmp_path).name]
    )


def test_transformers_reads_the_folder_as_the_same_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = small(True)
    folder = hf_folder(model, seed=0, cache=tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    cfg, _, _ = engine_model(model)
    ours = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=0)
    torch.testing.assert_close(run_prefill(ours, PROMPT), expected, rtol=1e-4, atol=1e-4)


def test_a_model_with_its_own_folder_uses_it(tmp_path):
    model = ResolvedModel("real", {}, tmp_path, "test")
    assert hf_folder(model, seed=0, cache=tmp_path / "cache") == tmp_path
