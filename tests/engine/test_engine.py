"""The real engine under the shared scheduler: batch invariance, prefix caching, bad input."""

from __future__ import annotations

import os
import random

import pytest

from testbed.core import SamplingParams
from testbed.engine.llm import LLM
from testbed.models import models_dir

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int = 8, seed: int = 0, shared: int = 24) -> list[list[int]]:
    """Prompts of mixed lengths; half share a prefix of ``shared`` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 32000) for _ in range(shared)]
    out = []
    for i in range(n):
        body = [rng.randrange(3, 32000) for _ in range(rng.randint(3, 40))]
        out.append(prefix + body if i % 2 else body)
    return out


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each prompt's greedy output computed alone, on a roomy engine."""
    llm = LLM("dummy-llama", num_kv_blocks=64, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts()]


@pytest.mark.parametrize(
    "policy", ["fcfs", "sjf", "srpt", "mlfq", {"name": "fcfs", "victim": "least_computed"}], ids=str
)
def test_batch_invariance_under_chunking_caching_and_preemption(alone, policy):
    # 24 blocks of 4 tokens cannot hold all eight requests at once: preemption.
    llm = LLM(
        "dummy-llama",
        policy=policy,
        num_kv_blocks=24,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=6,
    )
    outs = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.stats.hits > 0


def test_requests_hitting_blocks_computed_in_their_own_step_read_them(alone):
    """All eight prompts join the first step; those after the first with the
    shared prefix hit the blocks the first computes in that very step (as in
    vLLM: each layer writes the step's KV before attention reads it)."""
    llm = LLM("dummy-llama", num_kv_blocks=256, block_size=4, max_num_batched_tokens=512)
    sched = llm.engine.scheduler
    schedule, steps = sched.schedule, []

    def recording(now):
        out = schedule(now)
        steps.append((len(out.new_req_ids), out.context_lens[:]))
        return out

    sched.schedule = recording
    outs = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == alone
    admitted, contexts = steps[0]
    assert admitted == 8
    assert sum(1 for c in contexts if c > 0) == 3  # prompts 3, 5, 7 hit prompt 1's prefix
    assert sched.kv.stats.hits == 3 * 24 and sched.num_preemptions == 0


def test_prefix_caching_on_and_off_agree_and_on_computes_less():
    ps = prompts(shared=48)
    runs = {}
    for on in (True, False):
        llm = LLM("dummy-llama", enable_prefix_caching=on, num_kv_blocks=128, max_num_seqs=1)
        runs[on] = (
            [o.token_ids for o in llm.generate(ps, GREEDY)],
            llm.executor.num_computed_tokens,
        )
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] < runs[False][1] - 100  # three shared 48-token prefixes reused


def test_bad_input_is_rejected_with_reasons_and_the_rest_is_served():
    llm = LLM("dummy-llama", num_kv_blocks=64, max_model_len=64)
    good = [5, 6, 7]
    outs = llm.generate([good, [], list(range(3, 100)), [1, 2, 40000], good], GREEDY)
    assert outs[0].token_ids == outs[4].token_ids and len(outs[0].token_ids) == 12
    assert outs[1].finish_reason == "empty prompt"
    assert "exceeds max_model_len=64" in outs[2].finish_reason
    assert outs[3].finish_reason == "token id 40000 outside the vocabulary of 32000"
    assert outs[1].token_ids == outs[2].token_ids == outs[3].token_ids == []


def test_token_ids_must_be_integers():
    llm = LLM("dummy-llama", num_kv_blocks=64, max_model_len=64)
    with pytest.raises(TypeError, match=r"prompt token 1 is 1\.9 \(float\): token ids must be"):
        llm.generate([[5, 1.9, 7]], GREEDY)
    with pytest.raises(TypeError, match=r"prompt token 0 is '5' \(str\)"):
        llm.generate([["5", 6]], GREEDY)
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 12


def test_missing_and_malformed_checkpoints_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an HF folder nor a config"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed JSON"):
        LLM(str(tmp_path))
    from tests.engine.helpers import write_hf_model

    write_hf_model("llama", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        LLM(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="checkpoint file"):
        LLM(str(tmp_path))


def test_sampling_is_seeded_per_request_and_independent_of_the_batch():
    llm = LLM("dummy-llama", num_kv_blocks=64)
    sp = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, max_tokens=10, seed=7, ignore_eos=True
    )
    together = llm.generate(prompts(4), sp)
    again = llm.generate(prompts(4)[2:3], sp)
    assert together[2].token_ids == again[0].token_ids
    assert together[0].token_ids != llm.generate(prompts(4)[:1], GREEDY)[0].token_ids


def test_the_shared_tinystories_model_writes_llama2cs_greedy_reference():
    folder = models_dir() / "stories260K" / "hf"
    if not (folder / "model.safetensors").exists():
        pytest.skip(f"stories260K not found at {folder} (set TESTBED_MODELS_DIR)")
    llm = LLM(str(folder), num_kv_blocks=64)
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=200))[0]
    reference = (models_dir() / "stories260K" / "llama2c" / "greedy_reference.txt").read_text()
    assert len(out.token_ids) == 200 and out.text.strip() == reference.strip()


def test_offline_api_as_users_know_it():
    from testbed import LLM as PublicLLM
    from testbed import SamplingParams as PublicParams

    llm = PublicLLM("dummy-llama", num_kv_blocks=32, max_num_seqs=4)
    outs = llm.generate(
        [[5, 6, 7], [8, 9]],
        [PublicParams(temperature=0, max_tokens=3), PublicParams(temperature=0, max_tokens=5)],
    )
    assert [len(o.token_ids) for o in outs] == [3, 5] and outs[0].text is None
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([[1], [2]], [PublicParams()])
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.generate(["hello"])


def test_text_prompts_with_the_models_tokenizer():
    folder = models_dir() / "stories260K" / "hf"
    if not (folder / "tokenizer.json").exists():
        pytest.skip(f"stories260K not found at {folder} (set TESTBED_MODELS_DIR)")
    llm = LLM(str(folder), num_kv_blocks=64)
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.prompt_token_ids[:2] == llm.tokenizer.encode("Once upon a time")[:2]
    assert len(out.text) > 20


def test_a_model_named_by_its_config_has_its_folders_tokenizer():
    folder = models_dir() / "stories260K" / "hf"
    if not (folder / "tokenizer.json").exists():
        pytest.skip(f"stories260K not found at {folder} (set TESTBED_MODELS_DIR)")
    by_name = LLM("tinystories-260k", num_kv_blocks=64)
    assert by_name.tokenizer is not None
    out = by_name.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8))[0]
    by_path = LLM(str(folder), num_kv_blocks=64)
    again = by_path.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.text and out.text == again.text


def test_threads_option_sets_torchs_cpu_threads_and_rejects_nonsense():
    import torch

    before = torch.get_num_threads()
    try:
        llm = LLM("dummy-llama", num_kv_blocks=16, threads=1, device="cpu")
        assert torch.get_num_threads() == 1
        assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == GREEDY.max_tokens
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            LLM("dummy-llama", num_kv_blocks=16, threads=0, device="cpu")
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning needs Linux")
def test_cpus_option_pins_the_process_and_names_missing_cores():
    before = os.sched_getaffinity(0)
    core = min(before)
    try:
        llm = LLM("dummy-llama", num_kv_blocks=16, cpus=[core], device="cpu")
        assert os.sched_getaffinity(0) == {core}
        assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == GREEDY.max_tokens
        missing = (os.cpu_count() or 1) + 3
        with pytest.raises(ValueError, match=rf"cores \[{missing}\] do not exist"):
            LLM("dummy-llama", num_kv_blocks=16, cpus=[core, missing], device="cpu")
        for bad in ([], 1, ["0"]):
            with pytest.raises(ValueError, match="non-empty list of core numbers"):
                LLM("dummy-llama", num_kv_blocks=16, cpus=bad, device="cpu")
        assert os.sched_getaffinity(0) == {core}  # a rejected list changes nothing
    finally:
        os.sched_setaffinity(0, before)
