"""Sim-vs-real fidelity: the same trace, policy and engine in both modes, request by request.

For each trace and policy it runs ``mode=sim`` (the latency model of this
hardware and model: the measured profile where one exists) and ``mode=real``
(the real engine on the wall clock), joins the two ``requests.csv`` on the
request id, and reports the relative error of the simulation (sim / real - 1,
as :mod:`testbed.metrics.fidelity` defines it) on throughput and on the mean,
p50, p90 and p99 of TTFT, TPOT and E2E, the per-request correlation of E2E, and
the latency model's error on every step the real run measured (``step_err_*``),
apart from any difference in schedule.

Each trace is replayed at ``--load`` (70%) of the capacity the simulator finds
for it. On a machine whose speed wanders, each pair is also simulated at speeds
measured while it ran (:mod:`.variants`): the reference probe on another core,
the neighbouring real runs, the run's own speed and its speed window by window;
``--repeats`` and ``--profile-passes`` spread real runs and profiler passes
over the experiment; ``--noise`` measures the real engine against its own
repeat; ``--reuse`` re-simulates an earlier invocation's real runs in seconds.

Modules by job: :mod:`.plan` (rates, the runs' order, the passes between
them), :mod:`.execute` (real runs and profiler passes, each in a fresh process,
and simulations), :mod:`.speeds` (the machine's speed per run and window),
:mod:`.compare` (errors and policy effects), :mod:`.variants` (each way of
setting a simulation's speed), :mod:`.report` (tables, Markdown, plots) and
:mod:`.cli` (the command line).

    python -m experiments.fidelity --policies fcfs sjf priority vtc \\
        --traces azure_conv mooncake_conv:prompt_scale=0.0625 --num-requests 200
"""
