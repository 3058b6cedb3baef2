"""The named experiments (``python run.py -m +experiment=<name>``): every value
each one sweeps makes a valid run config."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf

from testbed.config_schema import compose_config, validate
from testbed.models import PROJECT_ROOT

EXPERIMENTS = sorted(p.stem for p in (PROJECT_ROOT / "conf" / "experiment").glob("*.yaml"))


def sweeper(name: str) -> dict:
    text = (PROJECT_ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()
    return yaml.safe_load(text).get("hydra", {}).get("sweeper", {})


def sweep_params(name: str) -> dict[str, list[str]]:
    return {k: str(v).split(",") for k, v in sweeper(name)["params"].items()}


# Experiments that sweep a grid of values (Hydra's basic sweeper); the others run a
# sweeper of their own (the deployment search: tests/search), and must compose.
GRIDS = [name for name in EXPERIMENTS if "params" in sweeper(name)]


def test_the_documented_experiments_exist():
    assert {"policy_comparison", "latency_throughput", "sim_vs_real", "disaggregation"} <= set(
        EXPERIMENTS
    )
    readme = (PROJECT_ROOT / "README.md").read_text()
    for name in EXPERIMENTS:
        assert f"+experiment={name}" in readme, f"README: no line for {name}"


@pytest.mark.parametrize("name", sorted(set(EXPERIMENTS) - set(GRIDS)))
def test_an_experiment_with_its_own_sweeper_composes_and_validates(name):
    validate(compose_config([f"+experiment={name}"]))


@pytest.mark.slow
@pytest.mark.parametrize("name", GRIDS)
def test_every_swept_value_composes_and_validates(name):
    params = sweep_params(name)
    assert params, f"{name} sweeps nothing"
    # each value of each key at least once, beside the first of the others
    for key, values in params.items():
        for value in values:
            chosen = {k: v[0] for k, v in params.items()} | {key: value}
            cfg = compose_config([f"+experiment={name}", *(f"{k}={v}" for k, v in chosen.items())])
            validate(cfg)
            got = OmegaConf.select(cfg, key) if "." in key else cfg[key]
            got = got.get("name", got) if hasattr(got, "get") else got
            typed = yaml.safe_load(value) == got  # trace.rate=4 is 4.0, a float field
            assert str(got) == value or typed or key in ("trace", "cluster"), (key, value, got)


def test_policy_comparison_sweeps_every_bundled_policy_with_seeds_and_loads():
    from policies import REGISTRY

    params = sweep_params("policy_comparison")
    assert set(params["policy"]) == set(REGISTRY)
    assert len(params["seed"]) >= 3
    loads = [float(x) for x in params["load"]]
    assert min(loads) == 0.2 and max(loads) == 1.2
    cfg = compose_config(["+experiment=policy_comparison", "trace=azure_conv_tenants"])
    assert (cfg.trace.name, cfg.trace.num_tenants, cfg.trace.priority_classes) == (
        "azure_conv",
        4,
        3,
    )
    assert cfg.trace.seed == cfg.seed  # the seed draws the tenants and classes


@pytest.mark.slow
def test_the_readmes_policy_sweep_shows_policies_that_differ(tmp_path):
    """The README's sweep of policies x traces (on the traces' first 400 requests):
    under each trace every policy's row differs from the others', and each row
    counts its rejected requests."""
    import re

    from tests.sim.helpers import run
    from traces import traces_dir

    readme = (PROJECT_ROOT / "README.md").read_text()
    command = re.search(r"# 2\. A sweep.*?\n(python run\.py -m .*?)\n\n", readme, re.S).group(1)
    args = command.replace("\\\n", " ").split()[3:]  # after "python run.py -m"
    sweep = {k: v.split(",") for k, v in (a.split("=", 1) for a in args) if "," in v}
    fixed = [a for a in args if "," not in a and not a.startswith("logging")]
    assert set(sweep) == {"policy", "trace"}
    if not (traces_dir() / "azure_llm_2023").exists():
        pytest.skip(f"shared traces not found under {traces_dir()}")
    for trace in sweep["trace"]:
        rows = {}
        for policy in sweep["policy"]:
            picked = [f"policy={policy}", f"trace={trace}", "trace.num_requests=400"]
            m = run(tmp_path, *fixed, *picked, "capacity_cache=null", name=f"{trace}-{policy}")
            assert "num_rejected" in m
            rows[policy] = (m["ttft_s_p50"], m["e2e_s_mean"], m["tenant_ttft_jain"])
        assert len(set(rows.values())) == len(rows), (trace, rows)
