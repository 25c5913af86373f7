"""pytest settings for the notebooks (nbval executes them under `make test`).

The notebooks save their figures with ``viz.save_figure``, which writes to the
repository's ``figures/``. Those committed files must be the pictures the committed
notebooks show (tests/test_notebooks.py checks it byte for byte), so a test run, whose
timings differ, writes its figures to a temporary folder instead. The notebook kernels
nbval starts inherit this environment variable.
"""

import os
import tempfile

os.environ.setdefault("MINIVLLM_FIGURES_DIR", tempfile.mkdtemp(prefix="minivllm-figures-"))
