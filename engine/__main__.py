"""``python -m engine "prompt"``: the same as ``pdserve generate``."""

import sys

from pdserve.cli import main

sys.exit(main(["generate", *sys.argv[1:]]))
