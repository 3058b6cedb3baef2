"""The deployment search: the cheapest way to deploy a model on a GPU type for a
trace under SLOs, in simulation.

Given a trace, a model, a GPU type and SLOs (TTFT and TPOT at a percentile), it
searches replicas, tensor and pipeline parallelism, colocated or disaggregated
prefill/decode, the engine's batch limits, chunked prefill and the scheduling
policy, within a GPU budget, for the highest SLO-meeting rate per GPU of each
configuration, pruning what cannot win. ``python -m testbed.search`` (or
``python run.py -m +experiment=deployment_search``) runs it as a Hydra sweeper
on any launcher; docs/deployment_search.md says how.

- ``space.py``: the knobs and the configurations they expand to;
- ``slo.py``: SLOs and whether a run meets one;
- ``checks.py``: budget, validity and memory, before any simulation;
- ``bounds.py``: latency floors and starting rates from the latency model;
- ``search.py``: bracketing, bisection and branch and bound, a round at a time;
- ``driver.py`` and ``sweeper.py``: the search as a Hydra sweeper;
- ``report.py`` and ``page.py``: the front, the best per SLO, the files and page.

Nothing is imported here: Hydra's plugin scan imports the sweeper at every start.
"""
