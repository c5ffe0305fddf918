"""Moving KV-cache blocks from a prefill worker to a decode worker (see frame.py for the wire).

``interfaces``: what a transport is (``Link``, ``Channel``, ``ReceiverServer``), torch-free;
``transports``: the registry of transport names, torch-free; ``frame``, ``lease``, ``sender``
(and ``sender_pool``), ``receiver``: the two ends; the ``transport_*`` modules and the
``torch_dist`` package: the transports. Import the modules themselves: this file imports
nothing, so a torch-free module here stays torch-free to import.
"""
