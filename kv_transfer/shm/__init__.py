"""shm transport: prefill and decode workers on one node share the decode worker's KV cache,
which lives in a shared-memory file; the prefill worker copies each layer's blocks straight
into the lease's blocks (no socket carries KV bytes) and commits over an authenticated
control connection, checked as nixl's commits are.

- ``cache``: the decode worker's caches moved into one /dev/shm file (0600, removed at stop)
  and a sender's read-write mapping of it.
- ``server`` (decode side: the control port, lease hand-out, commits) and ``transport``
  (prefill side, ``connect`` / ``serve``).
"""
