"""The modes of a run: each runs a resolved config's requests and returns the
run's records (``RunResult``) and what the mode adds to ``metrics.json``.

* ``sim``: the discrete-event simulator, steps lasting what the latency model says;
* ``real``: the real engine on the wall clock;
* ``profile``: no trace; measures the real engine and writes its profile table.
"""
