"""nixl transport: the prefill worker WRITEs KV straight into the decode worker's leased
blocks through NIXL (UCX: RDMA between GPUs, shared memory or TCP on one host); no receiver
thread copies bytes and no frame is decoded on the data path.

- ``agent``: the NIXL library, found under whichever wheel name is installed, and one agent
  per role with its registered memory.
- ``control``: the authenticated control connection (the torch_dist handshake proves the
  cluster token both ways, then HMACed msgpack messages): the decode worker's agent metadata
  and cache layout once per peer, the addresses of one lease's blocks, the commit's verdict.
- ``commit``: the commit notification (the CRC-sealed commit frame header plus the cells
  written and a digest of their bytes) and the digest both sides compute.
- ``server`` (decode side) and ``transport`` (prefill side, ``connect`` / ``serve``).
"""
