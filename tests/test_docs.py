"""The course as a website: `make docs` builds it from the stored notebook outputs.

The site is built once per test session (into a temporary folder) with the same
command and flags as `make docs`, and with every proxy variable pointing at a closed
local port, so a build step that tried to download something would fail here. The
checks read the built HTML with BeautifulSoup; nothing is fetched from the internet.
Deselect with `-m "not docs"`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from bs4 import BeautifulSoup
from PIL import Image

import minivllm
from minivllm import viz
from minivllm.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# The same flags as the Makefile's `docs` target: a warning fails the build.
SPHINX_FLAGS = ["-W", "--keep-going", "-q", "-b", "html", "-c", "docs"]
IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
EXTERNAL = ("http", "https", "mailto", "data", "javascript", "ftp")
# A closed port: anything that tries to reach the network during the build fails fast.
NO_NETWORK = "http://127.0.0.1:9"

pytestmark = pytest.mark.docs


def _build(out: Path) -> tuple[Path | None, str]:
    env = dict(os.environ)
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                "ALL_PROXY"):
        env[var] = NO_NETWORK
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    cmd = [sys.executable, "-m", "sphinx", *SPHINX_FLAGS, ".", str(out / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return None, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return out / "html", proc.stderr


@functools.cache
def _build_once(root: Path) -> tuple[Path | None, str]:
    """Build into ``root``/site unless another process of this test run has: the first
    to take the lock builds and records the outcome, the others read it. ``make test``'s
    two workers both need the site (this module and the browser tests) and had each
    built it."""
    from filelock import FileLock

    out, outcome = root / "site", root / "site.json"
    with FileLock(str(root / "site.lock")):
        if not outcome.exists():
            out.mkdir(exist_ok=True)
            site, log = _build(out)
            outcome.write_text(json.dumps({"site": site and str(site), "log": log}))
        done = json.loads(outcome.read_text())
    return (done["site"] and Path(done["site"])), done["log"]


def build_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site's folder, built once per test run in a folder every pytest-xdist
    worker of the run shares (the parent of each worker's own temporary folder). A
    failed build fails every test that needs it, with Sphinx's output."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    site, log = _build_once(root)
    if site is None:
        pytest.fail(log, pytrace=False)
    return site


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_site(tmp_path_factory)


@functools.cache
def parse(path: Path) -> BeautifulSoup:
    return BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Every id (and old-style ``name``) a link's ``#fragment`` can land on in the page."""
    page = parse(path)
    return frozenset([t["id"] for t in page.find_all(id=True)]
                     + [t["name"] for t in page.find_all("a", attrs={"name": True})])


def article(page: BeautifulSoup):
    """The page's own content, without the theme's navigation."""
    main = page.find("article") or page.find(attrs={"role": "main"})
    assert main is not None, "no <article> in the page: did the theme change?"
    return main


# Sphinx typesets quotes (smartquotes); compare text as the notebook writes it.
PLAIN_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def text_of(tag) -> str:
    """The visible text of ``tag``, without the theme's "#" permalinks."""
    tag = copy.copy(tag)
    for link in tag.select("a.headerlink"):
        link.extract()
    return " ".join(tag.get_text(" ").split()).translate(PLAIN_QUOTES)


def notebook_title(nb: dict) -> str:
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            m = re.search(r"^#\s+(.+)$", "".join(cell["source"]), re.M)
            if m:
                return " ".join(re.sub(r"[`*_]", "", m.group(1)).split())
    raise AssertionError("notebook without a '# ' title")


def stored_pictures(nb: dict) -> int:
    """How many pictures the notebook's stored outputs hold: image outputs, plus the
    images a widget drew into its Output area (kept in the notebook's widget state)."""
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})

    def widget_pictures(model_id: str) -> int:
        model = state[model_id]
        count = sum(any(t in o.get("data", {}) for t in IMAGE_TYPES)
                    for o in model["state"].get("outputs", [])) if model["model_name"] == "OutputModel" else 0
        return count + sum(widget_pictures(c.removeprefix("IPY_MODEL_"))
                           for c in model["state"].get("children", []))

    count = 0
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            count += len(re.findall(r"!\[[^\]]*\]\(", "".join(cell["source"])))
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                count += widget_pictures(data[WIDGET_VIEW]["model_id"])
            elif any(t in data for t in IMAGE_TYPES):
                count += 1
    return count


def widget_outputs(nb: dict) -> int:
    return sum(WIDGET_VIEW in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))


def local_target(page: Path, url: str, site: Path) -> tuple[Path, str] | None:
    """(file, fragment) that ``url`` on ``page`` points at, or None for an external URL."""
    parts = urlsplit(url)
    if parts.scheme in EXTERNAL or parts.netloc:
        return None
    path = unquote(parts.path)
    target = page if not path else (page.parent / path).resolve()
    if path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, unquote(parts.fragment)


def test_site_has_a_home_page_and_an_entry_point(site: Path) -> None:
    home = site / "docs" / "index.html"
    assert home.is_file()
    entry = parse(site / "index.html")
    assert entry.find("a", href="docs/index.html"), "index.html must lead to the home page"
    title = (ROOT / "README.md").read_text().splitlines()[0].lstrip("# ").strip()
    assert text_of(article(parse(home)).find("h1")) == title
    # The home page links every notebook page, in order.
    linked = [a["href"] for a in article(parse(home)).select("a[href]")
              if a["href"].startswith("../notebooks/")]
    pages = [f"../notebooks/{p.stem}.html" for p in NOTEBOOKS]
    assert [h for h in dict.fromkeys(linked) if h in pages] == pages


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_has_its_page_title_and_figures(site: Path, path: Path) -> None:
    nb = json.loads(path.read_text())
    page_path = site / "notebooks" / f"{path.stem}.html"
    assert page_path.is_file(), f"no page for {path.name}"
    page = article(parse(page_path))
    assert text_of(page.find("h1")) == notebook_title(nb)
    images = page.find_all("img")
    assert len(images) == stored_pictures(nb), (
        f"{path.name} stores {stored_pictures(nb)} pictures, its page shows {len(images)}")
    for img in images:
        target, _ = local_target(page_path, img["src"], site)
        with Image.open(target) as picture:
            assert picture.width > 0 and picture.height > 0, img["src"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_widgets_show_their_stored_picture_not_an_empty_box(site: Path, path: Path) -> None:
    nb = json.loads(path.read_text())
    html = (site / "notebooks" / f"{path.stem}.html").read_text()
    assert WIDGET_VIEW not in html and WIDGET_STATE not in html
    assert "interactive(children=" not in html, "a widget's text repr leaked onto the page"
    assert html.count("Interactive in JupyterLab") == widget_outputs(nb)


def site_pages(site: Path) -> list[Path]:
    """The site's pages (``_static`` holds the theme's files, some of them templates)."""
    return sorted(p for p in site.rglob("*.html") if "_static" not in p.relative_to(site).parts)


def test_every_internal_link_and_anchor_resolves(site: Path) -> None:
    pages = site_pages(site)
    assert len(pages) >= len(NOTEBOOKS) + 5
    broken, checked = [], 0
    for page_path in pages:
        page = parse(page_path)
        for tag in page.find_all(["a", "link", "img", "script", "source", "iframe"]):
            url = tag.get("href") or tag.get("src")
            if not url:
                continue
            found = local_target(page_path, url, site)
            if found is None:
                continue
            target, fragment = found
            checked += 1
            where = f"{page_path.relative_to(site)}: {url}"
            if not target.is_file():
                broken.append(f"{where} (no file {target})")
            elif fragment and target.suffix == ".html" and fragment not in anchors(target):
                broken.append(f"{where} (no anchor #{fragment})")
    assert checked > 1000, f"only {checked} links checked: is the site complete?"
    assert not broken, "broken internal links:\n" + "\n".join(broken[:50])


def test_pages_load_nothing_from_the_network(site: Path) -> None:
    """An offline reader gets the whole page: no CDN script, stylesheet, font or image."""
    remote = []
    for page_path in site_pages(site):
        for tag in parse(page_path).find_all(["script", "link", "img", "iframe", "source"]):
            url = tag.get("src") or (tag.get("href") if tag.name == "link" else None)
            if url and urlsplit(url).scheme in ("http", "https") or (url or "").startswith("//"):
                remote.append(f"{page_path.relative_to(site)}: <{tag.name}> {url}")
    for css in site.rglob("*.css"):
        for url in re.findall(r"url\(\s*['\"]?((?:https?:)?//[^'\")]+)", css.read_text(errors="replace")):
            remote.append(f"{css.relative_to(site)}: {url}")
    assert not remote, "resources from the network:\n" + "\n".join(remote[:30])


def test_api_reference_lists_the_public_names(site: Path) -> None:
    api = parse(site / "docs" / "api.html")
    documented = {dt["id"] for dt in api.select("dt[id]")}
    for name in minivllm.__all__:
        assert f"minivllm.{name}" in documented, f"minivllm.{name} is not on the API page"
    drawings = [name for name, obj in vars(viz).items()
                if not name.startswith("_") and callable(obj) and getattr(obj, "__module__", "").startswith(viz.__name__ + ".")]
    assert drawings
    for name in drawings:
        assert f"minivllm.viz.{name}" in documented, f"minivllm.viz.{name} is not on the API page"


def test_cli_reference_lists_every_subcommand_and_option(site: Path) -> None:
    page = article(parse(site / "docs" / "cli.html"))
    headings = {text_of(h) for h in page.find_all(["h2", "h3", "h4"])}
    text = text_of(page)
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert subparsers.choices
    for name, sub in subparsers.choices.items():
        assert name in headings, f"no section for `minivllm {name}`"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # -h is every command's; the page leaves it out
            for option in action.option_strings:
                assert option in text, f"`minivllm {name} {option}` is missing from the CLI page"


def test_architecture_page_links_sources_and_notebooks(site: Path) -> None:
    page_path = site / "docs" / "architecture.html"
    links = [a["href"] for a in article(parse(page_path)).select("a[href]")]
    sources = {h for h in links if "_modules/minivllm/" in h}
    notebooks = {h.split("#")[0] for h in links if "/notebooks/" in h}
    assert len(sources) >= 10 and len(notebooks) >= 8
    for href in sources | notebooks:
        target, _ = local_target(page_path, href, site)
        assert target.is_file(), href


def test_facilitator_guide_is_on_the_site(site: Path) -> None:
    title = (ROOT / "FACILITATOR.md").read_text().splitlines()[0].lstrip("# ").strip()
    page = article(parse(site / "docs" / "facilitator.html"))
    assert text_of(page.find("h1")) == title
