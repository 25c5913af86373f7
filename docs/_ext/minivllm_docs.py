"""What the minivllm site needs beyond stock Sphinx and myst-nb.

Three things, each small:

- **Widgets as their stored pictures.** A static page has no kernel, so an ipywidgets
  slider cannot redraw anything there, and rendering a widget at all needs require.js
  and ``@jupyter-widgets/html-manager`` from a CDN (no pip package ships them), which
  an offline site cannot load. But when a notebook is executed with its widget state
  stored (nbconvert does), that state holds what the widget's ``Output`` area showed
  when nbval ran it: the picture at the slider's first position. On the site each
  widget output is replaced by exactly those stored outputs, with a line naming the
  controls a reader can move in JupyterLab. The notebook file is not touched; a widget
  output without stored state fails the build instead of becoming an empty box.
- ``{source}`minivllm.engine.llm_engine``: a link to the highlighted source of a module (the page
  ``sphinx.ext.viewcode`` writes), checked to exist when the build finishes.
- ``.. minivllm-modules::``: an ``automodule`` for every module of the package, found
  by walking it, so the reference follows the code when modules are added, split or
  renamed. Names in ``minivllm.__all__`` are left out there: the API page documents
  them once, under their public name.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import inspect
import json
import pkgutil
import re
import sys
import types
import typing
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.ext.napoleon import Config as NapoleonConfig
from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# Widget models a reader can change in JupyterLab (named in the note under the picture).
CONTROL_MODELS = ("Slider", "Dropdown", "Play", "Checkbox", "Text", "ToggleButtons",
                  "RadioButtons", "Select", "BoundedIntText", "BoundedFloatText")


# -- widgets -------------------------------------------------------------------------


def _walk_widget(model_id: str, state: dict, seen: set[str]) -> tuple[list, list[str]]:
    """The stored outputs of every Output widget under ``model_id`` (in display order),
    and the descriptions of its controls. Raises KeyError for a model with no state."""
    if model_id in seen:
        return [], []
    seen.add(model_id)
    model = state[model_id]
    name, fields = model["model_name"], model["state"]
    outputs: list = []
    controls: list[str] = []
    if name == "OutputModel":
        outputs.extend(fields.get("outputs", []))
    elif any(kind in name for kind in CONTROL_MODELS):
        controls.append(fields.get("description") or name.removesuffix("Model"))
    for child in fields.get("children", []):
        more_outputs, more_controls = _walk_widget(child.removeprefix("IPY_MODEL_"), state, seen)
        outputs.extend(more_outputs)
        controls.extend(more_controls)
    return outputs, controls


def _note(controls: list[str]) -> dict:
    named = ", ".join(f"`{c}`" for c in dict.fromkeys(controls)) or "its controls"
    text = (f"*Interactive in JupyterLab ({named}): this page shows the widget as it was "
            "drawn when the notebook was executed.*")
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/markdown": text, "text/plain": text}}


def static_widgets(notebook: dict, where: str) -> int:
    """Replace each widget output of ``notebook`` (in place) by the outputs stored in its
    widget state; drop the state itself so no widget script lands on the page. Returns
    the number of widget outputs replaced."""
    state = notebook.get("metadata", {}).pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    replaced = 0
    for index, cell in enumerate(notebook.get("cells", [])):
        new_outputs = []
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                new_outputs.append(output)
                continue
            try:
                stored, controls = _walk_widget(view["model_id"], state, set())
            except KeyError:
                logger.warning(
                    "%s, cell %d: a widget output has no stored widget state, so the site "
                    "would show an empty box; execute the notebook with its widget state "
                    "saved (jupyter nbconvert --execute stores it)", where, index,
                    type="minivllm", subtype="widget")
                continue
            new_outputs.extend(stored)
            new_outputs.append(_note(controls))
            replaced += 1
        if "outputs" in cell:
            cell["outputs"] = new_outputs
    return replaced


def _on_source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    if app.env.doc2path(docname).suffix != ".ipynb":
        return
    notebook = json.loads(source[0])
    if "widgets" in notebook.get("metadata", {}):
        static_widgets(notebook, docname)
        source[0] = json.dumps(notebook)


# The README and FACILITATOR.md link to each other by file name, which is right on GitHub
# and in a checkout; on the site each is included into a page of its own (docs/index.md,
# docs/facilitator.md), so the link must name that page instead.
SITE_PAGES = {"README.md": "index.md", "FACILITATOR.md": "facilitator.md"}


def _on_include_read(app: Sphinx, relative_path, parent_docname: str, content: list[str]) -> None:
    for file, page in SITE_PAGES.items():
        content[0] = content[0].replace(f"]({file})", f"]({page})")


# -- sphinx.ext.viewcode's "[docs]" links ------------------------------------------------
#
# viewcode remembers, per source module, the name of the *first* module that documented
# something from it, and builds every "[docs]" link on that module's highlighted source
# from it. Here one source module is documented under two names: minivllm.engine.llm_engine's
# LLMEngine as ``minivllm.LLMEngine`` on the API page, its other functions as
# ``minivllm.engine.llm_engine.resolve_device`` on the Modules page. The links for the second kind
# would point at ``#minivllm.resolve_device``, which no page has.


def _on_follow_imported(app: Sphinx, modname: str, attribute: str) -> str | None:
    """Where a documented name's source lives: the module its object says, but a
    module-level constant (a str has ``__module__ == "builtins"``) is in the module that
    defines it, not in ``builtins``, whose source viewcode cannot show."""
    obj = importlib.import_module(modname)
    for part in attribute.split("."):
        obj = getattr(obj, part, None)
    source = getattr(obj, "__module__", None)
    if isinstance(source, str) and source.split(".")[0] in ("minivllm", "kernels"):
        return source
    return modname


_BACKLINK = re.compile(r'href="([^"#]*)#((?:minivllm|kernels)[\w.]*)"')


def _fix_backlinks(app: Sphinx, pagename: str, templatename, context: dict, doctree) -> None:
    """On a highlighted-source page, repoint each "[docs]" link whose anchor no page has
    to the anchor of the same object under its own module's name."""
    if not pagename.startswith("_modules/") or "body" not in context:
        return
    module = pagename.removeprefix("_modules/").replace("/", ".")
    objects = app.env.get_domain("py").objects

    def repoint(match: re.Match) -> str:
        anchor = match.group(2)
        if anchor in objects:
            return match.group(0)
        parts = anchor.split(".")
        for cut in range(1, len(parts)):
            entry = objects.get(module + "." + ".".join(parts[cut:]))
            if entry is not None:
                uri = app.builder.get_relative_uri(pagename, entry.docname)
                return f'href="{uri}#{entry.node_id}"'
        return match.group(0)

    context["body"] = _BACKLINK.sub(repoint, context["body"])


# -- {source} role -------------------------------------------------------------------


def _source_page(module: str) -> str:
    return "_modules/" + module.replace(".", "/")


def source_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """``{source}`minivllm.engine.llm_engine``: link to the module's highlighted source page."""
    env = inliner.document.settings.env
    module = text.strip()
    try:
        path = importlib.import_module(module).__file__
    except ImportError as exc:
        msg = inliner.reporter.error(f"{{source}}: cannot import {module!r}: {exc}", line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    env.minivllm_source_links = getattr(env, "minivllm_source_links", set()) | {module}
    uri = env.app.builder.get_relative_uri(env.docname, _source_page(module))
    label = Path(path).name if Path(path).name != "__init__.py" else module
    node = nodes.reference(rawtext, "", refuri=uri, classes=["minivllm-source"])
    node += nodes.literal(label, label)
    return [node], []


def _check_source_links(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    for module in sorted(getattr(app.env, "minivllm_source_links", ())):
        page = Path(app.outdir) / (_source_page(module) + ".html")
        if not page.is_file():
            logger.warning("{source}`%s` links to %s, which sphinx.ext.viewcode did not write "
                           "(is the module documented?)", module, page.relative_to(app.outdir),
                           type="minivllm", subtype="source")


def _merge_source_links(app, env, docnames, other) -> None:
    env.minivllm_source_links = (getattr(env, "minivllm_source_links", set())
                                 | getattr(other, "minivllm_source_links", set()))


# -- .. minivllm-modules:: -----------------------------------------------------------


def package_modules(root: Path) -> list[str]:
    """Every module that ``pip install`` installs: the packages pyproject.toml lists under
    ``[tool.setuptools] packages`` and the modules in each, sorted by name. A
    package's ``__main__`` is left out: importing it runs the program."""
    with open(root / "pyproject.toml", "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]
    names = set(packages)
    for package in packages:
        path = importlib.import_module(package).__path__
        names |= {f"{package}.{info.name}" for info in pkgutil.iter_modules(path)
                  if not info.ispkg and info.name != "__main__"}
    return sorted(names)


class ModulesDirective(SphinxDirective):
    """One section per module of the package, each an ``automodule`` with its members,
    leaving out the public names that the API page documents, and the modules listed
    in ``:skip:`` (with a skipped package's own modules)."""

    required_arguments = 1
    option_spec = {"skip": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        package = self.arguments[0]
        skip = set((self.options.get("skip") or "").split())
        public = importlib.import_module(package).__all__
        lines: list[str] = []
        for name in package_modules(Path(self.env.srcdir)):
            if name in skip or any(name.startswith(f"{s}.") for s in skip - {package}):
                continue  # a skipped package's modules too (minivllm.viz.*: the API page)
            module = importlib.import_module(name)
            exported_here = [n for n in public
                             if getattr(getattr(module, n, None), "__module__", None) == name]
            lines += [name, "-" * len(name), "", f".. automodule:: {name}", "   :members:"]
            if exported_here:
                lines.append(f"   :exclude-members: {', '.join(exported_here)}")
            lines.append("")
            if exported_here:
                refs = ", ".join(f":class:`~{package}.{n}`" for n in exported_here)
                lines += [f"Public names defined here: {refs} (see the API page).", ""]
        # Inserted into the input like an include, so the generated section titles
        # become real sections of the page.
        self.state_machine.insert_input(lines, f"minivllm-modules {package}")
        return []


# -- docstrings and references -------------------------------------------------------

_LIST_OR_FIELD = re.compile(r"^([-*+]|\d+[.)]|:[^:]+:)\s")


def literal_examples(lines: list[str]) -> None:
    """minivllm's docstrings show commands and code as a plain indented block after a
    paragraph (``minivllm serve --port 8000``), as one would in a terminal. To
    reStructuredText an indented block after a paragraph is a block quote, where a shell
    line continued with a backslash or a table of status codes is a markup error. Mark
    each such block literal (a lone ``::`` line before it), which is what its author
    meant. Blocks after a ``::`` paragraph, directive content and list or field bodies
    are left alone. Changes ``lines`` (autodoc's dedented docstring) in place."""
    i = 1
    while i < len(lines):
        if lines[i][:1] in (" ", "\t") and lines[i].strip() and not lines[i - 1].strip():
            owner = next((ln for ln in reversed(lines[:i]) if ln.strip() and ln[:1] not in (" ", "\t")), "")
            if owner and not (owner.rstrip().endswith("::") or owner.startswith(".. ")
                              or _LIST_OR_FIELD.match(owner)):
                lines[i:i] = ["::", ""]
                i += 2
            while i < len(lines) and (not lines[i].strip() or lines[i][:1] in (" ", "\t")):
                i += 1
            continue
        i += 1


_NAPOLEON = NapoleonConfig(napoleon_use_param=True, napoleon_use_rtype=True)


def _on_docstring(app, what, name, obj, options, lines: list[str]) -> None:
    # Google-style sections ("Args:") where a function has them. Not for attributes:
    # napoleon reads an attribute docstring's "words: more words" as "type: text".
    if what in ("function", "method", "class", "module", "exception"):
        lines[:] = GoogleDocstring(lines, _NAPOLEON, app, what, name, obj, options).lines()
    literal_examples(lines)


def _on_signature(app, what, name, obj, options, signature, return_annotation):
    """Defaults whose repr is no Python (``= <factory>`` for a dataclass field with
    ``default_factory=dict``, ``= <built-in function perf_counter>``) make Sphinx split
    the whole signature on commas (``dict[str`` becomes a "type"). Write them as Python:
    the factory call (``dict()``, what each new instance gets) or the function's dotted
    name (``time.perf_counter``)."""
    if not signature or "=<" not in signature.replace(" ", ""):
        return None
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.default_factory is not dataclasses.MISSING:
                factory = getattr(f.default_factory, "__name__", "")
                call = f"{factory}()" if factory.isidentifier() else "..."
                signature = re.sub(rf"(\b{f.name}\s*:[^=]*?=\s*)<factory>", rf"\g<1>{call}",
                                   signature, count=1)
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        parameters = ()
    for p in parameters:
        default = p.default
        if p.default is inspect.Parameter.empty or not repr(default).startswith("<"):
            continue
        module, qualname = getattr(default, "__module__", None), getattr(default, "__qualname__", None)
        dotted = f"{module}.{qualname}" if module and qualname and "<" not in qualname else "..."
        signature = signature.replace(repr(default), dotted)
    return signature, return_annotation


_MISSING = object()


def _python_object(target: str, module: str | None, cls: str | None):
    """What ``target`` names in Python, seen from ``module`` (and class ``cls``): a name
    defined or imported there, a builtin, or a dotted path. ``_MISSING`` if nothing."""
    scopes = []
    if module:
        scope = sys.modules.get(module) or importlib.import_module(module)
        if cls:
            scopes.append((scope, f"{cls}.{target}"))
        scopes.append((scope, target))
    scopes.append((builtins, target))
    for scope, dotted in scopes:
        obj = _getattr_path(scope, dotted.split("."))
        if obj is not _MISSING:
            return obj
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module_obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        return _getattr_path(module_obj, parts[cut:])
    return _MISSING


def _getattr_path(obj, parts: list[str]):
    for part in parts:
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            break
    return obj


def _public_name(full: str) -> str:
    """``minivllm.engine.llm_engine.LLMEngine.step`` -> ``minivllm.LLMEngine.step``: the API page
    documents the names of ``minivllm.__all__`` under their public name."""
    import minivllm

    for name in minivllm.__all__:
        obj = getattr(minivllm, name)
        home = f"{obj.__module__}.{obj.__qualname__}"
        if full == home or full.startswith(home + "."):
            return f"minivllm.{name}" + full[len(home):]
    return full


def _on_missing_reference(app, env, node, contnode):
    """Resolve a name as Python would from the docstring's module (a docstring in
    ``minivllm.sim.simulator`` that says :class:`LLMEngine` means the class it imports); a
    name that module does not know, by the one documented minivllm object of that name
    (:class:`ModelRunner`), if there is exactly one."""
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    target = node["reftarget"]
    obj = _python_object(target, node.get("py:module"), node.get("py:class"))
    if obj is _MISSING:
        matches = [name for name in domain.objects
                   if name.startswith("minivllm.") and name.endswith("." + target)]
        if len(matches) != 1:
            return None
        full = matches[0]
    elif hasattr(obj, "__qualname__") and hasattr(obj, "__module__"):
        full = _public_name(f"{obj.__module__}.{obj.__qualname__}")
    else:
        return None
    if full == target:
        return None
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], full,
                               node, contnode)


def _on_warn_missing_reference(app, domain, node) -> bool | None:
    """Let through a reference to an existing object outside minivllm (``torch.Tensor``,
    ``str``) or to a type variable: neither has a page here (other projects' pages need
    intersphinx, which downloads). Anything else stays a warning, so an error."""
    if domain is None or domain.name != "py":
        return None
    obj = _python_object(node["reftarget"], node.get("py:module"), node.get("py:class"))
    if obj is _MISSING:
        return None
    if isinstance(obj, typing.TypeVar):
        return True
    home = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    if not isinstance(home, str):
        home = type(obj).__module__
    return True if home.split(".")[0] != "minivllm" else None


def setup(app: Sphinx) -> dict:
    app.connect("autodoc-process-docstring", _on_docstring)
    app.connect("autodoc-process-signature", _on_signature)
    app.connect("missing-reference", _on_missing_reference)
    app.connect("warn-missing-reference", _on_warn_missing_reference)
    app.connect("source-read", _on_source_read)
    app.connect("include-read", _on_include_read)
    app.connect("viewcode-follow-imported", _on_follow_imported)
    app.connect("html-page-context", _fix_backlinks)
    app.connect("env-merge-info", _merge_source_links)
    app.connect("build-finished", _check_source_links)
    app.add_role("source", source_role)
    app.add_directive("minivllm-modules", ModulesDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
