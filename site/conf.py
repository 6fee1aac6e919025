"""Sphinx configuration of the vitlab site, built by ``python -m vitlab.site build``.

The notebooks are rendered as stored (``nb_execution_mode = "off"``): the figures are their
saved outputs. Nothing is fetched when a page is read: MathJax and the widget manager are served
from ``_static`` (put there by ``vitlab.site`` from the npm registry's packages, pinned), and no
theme feature that calls out (launch buttons, analytics, web fonts) is switched on.
"""
import os

project = "vitlab"
author = "the vitlab authors"
copyright = "the vitlab authors, MIT licence"
html_title = "vitlab: look inside Vision Transformers"

extensions = ["myst_nb"]
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

nb_execution_mode = "off"               # as stored: the site never re-runs a notebook
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
suppress_warnings = ["mystnb.unknown_mime_type"]

# local copies, written next to this build by vitlab.site (VITLAB_SITE_ASSETS)
html_static_path = [os.path.join(os.path.dirname(__file__), "_static"), os.environ["VITLAB_SITE_ASSETS"]]
mathjax_path = "mathjax/tex-svg-full.js"
nb_ipywidgets_js = {"widgets/embed.js": {}}
html_css_files = ["vitlab.css"]
html_js_files = [("vitlab-widgets.js", {"defer": "defer"})]   # after MathJax (priority 500)
html_favicon = "_static/favicon.svg"

html_theme = "sphinx_book_theme"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "home_page_in_toc": True,
}
html_context = {"default_mode": "light"}
html_show_sourcelink = False
html_copy_source = False
html_last_updated_fmt = None
