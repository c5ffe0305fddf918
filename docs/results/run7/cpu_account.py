"""CPU seconds (process user + sys) and wall per 45 MiB push: the limits and each transport.

python docs/results/run7/cpu_account.py   (from the repository root)
"""

import itertools
import resource
import time

import torch

from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import make_sender, start_receiver_server
from pdserve.bench.micro.transfer import KVShape, _push_once
from pdserve.bench.micro.transfer_limits import (
    flight_stack_seconds,
    grpc_stack_seconds,
    loopback_seconds,
)

SHAPE = KVShape()
BYTES = SHAPE.bytes_per_push


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(name: str, push, reps: int = 6) -> None:
    push()  # warm-up
    cpu0, wall0 = cpu_s(), time.perf_counter()
    for _ in range(reps):
        push()
    cpu, wall = (cpu_s() - cpu0) / reps, (time.perf_counter() - wall0) / reps
    print(
        f"{name:>12}: wall {wall * 1e3:6.1f} ms  cpu {cpu * 1e3:6.1f} ms "
        f"({cpu / wall:.2f} cores)  {BYTES / wall / 1e6:6.0f} MB/s",
        flush=True,
    )


def measure_transport(name: str, src, ids) -> None:
    leases = LeaseTable(600.0)
    server = start_receiver_server(name, KVReceiver(SHAPE.make_cache(zero=True), leases))
    sender = make_sender(name, server.endpoint)
    tags = (f"{name}-{i}" for i in itertools.count())
    measure(name, lambda: _push_once(sender, leases, SHAPE, src, ids, next(tags)))
    sender.close()
    server.stop()


def main() -> None:
    torch.set_num_threads(1)
    measure("loopback", lambda: loopback_seconds(BYTES))
    measure("bare grpcio", lambda: grpc_stack_seconds(BYTES, calls=1))
    measure("bare flight", lambda: flight_stack_seconds(BYTES, calls=1))
    src, ids = SHAPE.make_cache(), torch.randperm(SHAPE.num_blocks).tolist()
    for name in ("grpc", "flight", "local"):
        measure_transport(name, src, ids)


if __name__ == "__main__":
    main()
