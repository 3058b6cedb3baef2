"""The discrete-event simulator: simpy replicas running the shared control plane.

* ``simulator``: the simpy processes (arrivals, a router, replicas stepping);
* ``executor``: ``SimExecutor``, a step that lasts what the latency model predicts;
* ``latency``: the step features and the latency model's interface;
  ``roofline`` and ``profile_model`` (fitted by ``fitting``) implement it,
  ``predictor`` picks one for a run;
* ``speed``: the machine's speed over simulated time (``mode.speed_trace``);
* ``run_speed``: a real run's speed against a latency model.

Only ``simulator`` imports simpy: a bare machine that only profiles loads the rest.
"""
