"""The product shell: the ``pdserve`` CLI, the client SDK, the cluster config and the settings
built from it, the local and Ray clusters (``cluster/``), the capacity planner (``planner/``);
and, apart from the product, the lab (``bench/``: benchmarks, the planner's fidelity runs), which
may import the product and which the product never imports."""
