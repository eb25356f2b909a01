"""Sphinx configuration: Markdown pages (MyST) plus an API reference from the docstrings."""

from __future__ import annotations

import astage

project = "astage"
author = "astage contributors"
release = astage.__version__
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinxcontrib.mermaid",  # the diagrams: drawn in the browser, nothing to render at build time
]
myst_fence_as_directive = ["mermaid"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
html_theme = "furo"
html_title = f"astage {release}"
