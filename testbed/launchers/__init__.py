"""Hydra launchers of our own: ``hydra/launcher=ray`` (``conf/hydra/launcher/ray.yaml``)
runs a multirun's jobs as Ray tasks (``ray_launcher.py`` drives them, ``ray_task.py``
is the task on a worker); docs/usage.md, "Cluster sweeps"."""
