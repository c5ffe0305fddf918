"""Moving KV-cache blocks from a prefill worker to a decode worker (see frame.py for the wire).

Import the modules themselves (``frame``, ``lease``, ``sender``, ``receiver``, the
``transport_*`` implementations, ``transports`` for the registry's names): this file imports
nothing, so a torch-free module here stays torch-free to import.
"""
