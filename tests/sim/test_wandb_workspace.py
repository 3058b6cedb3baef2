"""The W&B workspace view, built offline (saving it needs an account)."""

from testbed.report.wandb_workspace import COMPARED, main, policy_workspace


def test_the_view_puts_policies_side_by_side_and_against_load(capsys):
    view = policy_workspace("someone", group="sweep-1")
    spec = view._to_model().model_dump(mode="json")
    assert (spec["entity"], spec["project"]) == ("someone", "llm-sched-testbed")
    sections = spec["spec"]["section"]["panel_bank_config"]["sections"]
    assert [s["name"] for s in sections] == ["Policies side by side", "Against load"]
    assert all(len(s["panels"]) == len(COMPARED) for s in sections)
    text = str(spec)
    assert "summary_metrics.ttft_s_p99" in text
    runset = spec["spec"]["section"]["run_sets"][0]
    assert runset["grouping"] == [{"section": "config", "name": "policy.value.name"}]
    assert runset["filters"]["filters"][0]["value"] == "sweep-1"
    assert main(["--entity", "someone"]) == 0
    assert '"display_name": "Policies"' in capsys.readouterr().out
