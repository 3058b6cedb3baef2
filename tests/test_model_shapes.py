"""The shapes of conf/model's large dense and mixture-of-experts entries
(testbed.models.ModelSpec): their weights counted against transformers' own modules
and against the published parameter counts, the expert fields of each MoE family's
config, the configs refused, and the real engine refusing MoE models."""

from __future__ import annotations

import pytest

from testbed.build import model_spec
from testbed.config_schema import compose_config
from testbed.errors import InputError
from testbed.models import ModelSpec, resolve_model

NEW_MODELS = [
    "llama3-70b",
    "llama2-70b",
    "qwen2.5-72b",
    "mistral-7b",
    "codellama-34b",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
]
# Qwen1.5-MoE-A2.7B's config.json (Qwen/Qwen1.5-MoE-A2.7B): routed and shared experts.
QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
# deepseek-ai/deepseek-moe-16b-base's config.json: shared experts and a leading dense layer.
DEEPSEEK_MOE = {
    "architectures": ["DeepseekForCausalLM"],
    "model_type": "deepseek",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 102400,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def active(spec: ModelSpec) -> int:
    """What a vendor calls a model's active parameters: those one token multiplies
    through (:attr:`ModelSpec.matmul_params`) plus its input embedding row's table."""
    return spec.matmul_params + spec.vocab_size * spec.hidden_size


def near_published(count: int, figure: str) -> bool:
    """Within 1.5% of a published figure in billions, or within one unit of its
    last digit: vendors round or cut their figures (Qwen3-30B-A3B's 3.35B active
    is published as 3.3B)."""
    value = float(figure) * 1e9
    unit = 10 ** -len(figure.partition(".")[2]) * 1e9
    return abs(count - value) <= max(0.015 * value, unit)


@pytest.mark.parametrize(
    "name, total, active_figure",
    [
        ("llama3-70b", "70.6", None),  # Meta's model card: 70.6B
        ("llama2-70b", "69.0", None),
        ("qwen2.5-72b", "72.7", None),  # Qwen's model card: 72.7B
        ("mistral-7b", "7.24", None),
        ("codellama-34b", "33.7", None),
        ("mixtral-8x7b", "46.7", "12.9"),  # Mistral's release: 46.7B total, 12.9B per token
        ("qwen3-30b-a3b", "30.5", "3.3"),  # Qwen's model card: 30.5B, 3.3B activated
    ],
)
def test_each_entry_has_its_published_parameter_count(name, total, active_figure):
    spec = resolve_model(name).spec()
    assert near_published(spec.num_params, total), spec.num_params
    assert near_published(active(spec), active_figure or total), active(spec)
    assert spec.weight_bytes("bfloat16") == 2 * spec.num_params


@pytest.mark.parametrize(
    "config, total, active_figure",
    [(QWEN2_MOE, "14.3", "2.7"), (DEEPSEEK_MOE, "16.4", "2.8")],  # their model cards
    ids=["qwen1.5-moe-a2.7b", "deepseek-moe-16b"],
)
def test_shared_experts_and_dense_first_layers_count_as_published(config, total, active_figure):
    spec = ModelSpec.from_hf_config(config)
    assert near_published(spec.num_params, total), spec.num_params
    assert near_published(active(spec), active_figure), active(spec)


def transformers_counts(hf_config: dict) -> tuple[int, int]:
    """(all weights, the weights one token uses) of transformers' own model of this
    config, built on the meta device (no memory), less what ModelSpec leaves out
    (attention biases, Qwen3's per-head q/k norms, Qwen2-MoE's shared-expert gate)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    left_out = ("bias", "q_norm.weight", "k_norm.weight", "shared_expert_gate.weight")
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    total = used = 0
    for name, p in model.named_parameters():
        if name.endswith(left_out):
            continue
        total += p.numel()
        # routed experts are one tensor per layer, experts first: a token uses top-k of them
        share = config.num_experts_per_tok / experts if ".mlp.experts." in name else 1
        used += int(p.numel() * share)
    return total, used


@pytest.mark.parametrize("name", [*NEW_MODELS, "llama3-8b", "qwen2.5-7b"])
def test_the_counts_are_transformers_own_module_sizes(name):
    model = resolve_model(name)
    spec = model.spec()
    total, used = transformers_counts(dict(model.hf_config))
    assert spec.num_params == total
    # what a token uses, the final norm's weights aside
    assert active(spec) + spec.hidden_size == used


def test_qwen2_moe_shared_experts_count_as_transformers_builds_them():
    spec = ModelSpec.from_hf_config(QWEN2_MOE)
    total, used = transformers_counts(QWEN2_MOE)
    assert (spec.num_params, active(spec) + spec.hidden_size) == (total, used)


def test_the_moe_fields_of_each_family():
    mixtral = resolve_model("mixtral-8x7b").spec()
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size == 14336  # Mixtral's rule
    assert (mixtral.num_moe_layers, mixtral.shared_expert_intermediate_size) == (32, 0)
    qwen3 = resolve_model("qwen3-30b-a3b").spec()
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.moe_intermediate_size) == (
        128,
        8,
        768,
    )
    assert qwen3.expert_params == 3 * 2048 * 768
    assert qwen3.dense_mlp_params == 3 * 2048 * 6144  # in its config, used by no layer
    qwen2 = ModelSpec.from_hf_config(QWEN2_MOE)
    assert qwen2.shared_expert_intermediate_size == 5632
    deepseek = ModelSpec.from_hf_config(DEEPSEEK_MOE)
    assert deepseek.shared_expert_intermediate_size == 2 * 1408  # n_shared_experts x width
    assert (deepseek.first_dense_layers, deepseek.num_moe_layers) == (1, 27)
    assert not resolve_model("llama3-70b").spec().is_moe and mixtral.is_moe


def test_an_moe_layer_holds_every_expert_and_a_token_uses_its_top_k():
    spec = ModelSpec.from_hf_config(DEEPSEEK_MOE)
    h, width = spec.hidden_size, spec.moe_intermediate_size
    attention = spec.attention_params_per_layer
    router, shared, norms = h * 64, 3 * h * 2 * width, 2 * h
    assert spec.params_per_layer == attention + 64 * 3 * h * width + router + shared + norms
    dense_layer = attention + 3 * h * spec.intermediate_size + norms
    token_layer = attention + 6 * 3 * h * width + router + shared + norms
    head = spec.vocab_size * h
    assert spec.matmul_params == dense_layer + 27 * token_layer + head
    assert spec.num_params == dense_layer + 27 * spec.params_per_layer + 2 * head + h


def test_a_dense_model_multiplies_through_every_weight():
    spec = resolve_model("llama3-70b").spec()
    assert spec.num_moe_layers == 0 and spec.expert_params == 0
    assert spec.params_per_layer == spec.dense_layer_params
    embed = spec.vocab_size * spec.hidden_size
    assert spec.matmul_params + embed + spec.hidden_size == spec.num_params


def test_the_kv_cache_per_token_follows_the_kv_heads_alone():
    """Mixtral's KV per token is Mistral 7B's (same attention), whatever its experts."""
    mixtral, mistral = (resolve_model(n).spec() for n in ("mixtral-8x7b", "mistral-7b"))
    assert mixtral.kv_bytes_per_token("bfloat16") == mistral.kv_bytes_per_token("bfloat16")
    assert mixtral.kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2


def test_a_model_cut_to_its_dense_first_layers_is_still_a_shape():
    spec = ModelSpec.from_hf_config({**DEEPSEEK_MOE, "num_hidden_layers": 1})
    assert (spec.first_dense_layers, spec.num_moe_layers) == (1, 0)
    assert spec.num_params == spec.dense_layer_params + 2 * spec.vocab_size * 2048 + 2048


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [0, 5]}, r"mlp_only_layers=\[0, 5\]"),
        ({"num_experts_per_tok": None}, "lacks field 'num_experts_per_tok'"),
        ({"num_experts_per_tok": 61}, "num_experts_per_tok=61 is not in 1..num_experts=60"),
    ],
)
def test_an_moe_layout_not_modelled_is_refused_naming_the_field(changes, message):
    config = {k: v for k, v in {**QWEN2_MOE, **changes}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(config, name="mine")


def test_deepseeks_experts_every_other_layer_are_refused():
    with pytest.raises(ValueError, match="moe_layer_freq=2"):
        ModelSpec.from_hf_config({**DEEPSEEK_MOE, "moe_layer_freq": 2})


def test_mla_attention_is_refused_naming_the_field():
    config = {**DEEPSEEK_MOE, "model_type": "deepseek_v2", "kv_lora_rank": 512}
    with pytest.raises(ValueError, match="kv_lora_rank=512 means MLA attention"):
        ModelSpec.from_hf_config(config, name="deepseek-v2-lite")


def test_stray_expert_fields_on_a_dense_shape_are_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok is set but num_experts is 0"):
        ModelSpec("x", 2, 64, 4, 2, 16, 256, 100, num_experts_per_tok=2)


@pytest.mark.parametrize("name", NEW_MODELS)
def test_each_entry_composes_as_a_run_reads_it(name):
    cfg = compose_config([f"model={name}"])
    assert cfg.model.dtype == "bfloat16"
    assert model_spec(cfg.model) == resolve_model(name).spec()


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_the_real_engine_refuses_an_moe_model_naming_it(name):
    from testbed.engine.model_config import ModelConfig

    with pytest.raises(InputError, match=f"model={name}: .* is a mixture-of-experts model"):
        ModelConfig.of(resolve_model(name))
    # without its architectures field the engine would have taken it for a dense Llama
    config = {k: v for k, v in resolve_model(name).hf_config.items() if k != "architectures"}
    with pytest.raises(InputError, match="MoE models are simulated only"):
        ModelConfig.from_hf(config, source=name)


def test_an_moe_model_in_mode_real_is_refused_before_it_runs(tmp_path):
    from testbed.job import run_from_config

    overrides = ["model=qwen3-30b-a3b", "trace.num_requests=2", "logging=disabled"]
    cfg = compose_config(["mode=real", *overrides])
    with pytest.raises(InputError, match="MoE models are simulated only \\(mode=sim\\)"):
        run_from_config(cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.json").exists()
