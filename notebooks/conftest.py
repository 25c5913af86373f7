"""pytest settings for the notebooks (nbval executes them under `make test`).

The notebooks save their figures with ``viz.save_figure``, which writes to the
repository's ``figures/``. Those committed files must be the pictures the committed
notebooks show (tests/test_notebooks.py checks it byte for byte), so a test run, whose
timings differ, writes its figures to a temporary folder instead. The notebook kernels
nbval starts inherit this environment variable.
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MINIVLLM_FIGURES_DIR", tempfile.mkdtemp(prefix="minivllm-figures-"))

# Under pytest-xdist each worker's notebook kernels get the worker's share of the cores
# (tests/conftest.py says why); a kernel reads OMP_NUM_THREADS when torch starts in it.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

# Every figure a notebook shows or saves passes the layout checks of tests/figure_layout.py
# (no key cut off or over the data, no texts over each other, no picture too wide), also
# the figures a cell draws itself: the kernels nbval starts read this IPython directory,
# whose start-up file installs the checks. A failing figure raises in its cell.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from figure_layout import kernel_ipython_dir  # noqa: E402

os.environ["IPYTHONDIR"] = kernel_ipython_dir()
