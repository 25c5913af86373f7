"""Sphinx configuration for the minivllm site: the course as a website.

Built by ``make docs`` (``sphinx-build -c docs . build/docs/html``): the *source*
folder is the repository root, so the notebooks, README.md and FACILITATOR.md are read
where they live and every relative link in them means what it means on disk. Only the
files named in ``include_patterns`` become pages.

The notebooks are rendered from their stored outputs, never re-executed: what nbval
checked is what a reader sees. Nothing is fetched from the network at build time or by
the built pages (no CDN scripts, no web fonts), so the site works offline.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

import minivllm  # noqa: E402

project = "minivllm"
author = "the minivllm authors"
copyright = "the minivllm authors, Apache-2.0"
release = version = minivllm.__version__

root_doc = "docs/index"
include_patterns = ["docs/**", "notebooks/[0-9][0-9]_*.ipynb"]
# Sphinx walks the whole source folder before it filters; excluded folders are not
# entered at all, which keeps it out of .venv and .git (tens of thousands of files).
exclude_patterns = [".*", "**/.*", "build", "dist", "*.egg-info", "minivllm",
                    "tests", "figures", "notebooks/learner", "notebooks/checks", "docs/_ext", "docs/_templates"]
templates_path = ["_templates"]

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "sphinxarg.ext",
    "minivllm_docs",
]

# Every cross-reference must resolve: a broken one is a warning, and `make docs` runs
# with -W, so it fails the build. minivllm_docs lets through only references to objects
# that exist outside minivllm (torch.Tensor, str, ...), which have no page here because
# intersphinx would download other projects' inventories.
nitpicky = True
# Except the annotations of the server's pydantic fields (minivllm.entrypoints.openai.protocol): they carry
# their JSON-schema bounds as ``Annotated[int, Field(...)]`` / ``bounded(int, ...)``,
# which autodoc prints as a type but nothing can link to.
nitpick_ignore_regex = [(r"py:(class|obj)", r".*Annotated\[.*"), (r"py:class", r"bounded")]
# Several response models have a field called ``object`` (OpenAI's shapes); a bare
# ``object`` in an annotation then matches them all, and the builtin is meant.
suppress_warnings = ["ref.python"]

# -- MyST and notebooks --------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # README's [Platform notes](#platform-notes) and the like
nb_execution_mode = "off"  # render the stored, nbval-checked outputs
nb_ipywidgets_js = {}  # no require.js / html-manager from a CDN: see minivllm_docs
nb_merge_streams = True  # a streamed answer reads as one block, not one line per piece

# -- API reference -------------------------------------------------------------------
autodoc_member_order = "bysource"
# Several of the engine's classes carry their explanation in the module docstring, not
# in a class docstring: document them (and their public methods) all the same.
autodoc_default_options = {"members": True, "undoc-members": True}
autoclass_content = "both"  # the class docstring, then __init__'s (LLM's arguments)
autodoc_inherit_docstrings = False

# -- HTML ----------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "minivllm"
html_favicon = "favicon.svg"  # KV blocks; also spares browsers a 404 for /favicon.ico
# The theme's script logs an error when the page names no colour mode.
html_context = {"default_mode": "auto"}
html_copy_source = False  # the .ipynb files are large; readers get them from the repo
html_show_sourcelink = False
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "navigation_with_keys": False,
}
# The highlighted source pages (one per module, from viewcode) keep the logo and the
# search field but not the course's navigation tree: rendering that tree is most of
# the cost of a page, and there are five times as many source pages as course pages.
html_sidebars = {"_modules/**": ["navbar-logo.html", "search-button-field.html"]}
# The site's entry point, build/docs/html/index.html, leads to the home page (which
# lives at docs/index.html because the source folder is the repository root).
html_additional_pages = {"index": "redirect.html"}
