"""``python -m cluster.bench``: the benchmark CLI without the rest of ``pdserve``."""

import sys

from cluster.bench.cli import main

sys.exit(main())
