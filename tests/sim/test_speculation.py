"""Speculative decoding in the simulator: the acceptance model, its table, and
the same results with the fast path on and off."""

from __future__ import annotations

import math
import random
import re

import pandas as pd
import pytest

from policies import make_policy
from testbed.core import KVCacheManager, Scheduler, SchedulerConfig
from testbed.core.engine import EngineCore
from testbed.errors import InputError
from testbed.job import run_from_config
from testbed.models import PROJECT_ROOT
from testbed.sim.acceptance import AcceptanceModel
from testbed.sim.executor import SimExecutor
from testbed.sim.simulator import Simulation
from tests.sim.helpers import compose_cfg, latency_model, observable, random_requests


def write_table(path, rows, header="position,proposal_rate,acceptance_rate"):
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return path


def test_a_table_gives_each_positions_rates_and_nothing_past_its_rows(tmp_path):
    path = write_table(tmp_path / "t.csv", ["0,0.5,0.8", "1,1,0.25"])
    model = AcceptanceModel.from_csv(path, k=3)
    assert model.proposal_rates == [0.5, 1.0, 0.0] and model.acceptance_rates == [0.8, 0.25, 0.0]
    rng = random.Random(0)
    lengths = [model.num_drafts(rng, 3) for _ in range(4000)]
    assert max(lengths) == 2 and abs(lengths.count(0) / 4000 - 0.5) < 0.03
    assert model.num_drafts(rng, 0) == 0
    accepted = [model.num_accepted(rng, 2) for _ in range(4000)]
    assert abs(accepted.count(0) / 4000 - 0.2) < 0.03  # first rejected: 1 - 0.8
    assert abs(accepted.count(2) / 4000 - 0.8 * 0.25) < 0.03


@pytest.mark.parametrize(
    "rows, header, message",
    [
        (["0,0.5,0.8", "2,1,0.25"], None, "line 3: position=2, expected 1"),
        (["0,0.5,high"], None, "line 2: acceptance_rate='high' is not a number"),
        (["0,1.5,0.8"], None, "line 2: proposal_rate=1.5 is not in"),
        (["0,0.8"], "position,acceptance_rate", "needs the column(s) proposal_rate"),
    ],
)
def test_a_bad_table_is_refused_naming_file_line_and_field(tmp_path, rows, header, message):
    path = write_table(tmp_path / "bad.csv", rows, *([header] if header else []))
    with pytest.raises(InputError, match=r"bad\.csv") as err:
        AcceptanceModel.from_csv(path, k=2)
    assert message in str(err.value)


def simulate_spec(requests, fast_forward, acceptance):
    lat = latency_model()

    def make_engine(i, clock):
        cfg = SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=64,
            max_model_len=8192,
            num_speculative_tokens=acceptance.k,
        )
        sched = Scheduler(cfg, KVCacheManager(4000, 16, True), make_policy("fcfs"))
        return EngineCore(sched, SimExecutor(lat, acceptance, seed=i), clock)

    sim = Simulation(requests, make_engine, lat, fast_forward=fast_forward, keep_tokens=True)
    return sim.run()


def test_speculation_gives_the_same_results_with_the_fast_path_on_and_off():
    """The fast path steps every step while requests speculate."""
    model = AcceptanceModel([1.0, 0.9, 0.8], [0.7, 0.6, 0.5], "test")
    fast = simulate_spec(random_requests(120), True, model)
    slow = simulate_spec(random_requests(120), False, model)
    assert observable(fast.requests) == observable(slow.requests)
    assert fast.steps.to_frame().equals(slow.steps.to_frame())
    assert sum(r.num_accepted_tokens for r in fast.requests) > 0


def test_a_simulation_reproduces_the_rates_of_the_table_it_reads(tmp_path):
    """A table in, a simulation, the table it measured out: each rate within four
    standard errors of the one it read."""
    path = write_table(tmp_path / "t.csv", ["0,0.6,0.7", "1,0.9,0.5", "2,0.8,0.4"])
    overrides = [
        "mode=sim",
        "trace.num_requests=300",
        "logging=disabled",
        "progress=false",
        "engine.speculative.method=ngram",
        "engine.speculative.num_speculative_tokens=3",
        f"engine.speculative.acceptance_table={path}",
    ]
    run_from_config(compose_cfg(*overrides), tmp_path / "run")
    out = pd.read_csv(tmp_path / "run" / "spec_acceptance.csv")
    for k, (p, a) in enumerate([(0.6, 0.7), (0.9, 0.5), (0.8, 0.4)]):
        row = out.iloc[k]
        assert abs(row.proposal_rate - p) < 4 * math.sqrt(p * (1 - p) / row.offered), row
        assert abs(row.acceptance_rate - a) < 4 * math.sqrt(a * (1 - a) / row.verified), row


def test_engine_speculative_is_checked_at_start_naming_the_field(tmp_path):
    bad = ["mode=sim", "engine.speculative.method=ngram", "engine.speculative.prompt_lookup_min=0"]
    with pytest.raises(InputError, match=r"engine\.speculative\.prompt_lookup_min"):
        run_from_config(compose_cfg(*bad), tmp_path / "run")
    with pytest.raises(InputError, match="acceptance_table=auto: no table at"):
        auto = [
            "mode=sim",
            "engine.speculative.method=ngram",
            "engine.speculative.acceptance_table=auto",
        ]
        run_from_config(compose_cfg(*auto, "logging=disabled"), tmp_path / "run2")


def test_the_proposers_time_is_fitted_per_step_and_per_request():
    from testbed.core.spec_stats import ProposerTime

    t = ProposerTime()
    for n in (1, 2, 4, 8, 8, 3):
        t.observe(n, 0.002 + 0.0005 * n)
    t.observe(0, 0.001)  # a step without drafting: only in the total
    per_step, per_request = t.fit()
    assert per_step == pytest.approx(0.002) and per_request == pytest.approx(0.0005)
    assert t.total_s == pytest.approx(0.001 + sum(0.002 + 0.0005 * n for n in (1, 2, 4, 8, 8, 3)))
    flat = ProposerTime()
    for n in (1, 2, 4):
        flat.observe(n, 0.003 - 0.0001 * n)  # falling with n: a constant, never negative
    a, b = flat.fit()
    assert b == 0.0 and a == pytest.approx(0.003 - 0.0001 * 7 / 3)


class VerifyingLatency:
    """A latency model whose steps cost 1 s more per request verifying drafts."""

    def __init__(self, base) -> None:
        self.base, self.kind, self.source = base, base.kind, base.source

    def predict(self, *features):
        return self.base.predict(*features)

    def predict_many(self, *features):
        return self.base.predict_many(*features)

    def verification_s(self, n):
        return 1.0 * n


def test_steps_verifying_drafts_cost_what_the_latency_model_charges_per_request():
    from testbed.sim.run_speed import predict_logged_steps

    model = AcceptanceModel([1.0, 0.9, 0.8], [0.7, 0.6, 0.5], "test")
    lat = VerifyingLatency(latency_model())

    def make_engine(i, clock):
        cfg = SchedulerConfig(
            max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=8192,
            num_speculative_tokens=model.k,
        )  # fmt: skip
        sched = Scheduler(cfg, KVCacheManager(4000, 16, True), make_policy("fcfs"))
        return EngineCore(sched, SimExecutor(lat, model, seed=i), clock)

    result = Simulation(random_requests(40), make_engine, lat, fast_forward=False).run()
    steps = result.steps.to_frame()
    busy = steps[steps.num_reqs > 0]
    base = predict_logged_steps(lat.base, busy.drop(columns="num_spec_reqs"))
    extra = busy.latency_s.to_numpy() - base
    assert (busy.num_spec_reqs > 0).sum() > 50
    assert extra == pytest.approx(busy.num_spec_reqs.to_numpy(float), abs=1e-9)
    # A real run's steps are predicted the same way (speed_vs_profile).
    assert predict_logged_steps(lat, busy) == pytest.approx(busy.latency_s.to_numpy(), abs=1e-9)


def write_draft_profile(path):
    """A profile table of a draft whose passes cost 1 ms + 10 us per token."""
    lines = ["kind,grid,num_reqs,num_tokens,attn_pairs,kv_tokens,max_kv,latency_s"]
    for reqs in (1, 2, 4, 8, 16, 32):
        for tokens_per in (1, 16):
            for ctx in (64, 512):
                t = reqs * tokens_per
                kv = reqs * (ctx + tokens_per)
                lat = 1e-3 + 1e-5 * t
                lines.append(f"step,point,{reqs},{t},{kv * tokens_per},{kv},{ctx},{lat}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def test_a_draft_models_passes_cost_what_its_own_profile_says(tmp_path):
    """``engine.speculative.draft_profile=auto`` finds the profile of the target
    cut to ``draft_num_layers`` layers (``<model>.first<N>.csv``), and the passes it
    predicts lengthen the run; ``null`` leaves them out; a missing path is refused."""
    write_draft_profile(tmp_path / "profiles" / "cpu" / "dummy-llama.first1.csv")
    base = [
        "mode=sim", "trace.num_requests=60", "logging=disabled", "progress=false",
        f"profiles_dir={tmp_path / 'profiles'}", "engine.speculative.method=draft_model",
        "engine.speculative.model=dummy-llama", "engine.speculative.draft_num_layers=1",
        "engine.speculative.num_speculative_tokens=3", "engine.speculative.acceptance_rate=0.6",
    ]  # fmt: skip
    with_draft = run_from_config(compose_cfg(*base), tmp_path / "with")
    assert "dummy-llama.first1.csv" in with_draft["spec_draft_latency_model"]
    without = run_from_config(
        compose_cfg(*base, "engine.speculative.draft_profile=null"), tmp_path / "without"
    )
    assert "spec_draft_latency_model" not in without
    steps = {n: pd.read_csv(tmp_path / n / "steps.csv") for n in ("with", "without")}
    # Each busy step runs at least one 1 ms pass of the draft, at most k = 3.
    mean = {n: s.latency_s[s.num_reqs > 0].mean() for n, s in steps.items()}
    assert 1e-3 < mean["with"] - mean["without"] < 3.5e-3
    with pytest.raises(InputError, match=r"draft_profile=nowhere\.csv: no such file"):
        run_from_config(
            compose_cfg(*base, "engine.speculative.draft_profile=nowhere.csv"), tmp_path / "bad"
        )


def test_a_missing_draft_model_is_refused_in_one_line_the_same_in_both_modes(tmp_path):
    """``run.py`` in ``mode=sim`` and ``mode=real`` refuses a draft model that does
    not exist with the same one-line message and exit status 2 (the real engine
    used to end in a FileNotFoundError's traceback, exit 1)."""
    import os
    import subprocess
    import sys

    from testbed.models import PROJECT_ROOT

    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    errors = {}
    for mode in ("sim", "real"):
        cmd = [
            sys.executable, str(PROJECT_ROOT / "run.py"), f"mode={mode}",
            "engine.speculative.method=draft_model",
            f"engine.speculative.model={tmp_path / 'nowhere'}",
            "trace.num_requests=5", "logging=disabled", f"hydra.run.dir={tmp_path / mode}",
        ]  # fmt: skip
        res = subprocess.run(
            cmd, capture_output=True, text=True, env={**env, "TESTBED_NO_BOOTSTRAP": "1"}
        )
        assert res.returncode == 2, res.stderr
        errors[mode] = res.stderr.strip()
    assert errors["sim"] == errors["real"]
    assert errors["sim"].startswith("Error: engine.speculative.model: model ")
    assert "nowhere" in errors["sim"] and "\n" not in errors["sim"]


@pytest.mark.parametrize(
    "draft, message",
    [
        (["engine.speculative.model=SMALL_VOCAB"], r"vocabulary \(512\) is not the target's"),
        (
            ["engine.speculative.model=dummy-llama", "engine.speculative.draft_num_layers=9"],
            r"engine\.speculative\.draft_num_layers: 9, but dummy-llama has 4 layers",
        ),
    ],
)
def test_a_draft_that_cannot_draft_for_the_target_is_refused_as_the_real_engine_does(
    tmp_path, draft, message
):
    """A run of either mode makes the real engine's check of the draft
    (resolve_draft) before anything else: a draft of another vocabulary or with fewer layers than
    asked is refused in the engine's words, the field named as in the config."""
    import json

    from testbed.build import draft_model
    from testbed.job import run_from_config
    from testbed.models import model_entry

    small = tmp_path / "small"
    small.mkdir()
    shape = {**model_entry("dummy-llama")["hf_config"], "vocab_size": 512}
    (small / "config.json").write_text(json.dumps(shape))
    draft = [d.replace("SMALL_VOCAB", str(small)) for d in draft]
    cfg = compose_cfg(
        "mode=sim", "engine.speculative.method=draft_model",
        "engine.speculative.acceptance_rate=0.5", *draft,
    )  # fmt: skip
    with pytest.raises(InputError, match=message):
        draft_model(cfg)
    with pytest.raises(InputError, match=message):  # a run checks it before anything else
        run_from_config(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_simulated_speculation_needs_a_measured_table_or_a_given_rate(tmp_path):
    """Without an acceptance table or rate a simulation with speculation is
    refused, saying how to measure one (it used to accept 0.7 of the drafts of
    any method, unasked); both at once are refused too; a rate given is named as
    given in metrics.json and the summary."""
    from testbed.build import acceptance_model, model_spec

    for i, method in enumerate((["engine.speculative.method=ngram"], DUMMY_SELF_DRAFT)):
        cfg = compose_cfg("mode=sim", *method)
        with pytest.raises(InputError, match="needs an acceptance model, and has no default"):
            acceptance_model(cfg, model_spec(cfg.model))
        with pytest.raises(InputError, match=r"spec_acceptance\.csv in its run directory"):
            run_from_config(cfg, tmp_path / f"refused{i}")
    both = compose_cfg(
        "mode=sim", "engine.speculative.method=ngram", "engine.speculative.acceptance_rate=0.5",
        f"engine.speculative.acceptance_table={tmp_path / 't.csv'}",
    )  # fmt: skip
    with pytest.raises(InputError, match="give one"):
        acceptance_model(both, model_spec(both.model))
    given = compose_cfg(
        "mode=sim", "engine.speculative.method=ngram", "engine.speculative.acceptance_rate=0.25",
        "trace.num_requests=10", "logging=disabled", "progress=false", "plots=false",
    )  # fmt: skip
    metrics = run_from_config(given, tmp_path / "given")
    assert metrics["spec_acceptance_model"] == "acceptance_rate=0.25 at each of 3 positions (given)"


DUMMY_SELF_DRAFT = [
    "engine.speculative.method=draft_model",
    "engine.speculative.model=dummy-llama",
    "engine.speculative.draft_num_layers=1",
]


def test_auto_takes_a_draft_models_table_named_after_the_draft(tmp_path, capsys):
    """``acceptance_table=auto`` for a draft model reads
    ``<model>.spec.draft_model.<draft>.csv`` (another draft accepts differently:
    a table named after the method alone is not taken), its ``#`` lines kept as
    how it was measured and shown in metrics.json; the summary names the table."""
    profiles = tmp_path / "profiles" / "cpu"
    profiles.mkdir(parents=True)
    write_table(profiles / "dummy-llama.spec.draft_model.csv", ["0,1,0.9"])
    base = [
        "mode=sim", f"profiles_dir={tmp_path / 'profiles'}", *DUMMY_SELF_DRAFT,
        "engine.speculative.acceptance_table=auto", "engine.speculative.draft_profile=null",
        "trace.num_requests=10", "logging=disabled", "progress=false", "plots=false",
    ]  # fmt: skip
    named = profiles / "dummy-llama.spec.draft_model.dummy-llama.first1.csv"
    with pytest.raises(InputError, match=re.escape(f"no table at {named}")):
        run_from_config(compose_cfg(*base), tmp_path / "missing")
    named.write_text(
        "# command: python run.py mode=real ...\n# git: abc123\n"
        "position,proposal_rate,acceptance_rate\n0,1,0.5\n1,1,0.5\n2,1,0.5\n"
    )
    capsys.readouterr()
    metrics = run_from_config(compose_cfg(*base), tmp_path / "auto")
    assert metrics["spec_acceptance_model"] == str(named)
    assert metrics["spec_acceptance_table_header"] == [
        "command: python run.py mode=real ...",
        "git: abc123",
    ]
    assert f"speculation: acceptance model   {named}" in capsys.readouterr().out


def test_a_tables_hash_lines_are_its_header_and_count_in_line_numbers(tmp_path):
    path = write_table(tmp_path / "t.csv", ["0,1,0.5", "1,1,x"])
    path.write_text("# measured: here\n#\n" + path.read_text())
    with pytest.raises(InputError, match="line 5: acceptance_rate='x' is not a number"):
        AcceptanceModel.from_csv(path, k=2)
    path.write_text(path.read_text().replace(",x", ",0.25"))
    model = AcceptanceModel.from_csv(path, k=2)
    assert model.header == ["measured: here", ""]
    assert model.acceptance_rates == [0.5, 0.25]


SHIPPED_TABLES = sorted(PROJECT_ROOT.glob("profiles/*/*.spec.*.csv"))


@pytest.mark.parametrize("path", SHIPPED_TABLES, ids=lambda p: p.name)
def test_each_shipped_acceptance_table_says_how_it_was_measured(path):
    """A table beside the profiles is a real run's spec_acceptance.csv with the
    run's command, commit, date and host above it, and its counts agree with its
    rates (the run's own numbers, not typed in)."""
    model = AcceptanceModel.from_csv(path, k=16)
    said = {line.split(":", 1)[0] for line in model.header}
    assert {"command", "git", "date", "host"} <= said
    table = pd.read_csv(path, comment="#")
    assert (table.proposal_rate - table.proposed / table.offered).abs().max() < 1e-5
    assert (table.acceptance_rate - table.accepted / table.verified).abs().max() < 1e-5


@pytest.mark.parametrize(
    "method, table",
    [
        (["engine.speculative.method=ngram"], "tinystories-260k.spec.ngram.csv"),
        (
            [
                "engine.speculative.method=draft_model",
                "engine.speculative.model=tinystories-260k",
                "engine.speculative.draft_num_layers=4",
            ],
            "tinystories-260k.spec.draft_model.tinystories-260k.first4.csv",
        ),
    ],
)
def test_auto_finds_the_shipped_tables_of_stories260k(method, table):
    from testbed.build import acceptance_model, model_spec
    from testbed.models import models_dir

    if not (models_dir() / "stories260K" / "hf" / "config.json").exists():
        pytest.skip(f"stories260K not found in {models_dir()} (set TESTBED_MODELS_DIR)")
    cfg = compose_cfg(
        "mode=sim", "model=tinystories-260k", "hardware=cpu1", *method,
        "engine.speculative.acceptance_table=auto",
    )  # fmt: skip
    model = acceptance_model(cfg, model_spec(cfg.model))
    assert model.source == str(PROJECT_ROOT / "profiles" / "cpu1" / table)
    assert model.k == 3 and all(0 < a < 1 for a in model.acceptance_rates)
