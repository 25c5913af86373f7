import os

import torch

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when the
# kernel modules are first imported, so it must be set before any test imports them.
# Without a GPU the kernels then run on the CPU through Triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Not MPLBACKEND=Agg in os.environ: nbval's notebook kernels would inherit it and lose
# their inline figures. Selecting the backend in this process only is enough for tests.
import matplotlib  # noqa: E402

matplotlib.use("Agg")
