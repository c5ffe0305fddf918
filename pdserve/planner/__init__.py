"""Capacity planner: which prefill:decode split a workload needs.

``profile`` (a measured or hand-written latency profile of one worker), ``workload`` (arrivals
and lengths, synthetic or from a trace), ``sim`` (a discrete-event simulator that drives the
project's own Scheduler and BlockManager on a simulated clock), ``search`` (every xPyD split and
colocated, the highest rate each holds) and ``report`` (table and plots). See docs/PLANNING.md.
"""
