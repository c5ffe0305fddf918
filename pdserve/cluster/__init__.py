"""Running a cluster: the in-process local harness and the Ray control plane.

``local`` starts router and workers in one process for tests and the demo; ``ray_controller``,
``ray_actors``, ``ray_launcher`` and ``autoscaler`` place them on a Ray cluster.
"""
