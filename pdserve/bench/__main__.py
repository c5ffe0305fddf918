"""``python -m pdserve.bench serve|sweep|transfer ...`` (same as ``pdserve bench ...``)."""

import sys

from pdserve.bench import main

sys.exit(main())
