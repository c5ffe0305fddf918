"""``python -m engine "prompt"``: the same as ``pdserve generate``."""

import sys

from engine import hugepages

hugepages.request()  # before anything imports torch: its allocator reads it once

from engine.generate import main

sys.exit(main())
