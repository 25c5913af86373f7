"""``python -m minivllm.bench MODE`` is ``minivllm bench MODE``."""

import sys

from minivllm.bench.cli import main

sys.exit(main())
