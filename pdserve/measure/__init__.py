"""Measurements the product itself takes: the one timing helper, a KV push over a transport and
the router's first-token overhead (``pdserve profile``), the cold start (``pdserve demo``). The
lab's benchmarks (``pdserve.bench``) build on these; nothing here imports the lab."""
