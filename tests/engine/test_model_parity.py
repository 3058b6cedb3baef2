"""Our model's logits equal transformers' on the same weights (fp32 tolerance)."""

from __future__ import annotations

import pytest
import torch

from testbed.engine.factory import engine_model
from testbed.engine.model import CausalLM
from testbed.engine.model_config import ModelConfig
from testbed.engine.weights import build_model
from testbed.models import models_dir
from tests.engine.helpers import ARCHS, run_prefill, write_hf_model

PROMPT = [1, 17, 250, 3, 99, 42, 7, 7, 8, 120, 33, 5, 64, 200, 11, 2, 150, 6, 9, 10, 12, 13, 14]


def ours(folder):
    return build_model(ModelConfig.from_path(folder), folder, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind", sorted(ARCHS))
def test_logits_match_transformers(tmp_path, kind):
    hf = write_hf_model(kind, tmp_path)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    model = ours(tmp_path)
    got = run_prefill(model, PROMPT)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # Chunked prefill over the paged cache gives the same logits.
    torch.testing.assert_close(run_prefill(model, PROMPT, chunk=5), got, rtol=1e-5, atol=1e-5)


def test_logits_match_transformers_on_the_shared_tinystories_model():
    folder = models_dir() / "stories260K" / "hf"
    if not (folder / "model.safetensors").exists():
        pytest.skip(f"stories260K not found at {folder} (set TESTBED_MODELS_DIR)")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    prompt = [1, 403, 407, 261, 378, 280, 442, 267, 273, 350, 370]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(
        run_prefill(ours(folder), prompt, chunk=4), expected, rtol=1e-4, atol=1e-4
    )


def test_cpu_logits_of_any_rows_equal_the_plain_product():
    # On a CPU, up to cpu_view_logits_rows rows take W·hᵀ (a faster MKL path):
    # the same logits, row for row, as the plain h·Wᵀ, contiguous up to
    # cpu_wide_logits_rows rows and a transposed view from there to the view limit.
    cfg, _, _ = engine_model("dummy-llama")
    model = build_model(cfg, None, torch.float32, torch.device("cpu"))
    w = model.lm_head.weight
    wide, view = CausalLM.cpu_wide_logits_rows, CausalLM.cpu_view_logits_rows
    for rows in [0, 1, 2, 3, wide, wide + 1, view, view + 1]:
        hidden = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
        got = model.logits(hidden)
        assert got.shape == (rows, cfg.vocab_size)
        assert got.is_contiguous() == (rows <= wide or rows > view)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, hidden @ w.T, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), (hidden @ w.T).argmax(-1))


def test_dummy_weights_in_a_low_precision_dtype_are_the_float32_ones_rounded():
    # On an accelerator, dummy weights are made in the run's dtype (build_model);
    # the same seed gives the same values as the float32 model's, rounded.
    from testbed.engine.weights import init_dummy

    cfg, _, _ = engine_model("dummy-llama")
    full = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=3)
    with torch.device("meta"):
        half = CausalLM(cfg)
    half = half.to(torch.bfloat16).to_empty(device="cpu")
    init_dummy(half, seed=3)
    got = dict(half.named_parameters())
    for name, p in full.named_parameters():
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name], p.to(torch.bfloat16), rtol=0, atol=0)
