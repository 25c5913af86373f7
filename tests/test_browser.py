"""The course in a real browser: JupyterLab runs notebook 00, and the site's pages load.

Headless Chromium from the system (Debian's ``chromium`` and ``chromium-driver``;
``make browser`` installs them) driven by Selenium. A browser download cannot work on
machines without internet, so nothing is downloaded: without a system Chromium these
tests skip and say how to get one. Every wait is explicit and bounded. Screenshots go
to build/screenshots/ (ignored by git). Deselect with `-m "not browser"`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait
from test_docs import NOTEBOOKS, build_site, stored_pictures

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "build" / "screenshots"
QUICKSTART = ROOT / "notebooks" / "00_quickstart.ipynb"

pytestmark = pytest.mark.browser


def find_chromium() -> tuple[str, str]:
    browser = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    driver = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("no system Chromium and ChromeDriver: install Debian's chromium and "
                    "chromium-driver (`make browser`, as root), or set CHROMIUM and CHROMEDRIVER")
    return browser, driver


@pytest.fixture
def browser(monkeypatch):
    binary, driver_path = find_chromium()
    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager go online
    options = Options()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    assert driver.save_screenshot(str(path)), f"could not save {path}"
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the site -------------------------------------------------------------------------


@contextlib.contextmanager
def serve(folder: Path):
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


def open_page(driver, url: str) -> list[dict]:
    """Load ``url``, wait until it and its images are complete; return the images'
    sizes as the browser decoded them."""
    driver.get(url)
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script(
            "return document.readyState === 'complete' && "
            "Array.from(document.images).every(i => i.complete)"))
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('article img')).map("
        "i => ({src: i.currentSrc, width: i.naturalWidth, height: i.naturalHeight}))")


def site_errors(driver, base: str) -> list[str]:
    return [e["message"] for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and base in e["message"]]


def test_site_pages_load_with_their_figures_and_no_errors(browser, tmp_path_factory) -> None:
    site = build_site(tmp_path_factory)
    with serve(site) as base:
        open_page(browser, base)  # the entry point leads to the home page
        WebDriverWait(browser, 30).until(lambda d: d.current_url.endswith("/docs/index.html"))
        assert "minivllm" in browser.title
        nav = browser.find_elements(By.CSS_SELECTOR, "a[href*='notebooks/']")
        assert len({a.get_attribute("href") for a in nav}) >= len(NOTEBOOKS)
        screenshot(browser, "site_home.png")
        errors = site_errors(browser, base)
        for path in NOTEBOOKS:
            images = open_page(browser, f"{base}notebooks/{path.stem}.html")
            expected = stored_pictures(json.loads(path.read_text()))
            assert len(images) == expected, f"{path.stem}: {len(images)} of {expected} figures"
            blank = [i["src"] for i in images if not (i["width"] > 0 and i["height"] > 0)]
            assert not blank, f"{path.stem}: figures that did not load: {blank}"
            if path.stem.startswith("03"):
                screenshot(browser, f"site_{path.stem}.png")
            errors += site_errors(browser, base)
        for page in ("docs/architecture.html", "docs/api.html", "docs/cli.html"):
            open_page(browser, base + page)
            errors += site_errors(browser, base)
    assert not errors, "console errors from the site's own files:\n" + "\n".join(errors)


# -- JupyterLab -------------------------------------------------------------------------


def lab_settings(folder: Path) -> None:
    """User settings for a throwaway JupyterLab: never autosave (the test edits a copy
    anyway), keep every cell in the page, fetch no news."""
    settings = {
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                        "checkForUpdates": False},
    }
    for name, values in settings.items():
        path = folder / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@contextlib.contextmanager
def jupyter_lab(root: Path, tmp: Path):
    port, token = free_port(), secrets.token_hex(16)
    settings = tmp / "lab-settings"
    lab_settings(settings)
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "lab-workspaces"),
               JUPYTER_CONFIG_DIR=str(tmp / "jupyter-config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "jupyter-runtime"))
    env.pop("MPLBACKEND", None)  # the notebook draws inline figures
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True"]
    if hasattr(os, "getuid") and os.getuid() == 0:
        cmd.append("--allow-root")  # Jupyter refuses root (containers, CI) without it
    log = (tmp / "jupyterlab.log").open("w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited ({proc.returncode}):\n"
                            + (tmp / "jupyterlab.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("jupyter lab did not answer within 90 s:\n"
                                + (tmp / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield base, token
    finally:
        with contextlib.suppress(OSError):
            request = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(request, timeout=10).close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


# JavaScript run in the page, through the app object JupyterLab exposes with
# --LabApp.expose_app_in_browser: the same commands as its menus and shortcuts.
NOTEBOOK = "const panel = window.jupyterapp.shell.currentWidget; const nb = panel.content;"
READY = NOTEBOOK + """
return !!(panel && panel.sessionContext && panel.sessionContext.session &&
          panel.sessionContext.session.kernel &&
          panel.sessionContext.session.kernel.status === 'idle' && nb.widgets.length > 0);"""
RUN_THROUGH = NOTEBOOK + """
nb.activeCellIndex = arguments[0];
const app = window.jupyterapp;
app.commands.execute('notebook:run-all-above').then(
    () => app.commands.execute('notebook:run-cell'));"""
DONE = NOTEBOOK + """
const cells = nb.widgets.slice(0, arguments[0] + 1).filter(c => c.model.type === 'code');
return panel.sessionContext.session.kernel.status === 'idle' &&
       cells.every(c => c.model.executionCount !== null);"""
ERRORS = NOTEBOOK + """
return nb.widgets.slice(0, arguments[0] + 1).flatMap(c => c.model.type !== 'code' ? [] :
    c.model.outputs.toJSON().filter(o => o.output_type === 'error')
        .map(o => o.ename + ': ' + o.evalue));"""
ADD_CELL = NOTEBOOK + """
const app = window.jupyterapp;
nb.activeCellIndex = arguments[0];
app.commands.execute('notebook:insert-cell-below').then(() => {
    nb.activeCell.model.sharedModel.setSource(arguments[1]);
    return app.commands.execute('notebook:run-cell');
});"""
CELL_NODE = NOTEBOOK + "return nb.widgets[arguments[0]].node;"


def cells_to_run(nb: dict) -> int:
    """Index of the last cell to run: every cell before the first one that writes into
    the repository's figures/ folder (``viz.save_figure``), so the test changes no file."""
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code" and "save_figure" in "".join(cell["source"]):
            return index - 1
    return len(nb["cells"]) - 1


def first_printed_words(nb: dict) -> str:
    """The first two words the first code cell printed when the notebook was stored."""
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                return " ".join("".join(output["text"]).split()[:2])
    raise AssertionError("notebook 00 prints nothing")


# The sources of a cell's widget pictures that have loaded (naturalWidth > 0).
DRAWN_PICTURES = """
return Array.from(arguments[0].querySelectorAll('.widget-output img'))
    .filter(img => img.complete && img.naturalWidth > 0).map(img => img.src);
"""


def test_jupyterlab_runs_notebook_00_and_renders_a_widget(browser, tmp_path: Path) -> None:
    nb = json.loads(QUICKSTART.read_text())
    last = cells_to_run(nb)
    # A copy: running cells in the browser must never rewrite the committed notebook.
    (tmp_path / "notebooks").mkdir()
    shutil.copy(QUICKSTART, tmp_path / "notebooks" / QUICKSTART.name)
    with jupyter_lab(tmp_path, tmp_path) as (base, token):
        browser.get(f"{base}/lab/tree/notebooks/{QUICKSTART.name}?token={token}")
        WebDriverWait(browser, 120).until(lambda d: d.execute_script(
            "return !!(window.jupyterapp && window.jupyterapp.shell.currentWidget &&"
            " window.jupyterapp.shell.currentWidget.content)") and d.execute_script(READY))
        # Run the notebook's first cells: load the model, chat, stream, a batch.
        browser.execute_script(RUN_THROUGH, last)
        WebDriverWait(browser, 300, poll_frequency=1).until(
            lambda d: d.execute_script(DONE, last))
        assert browser.execute_script(ERRORS, last) == []
        first_code = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code")
        printed = browser.execute_script(CELL_NODE, first_code).find_element(
            By.CSS_SELECTOR, ".jp-OutputArea-output").text
        assert first_printed_words(nb) in printed

        # A widget: the step replay of the batch the cells above ran, with its picture.
        browser.execute_script(ADD_CELL, last, "viz.replay(llm.trace)")
        cell = WebDriverWait(browser, 60).until(lambda d: d.execute_script(CELL_NODE, last + 1))
        slider = WebDriverWait(browser, 120).until(
            lambda d: cell.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle"))[0]
        # The widget's output area clears and redraws its picture, so an <img> found
        # one moment can be gone the next (a StaleElementReferenceException failed CI
        # once): the pictures are read in one script, inside the page.
        drawn = WebDriverWait(browser, 60).until(
            lambda d: d.execute_script(DRAWN_PICTURES, cell))
        first_src = drawn[0]
        screenshot(browser, "jupyterlab_00_quickstart.png")
        # Move the slider one step: the kernel redraws the picture for that step.
        slider.send_keys(Keys.ARROW_RIGHT)
        WebDriverWait(browser, 60).until(lambda d: any(
            src != first_src for src in d.execute_script(DRAWN_PICTURES, cell)))
        screenshot(browser, "jupyterlab_00_quickstart_step1.png")
