"""Reports from benchmark JSON: BENCHMARKS.md's results section and a compare run's goodput.

Subcommands ``pdserve bench report``, ``goodput-ratios`` and ``goodput-ceiling``.
"""
