"""Speculative decoding in the real engine: proposers, the rejection sampler, and
greedy outputs equal to those without speculation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from testbed.core import SamplingParams
from testbed.engine.llm import LLM
from testbed.engine.ngram import NgramProposer
from testbed.engine.rejection import RejectionSampler
from testbed.engine.sampler import Sampler
from testbed.engine.spec_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from testbed.models import models_dir

# --- the n-gram proposer ---


def test_ngram_takes_the_longest_suffix_then_its_rightmost_earlier_occurrence():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9 10
    ctx = [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6]
    # Suffix [9, 5, 6] never occurred; [5, 6] did at 0 and 4: the rightmost (4) proposes 8, 2, 9.
    assert p.propose_many([ctx], [3]) == [[8, 2, 9]]
    assert p.propose_many([ctx], [2]) == [[8, 2]]  # at most the limit
    assert p.propose_many([ctx], [0]) == [[]]
    # A longer match wins over a more recent shorter one.
    ctx = [1, 2, 3, 4, 9, 3, 7, 1, 2, 3]
    assert p.propose_many([ctx], [3]) == [[4, 9, 3]]
    # Drafts stop at the end of the context.
    assert p.propose_many([[4, 4]], [3]) == [[4]]


def test_ngram_needs_a_match_of_at_least_the_minimum():
    p = NgramProposer(k=2, min_n=2, max_n=4)
    assert p.propose_many([[1, 2, 3, 4, 5, 1]], [2]) == [[]]  # [1] matches but is too short
    assert p.propose_many([[1, 2, 3, 4, 5, 1, 2]], [2]) == [[3, 4]]


def brute_force_ngram(ctx: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule, spelled out: the longest suffix that occurs earlier, its rightmost occurrence."""
    for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
        suffix = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start : start + n] == suffix:
                return ctx[start + n : start + n + k]
    return []


def test_ngram_matches_the_rule_spelled_out_on_random_contexts():
    rng = random.Random(5)
    p = NgramProposer(k=3, min_n=1, max_n=4)
    for _ in range(1000):
        ctx = [rng.randrange(5) for _ in range(rng.randint(1, 40))]
        assert p.propose_many([ctx], [3]) == [brute_force_ngram(ctx, 3, 1, 4)], ctx


# --- the configuration ---


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
            "num_speculative_tokens",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        (
            {
                "method": "draft_model",
                "num_speculative_tokens": 2,
                "model": "x",
                "draft_num_layers": 0,
            },
            "draft_num_layers",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ],
)
def test_bad_speculative_configs_are_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.of(config)


def test_no_method_is_no_speculation():
    assert SpeculativeConfig.of(None) is None
    assert SpeculativeConfig.of({"method": None, "num_speculative_tokens": 3}) is None
    ngram = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3})
    assert ngram.num_lookahead_tokens == 0 and ngram.prompt_lookup_max == 4


# --- the rejection sampler: the output follows the target's distribution ---

# Chi-square critical value at significance 0.001 for 4 degrees of freedom (5 tokens).
CHI2_CRIT_DF4 = 18.467


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


P = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05], [0.05, 0.10, 0.60, 0.15, 0.10]])
Q = torch.tensor([[0.10, 0.40, 0.10, 0.30, 0.10], [0.20, 0.20, 0.20, 0.20, 0.20]])


def emitted(sampler: RejectionSampler, n: int, draft_probs: bool) -> tuple[np.ndarray, np.ndarray]:
    """First and second emitted tokens over ``n`` verifications of two drafts drawn
    from Q (or proposed without a distribution: then drawn from Q all the same)."""
    params = SamplingParams(temperature=1.0)  # each request its own generator
    rng = torch.Generator().manual_seed(3)
    logits = torch.log(torch.cat([P, P[1:]]))  # position 2 (bonus) as position 1
    first, second = np.zeros(5), np.zeros(5)
    for i in range(n):
        drafts = [int(torch.multinomial(Q[j], 1, generator=rng)) for j in range(2)]
        out = sampler.verify(logits, drafts, f"r{i}", params, Q if draft_probs else None)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


@pytest.mark.parametrize("draft_probs", [True, False], ids=["draft-model", "point-mass"])
def test_sampled_outputs_follow_the_targets_distribution(draft_probs):
    """4,000 verifications: the first token follows P[0] and, after an accepted
    first draft, the second follows P[1] (chi-square at 0.001)."""
    first, second = emitted(RejectionSampler(Sampler(torch.device("cpu"))), 4000, draft_probs)
    assert chi_square(first, P[0].numpy()) < CHI2_CRIT_DF4
    assert second.sum() > 500 and chi_square(second, P[1].numpy()) < CHI2_CRIT_DF4


class SwapsTargetAndDraft(RejectionSampler):
    """A mutation: the rule with p and q swapped (accept with min(1, q / p), the
    residual from q - p)."""

    def verify(self, logits, drafts, request_id, params, draft_probs=None):
        p = torch.softmax(logits, dim=-1)
        as_target = torch.log(torch.cat([draft_probs, draft_probs[-1:]]))
        return super().verify(as_target, drafts, request_id, params, p[:-1])


def test_a_wrong_acceptance_rule_fails_the_same_test():
    first, _ = emitted(SwapsTargetAndDraft(Sampler(torch.device("cpu"))), 4000, True)
    assert chi_square(first, P[0].numpy()) > CHI2_CRIT_DF4


def test_greedy_verification_accepts_while_drafts_equal_the_argmax():
    rs = RejectionSampler(Sampler(torch.device("cpu")))
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 3]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    assert rs.verify(logits, [2, 4, 1], "a", greedy) == [2, 4, 1, 3]  # all + bonus
    assert rs.verify(logits, [2, 5, 1], "a", greedy) == [2, 4]  # second replaced
    assert rs.verify(logits, [0, 4, 1], "a", greedy) == [2]


# --- the engine: greedy outputs with speculation are those without ---


def stories() -> str:
    folder = models_dir() / "stories260K" / "hf"
    if not (folder / "config.json").exists():
        pytest.skip(f"stories260K not found at {folder} (set TESTBED_MODELS_DIR)")
    return str(folder)


def repetitive_prompts(n: int = 10, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats (n-gram lookup finds matches) and a shared prefix."""
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 500) for _ in range(20)]
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, 500) for _ in range(rng.randint(3, 6))]
        body = phrase * rng.randint(2, 4) + [
            rng.randrange(3, 500) for _ in range(rng.randint(0, 9))
        ]
        out.append(shared + body if i % 2 else [1, *body])
    return out


@pytest.fixture(scope="module")
def without_speculation() -> list[list[int]]:
    llm = LLM(stories(), num_kv_blocks=512, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    return [o.token_ids for o in llm.generate(repetitive_prompts(), greedy)]


def proposer(method: str, k: int) -> dict:
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
    # stories260K's first 4 of its 5 layers: a draft that is often, not always, right.
    return {
        "method": "draft_model",
        "model": stories(),
        "num_speculative_tokens": k,
        "draft_num_layers": 4,
    }


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_outputs_with_speculation_are_those_without(without_speculation, method, k):
    """Continuous batching, chunked prefill (a 24-token budget), prefix caching
    and preemption (a cache too small for all ten at once)."""
    llm = LLM(
        stories(),
        num_kv_blocks=60,
        block_size=4,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        speculative_config=proposer(method, k),
    )
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = llm.generate(repetitive_prompts(), greedy)
    assert [o.token_ids for o in outs] == without_speculation
    sched = llm.engine.scheduler
    stats = sched.spec_stats
    assert stats.num_accepted_tokens > 0 and len(stats.drafted_per_pos) == k
    assert sched.num_preemptions > 0 and sched.kv.stats.hits > 0


def test_sampled_requests_with_speculation_are_seeded_per_request():
    """The same request with its seed gives the same tokens whatever its batch."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=32, ignore_eos=True, seed=11)
    prompts = repetitive_prompts(6, seed=1)
    alone = LLM(stories(), speculative_config=spec).generate(prompts[:1], params)[0].token_ids
    llm = LLM(stories(), speculative_config=spec)
    batched = llm.generate(prompts, [params] + [SamplingParams(temperature=1.0, max_tokens=32)] * 5)
    assert batched[0].token_ids == alone
    assert llm.engine.scheduler.spec_stats.num_drafts > 0


def test_the_llm_reports_speculations_acceptance_summed_over_its_generate_calls():
    """LLM.get_metrics: drafts, draft tokens, accepted tokens (in all and per
    position), acceptance rate and mean acceptance length since the LLM was made.
    Two generate calls add up to what a fresh LLM counts for each call's prompts
    (a request's greedy n-gram drafts are its own, whatever else runs); the
    rates follow from the counts; spec_stats is a copy that later calls leave."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = repetitive_prompts(6, seed=3)
    llm = LLM(stories(), speculative_config=spec)
    assert llm.get_metrics()["spec_num_drafts"] == 0
    llm.generate(prompts[:3], greedy)
    first, snapshot = llm.get_metrics(), llm.spec_stats
    llm.generate(prompts[3:], greedy)
    both = llm.get_metrics()
    alone = LLM(stories(), speculative_config=spec)
    alone.generate(prompts[3:], greedy)
    second = alone.get_metrics()
    for key in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"):
        assert first[key] > 0 and both[key] == first[key] + second[key], key
    per_pos = both["spec_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == both["spec_num_accepted_tokens"]
    assert per_pos == [
        a + b
        for a, b in zip(
            first["spec_num_accepted_tokens_per_pos"],
            second["spec_num_accepted_tokens_per_pos"],
            strict=True,
        )
    ]
    accepted = both["spec_num_accepted_tokens"]
    assert both["spec_acceptance_rate"] == accepted / both["spec_num_draft_tokens"]
    assert both["spec_mean_acceptance_length"] == 1 + accepted / both["spec_num_drafts"]
    assert snapshot.num_drafts == first["spec_num_drafts"] < both["spec_num_drafts"]
    plain = LLM(stories())
    plain.generate(prompts[:1], greedy)
    assert plain.get_metrics()["spec_num_draft_tokens"] == 0


def test_a_draft_model_that_is_the_target_drafts_what_the_target_then_accepts():
    """All five layers of stories260K as its own draft: every draft is the target's
    own choice, so (greedy and sampled alike) every draft token is accepted. A
    draft whose KV fell out of step with the target's would not be."""
    spec = {"method": "draft_model", "model": stories(), "num_speculative_tokens": 3}
    for params in (
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
    ):
        llm = LLM(stories(), speculative_config=spec, block_size=4, max_num_batched_tokens=24)
        llm.generate(repetitive_prompts(6, seed=2), params)
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 100
        assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"model": "dummy-llama"}, r"vocabulary \(32000\) is not the target's \(512\)"),
        ({"draft_num_layers": 6}, "draft_num_layers: 6, but"),
    ],
)
def test_a_draft_model_that_cannot_draft_for_the_target_is_refused(spec, message):
    config = {"method": "draft_model", "model": stories(), "num_speculative_tokens": 2} | spec
    with pytest.raises(ValueError, match=message):
        LLM(stories(), speculative_config=config)


def test_a_draft_model_with_a_shorter_context_than_the_target_is_refused(tmp_path):
    import json
    import shutil

    short = tmp_path / "short"
    shutil.copytree(stories(), short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(cfg))
    spec = {"method": "draft_model", "model": str(short), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="context \\(64\\) is shorter than the target's"):
        LLM(stories(), speculative_config=spec)


# --- the draft's cost, as the simulator predicts it ---


def test_a_model_cut_to_its_first_layers_is_the_self_drafts_model():
    """``engine_model(..., num_layers)`` (what the profiler profiles a self-draft
    with) loads the checkpoint's first layers only: the parameters of the draft
    that the target's first layers make (sharing its weights), and nothing else."""
    from testbed.engine.factory import engine_model
    from testbed.engine.weights import build_model

    cfg, folder, name = engine_model(stories(), 4)
    assert name == "hf.first4" and cfg.num_layers == 4
    cpu = torch.device("cpu")
    cut = dict(build_model(cfg, folder, torch.float32, cpu).named_parameters())
    full_cfg, _, _ = engine_model(stories())
    full = dict(build_model(full_cfg, folder, torch.float32, cpu).named_parameters())
    kept = {n for n in full if not n.startswith("model.layers.4.")}
    assert set(cut) == kept and len(kept) < len(full)
    for n, p in cut.items():
        assert torch.equal(p, full[n]), n
    with pytest.raises(ValueError, match=r"num_layers=6 is not in 1\.\.5"):
        engine_model(stories(), 6)


def test_the_simulator_predicts_the_passes_the_draft_model_runs():
    """Every step of a real self-drafting run: the passes the simulator's executor
    predicts from the step's schedule, acceptances and drafts have the features of
    the passes the real proposer ran (chunked prefill, batching, preemption)."""
    from testbed.sim.executor import SimExecutor

    class Recorder:
        kind = source = "recorder"

        def __init__(self):
            self.passes = []

        def predict(self, *features):
            self.passes.append(tuple(float(f) for f in features))
            return 0.0

        def verification_s(self, n):
            self.passes.append(("short queries", n))
            return 0.0

    llm = LLM(
        stories(), num_kv_blocks=60, block_size=4, max_num_batched_tokens=24, max_num_seqs=8,
        speculative_config=proposer("draft_model", 3),
    )  # fmt: skip
    executor = llm.engine.executor
    draft = executor.proposer
    real: list[list[tuple]] = []
    run = draft._run

    def recording_run(rows, short=0):
        pairs = kv = longest = tokens = 0
        for _, toks, first in rows:
            n = len(toks)
            tokens += n
            pairs += n * (first + (n + 1) / 2)
            kv += first + n
            longest = max(longest, first + n)
        real[-1].append((float(len(rows)), float(tokens), float(pairs), float(kv), float(longest)))
        return run(rows, short)

    draft._run = recording_run
    predicted: list[list[tuple]] = []
    execute = executor.execute

    def recording_execute(so):
        real.append([])
        out = execute(so)
        if real[-1]:  # the sync pass's short multi-token queries: the requests that sampled
            real[-1].insert(1, ("short queries", sum(1 for new in out.sampled_token_ids if new)))
        rec = Recorder()
        sim = SimExecutor(rec, draft_latency=rec)
        sim_out = type(out)(
            num_accepted_drafts={
                r.request_id: len(new) - 1
                for r, new in zip(so.requests, out.sampled_token_ids, strict=True)
                if new
            },
            draft_token_ids=out.draft_token_ids or {},
        )
        sim._draft_passes_s(so, sim_out)
        predicted.append(rec.passes)
        return out

    executor.execute = recording_execute
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate(repetitive_prompts(), greedy)
    assert llm.engine.scheduler.num_preemptions > 0
    steps = [p for p in real if p]
    assert len(steps) > 50 and sum(len(p) > 1 for p in steps) > 20
    assert predicted == real
    # The proposer's own log of its passes (a real run's draft speed) says the same.
    logged = [(tuple(float(f) for f in features), short) for features, short in draft.passes]
    flat = [p for step in real for p in step]
    assert [f for f, _ in logged] == [p for p in flat if p[0] != "short queries"]
    assert sum(s for _, s in logged) == sum(p[1] for p in flat if p[0] == "short queries")
