"""``python -m pdserve.bench serve|sweep|transfer ...`` (same as ``pdserve bench ...``)."""

import sys

from engine import hugepages

hugepages.request()  # before anything imports torch: its allocator reads it once

from pdserve.bench import main

sys.exit(main())
