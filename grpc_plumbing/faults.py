"""Who failed a call, as the workers tell the router: shared by both sides (trailing metadata).

A prefill worker whose Prefill fails because the KV transfer failed on the receiving side
(the decode worker's KV endpoint refused or reset it, or did not acknowledge the commit) ends
the call with trailing metadata ``pdserve-fault: receiver``; the router then charges the
decode worker that holds the lease (its breaker), not the prefill worker that reported it.
"""

from __future__ import annotations

FAULT_KEY = "pdserve-fault"
RECEIVER_FAULT = "receiver"
