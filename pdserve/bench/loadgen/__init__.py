"""A load generator for any OpenAI-compatible server: workloads, metrics, serve, sweep, compare."""
