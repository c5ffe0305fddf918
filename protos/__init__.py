"""The wire contracts: the client API, the worker and KV-transfer services (``pdserve.proto``),
the generated modules beside it and the script that regenerates them. No logic."""
