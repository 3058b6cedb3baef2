"""A saved W&B workspace view for policy sweeps, as code (``wandb-workspaces``):
policies side by side (each metric's mean over a policy's runs, with its standard
error) and every run against its load, grouped by policy. A user with a W&B
account saves it once into a project:

    python -m testbed.report.wandb_workspace --entity ME [--project P] [--group SWEEP] --save

Without ``--save`` it prints the view's spec (nothing leaves the machine).
"""

from __future__ import annotations

import argparse
import json

from testbed.report.wandb_log import PROJECT

# Summary metrics the view compares (metrics.json keys), with their panel titles
COMPARED = {
    "ttft_s_p50": "TTFT p50 (s)",
    "ttft_s_p99": "TTFT p99 (s)",
    "tpot_s_mean": "TPOT mean (s)",
    "e2e_s_mean": "E2E mean (s)",
    "goodput_req_s": "goodput (req/s)",
    "slo_attainment": "SLO attainment",
    "tenant_ttft_jain": "Jain's index over tenants (1 / mean TTFT)",
}


def policy_workspace(entity: str, project: str = PROJECT, group: str | None = None):
    """The view: one section of bar charts (metric by policy), one of scatter
    plots (metric against ``load``); runs grouped by policy, filtered to ``group``
    (a sweep's W&B group) where given."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    bars = [
        wr.BarPlot(
            title=f"{title} by policy",
            metrics=[wr.SummaryMetric(key)],
            groupby=wr.Config("policy.name"),
            groupby_aggfunc="mean",
            groupby_rangefunc="stderr",
        )
        for key, title in COMPARED.items()
    ]
    scatters = [
        wr.ScatterPlot(title=f"{title} against load", x=wr.Config("load"), y=wr.SummaryMetric(key))
        for key, title in COMPARED.items()
    ]
    filters = ws.And(ws.Metric("Group") == group) if group else ""
    return ws.Workspace(
        entity=entity,
        project=project,
        name=f"Policies{f' ({group})' if group else ''}",
        sections=[
            ws.Section(name="Policies side by side", panels=bars, is_open=True),
            ws.Section(name="Against load", panels=scatters, is_open=True),
        ],
        runset_settings=ws.RunsetSettings(groupby=[ws.Config("policy.name")], filters=filters),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entity", required=True, help="your W&B user or team")
    ap.add_argument("--project", default=PROJECT)
    ap.add_argument("--group", help="only the runs of this group (a sweep)")
    ap.add_argument("--save", action="store_true", help="save the view to W&B (needs a login)")
    a = ap.parse_args(argv)
    view = policy_workspace(a.entity, a.project, a.group)
    if a.save:
        view.save()
        print(f"saved: {view.url}")
    else:
        print(json.dumps(view._to_model().model_dump(mode="json"), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
