"""A request's life across attempts: reserve, prefill, decode, and what each attempt's end means.

``lifecycle``: ``RequestFlow``, which runs a request to its end over attempts (retry,
recompute, migration); ``attempt``: one attempt's calls, lease and streaming steps;
``request``: the router's state of one request (``FlowRequest``); ``types``: the config,
timings, ``Tokens``, ``AttemptOutcome`` and the errors that end a request.

Import from the modules themselves; this file imports nothing.
"""
