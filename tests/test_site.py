"""The static site: chapter headers, and every page of a site built from a clean copy of the
repository, opened in headless Chromium.

The build runs once per test session (a module fixture) from the files a clone has (tracked and
not ignored: no build/, no figures, no .venv), then a local HTTP server serves it and Chromium,
with every host but 127.0.0.1 unreachable, opens each page. Without Chromium, ChromeDriver,
selenium or npm the browser tests skip, saying which is missing.
"""
from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import subprocess
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import nbformat
import pytest

from vitlab import notebooks as runner
from vitlab import site

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


# ---------------------------------------------------------------------------------- headers

def _copy_notebooks(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    for ch in site.CHAPTERS:
        shutil.copy2(ROOT / "notebooks" / f"{ch.stem}.ipynb", folder)
    shutil.copy2(ROOT / "notebooks" / "README.md", folder)
    return folder


def test_headers_are_written_once_and_rewriting_changes_nothing(tmp_path):
    folder = _copy_notebooks(tmp_path)
    before = {p.name: nbformat.read(p, as_version=4) for p in folder.glob("*.ipynb")}
    changed = site.write_headers(folder)
    had_header = {n for n, nb in before.items() if nb.cells and site._is_header(nb.cells[0])}
    assert len(changed) >= len(site.CHAPTERS) - len(had_header)
    written = {p.name: p.read_bytes() for p in folder.glob("*.ipynb")}
    assert site.write_headers(folder) == []                                   # idempotent
    assert {p.name: p.read_bytes() for p in folder.glob("*.ipynb")} == written
    times = runner.read_run_times_table(folder / "README.md")
    for ch in site.CHAPTERS:
        nb = nbformat.read(folder / f"{ch.stem}.ipynb", as_version=4)
        headers = [c for c in nb.cells if site._is_header(c)]
        assert len(headers) == 1 and nb.cells[0] is headers[0] and nb.cells[0].cell_type == "markdown"
        text = nb.cells[0].source
        for key in ("**You will learn:**", "**Follows:**", "**Run time:**", "**Solutions:**",
                    "**Run it yourself:**"):
            assert text.count(key) == 1, (ch.stem, key)
        for paper in ch.papers:
            assert f"]({paper.url})" in text
        if ch.stem in times["full"]:                                           # the measured time
            assert f"**Run time:** {runner._fmt_time(times['full'][ch.stem])} for the full run" in text
        if ch.solutions:
            assert f"[`{ch.solutions}`]({ch.solutions})" in text
            assert (ROOT / "notebooks" / ch.solutions).is_file()
        # both shells, the .venv's own jupyter, --cpu for Linux without an NVIDIA GPU, the kit's routes
        run = text.split("**Run it yourself:**", 1)[1].splitlines()[0]
        for part in ("`.venv/bin/jupyter lab`", "`.venv\\Scripts\\jupyter lab`", "no NVIDIA GPU: `--cpu`",
                     "(README.md#before-the-workshop)"):
            assert part in run, (ch.stem, part)
        # the rest of the notebook is as it was
        rest = [c for c in before[f"{ch.stem}.ipynb"].cells if not site._is_header(c)]
        assert [c.source for c in nb.cells[1:]] == [c.source for c in rest]


def test_the_stored_notebooks_are_what_the_headers_command_writes(tmp_path):
    """``python -m vitlab.site headers`` (every chapter's header, and the install cell of every chapter
    and solution) changes nothing in the stored notebooks: run it after changing either."""
    folder = _copy_notebooks(tmp_path)
    shutil.copytree(ROOT / "notebooks" / "solutions", folder / "solutions")
    assert site.write_headers(folder) == [], "run python -m vitlab.site headers"
    assert runner.write_install_cells(folder) == [], "run python -m vitlab.site headers"
    assert "\n## Before the workshop\n" in (folder / "README.md").read_text()   # the headers' link target


def test_a_new_time_or_paper_refreshes_the_header_in_place(tmp_path, monkeypatch):
    folder = _copy_notebooks(tmp_path)
    site.write_headers(folder)
    runner.update_run_times(folder / "README.md", "full", {"03_attention_rollout": 1234.0})
    assert site.write_headers(folder) == [folder / "03_attention_rollout.ipynb"]
    nb = nbformat.read(folder / "03_attention_rollout.ipynb", as_version=4)
    assert "**Run time:** 20.6 min for the full run" in nb.cells[0].source
    assert sum(site._is_header(c) for c in nb.cells) == 1
    extra = site.Chapter("99_extra", "x", (), None)
    monkeypatch.setattr(site, "CHAPTERS", site.CHAPTERS + (extra,))
    with pytest.raises(ValueError, match=r"no notebook for \['99_extra'\].*vitlab/site.py"):
        site.write_headers(folder)


def test_every_notebook_is_a_chapter_and_cites_the_papers_of_its_header():
    stems = [p.stem for p in runner.find_notebooks(ROOT / "notebooks")]
    assert stems == [c.stem for c in site.CHAPTERS]                           # the order of the book
    for ch in site.CHAPTERS:
        nb = nbformat.read(ROOT / "notebooks" / f"{ch.stem}.ipynb", as_version=4)
        intro = next(c.source for c in nb.cells if c.cell_type == "markdown" and not site._is_header(c))
        intro = " ".join(intro.split())                                        # titles wrap across lines
        for paper in ch.papers:
            assert paper.cite in intro, f"{ch.stem}: its first cell does not cite {paper.label}"


def test_every_chapter_names_the_modules_it_calls():
    """The header's "Code behind it" line: each path exists, and the chapter's code cells use a
    name defined in that module (so a reader who opens the file finds what the chapter calls)."""
    import importlib
    import inspect

    root = ROOT
    for ch in site.CHAPTERS:
        assert ch.code, f"{ch.stem}: no module named in its header"
        nb = json.loads((ROOT / "notebooks" / f"{ch.stem}.ipynb").read_text())
        code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        for path in ch.code:
            assert (root / path).exists(), f"{ch.stem}: {path} does not exist"
            mod = importlib.import_module(path.rstrip("/").removesuffix(".py").replace("/", "."))
            defined = {n for n, v in vars(mod).items() if not n.startswith("_")
                       and (inspect.isfunction(v) or inspect.isclass(v))
                       and (getattr(v, "__module__", "") or "").startswith(mod.__name__)}
            used = {n for n in defined if re.search(rf"\b{n}\b", code)}
            assert used, f"{ch.stem}: names none of {path}'s functions in its code cells"


def test_code_spans_naming_a_notebook_become_links(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "03_x_solutions.ipynb").write_text("{}")
    (tmp_path / "03_x.ipynb").write_text("{}")
    md = ("Solutions: `solutions/03_x_solutions.ipynb` (after).\n```\n`solutions/03_x_solutions.ipynb`\n```\n"
          "`missing.ipynb` and [`03_x.ipynb`](03_x.ipynb)")
    out = site.link_notebook_paths(md, tmp_path, tmp_path)
    assert out.splitlines()[0] == ("Solutions: [`solutions/03_x_solutions.ipynb`]"
                                   "(solutions/03_x_solutions.ipynb) (after).")
    assert out.splitlines()[2] == "`solutions/03_x_solutions.ipynb`"           # fenced: untouched
    assert out.splitlines()[4] == "`missing.ipynb` and [`03_x.ipynb`](03_x.ipynb)"
    back = site.link_notebook_paths("see `../03_x.ipynb`", tmp_path / "solutions", tmp_path)
    assert back == "see [`../03_x.ipynb`](../03_x.ipynb)"


def test_the_site_shows_the_header_as_a_card_under_the_title():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 03 · Title\n\n**What you will learn**\n- x"),
                                         nbformat.v4.new_code_cell("1")])
    site.set_header(nb, site.header_markdown(site.chapter("03_attention_rollout"), {"full": {}, "quick": {}}))
    site._card_under_title(nb)
    assert [c.cell_type for c in nb.cells] == ["markdown", "markdown", "markdown", "code"]
    assert nb.cells[0].source == "# 03 · Title"
    assert nb.cells[1].source.startswith(":::{admonition} This chapter\n:class: chapter-header\n- **You will learn:**")
    assert nb.cells[1].source.endswith("\n:::") and site.HEADER_MARK not in nb.cells[1].source
    assert nb.cells[2].source == "**What you will learn**\n- x"
    assert "not measured yet" in nb.cells[1].source


# ---------------------------------------------------------------------------------- the site

def _why_no_browser() -> str | None:
    missing = [name for name, found in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER),
                                        ("npm", shutil.which("npm"))) if not found]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[site]')")
    if missing:
        return ("the site test needs " + ", ".join(missing)
                + " (apt-get install -y chromium chromium-driver npm; .ci/run installs them)")
    return None


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    why = _why_no_browser()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("site")
    clone = tmp / "clone"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, clone / rel)
    cached = ROOT / "build" / "site-assets"                 # reuse a checked download if there is one
    if cached.is_dir():
        shutil.copytree(cached, tmp / "work" / "site-assets")
    t0 = time.perf_counter()
    out = site.build(clone, tmp / "html", work=tmp / "work")
    print(f"site built in {time.perf_counter() - t0:.0f} s")
    return out


@pytest.fixture(scope="module")
def served(built_site):
    handler = functools.partial(_QuietHandler, directory=str(built_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser(tmp_path_factory, built_site):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage", "--window-size=1280,900",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
                 # every host but the local server is unreachable, so an outside request cannot pass
                 "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(120)
    driver.set_script_timeout(120)
    yield driver
    driver.quit()


def _pages(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts)


@pytest.mark.slow
def test_the_site_has_every_chapter_in_order_with_solutions_and_the_teachers_kit(built_site):
    index = (built_site / "index.html").read_text()
    order = [index.find(f'href="notebooks/{c.stem}.html"') for c in site.CHAPTERS]
    assert all(i > 0 for i in order) and order == sorted(order), order       # primer first, 03a after 03
    assert 'href="notebooks/README.html"' in index
    assert "vitlab — look inside Vision Transformers" in index                 # the README is the landing page
    for ch in site.CHAPTERS:
        page = (built_site / "notebooks" / f"{ch.stem}.html").read_text()
        if "chapter-header" in page:                                           # once headers are written
            assert page.index("chapter-header") > page.index("<h1")
        if ch.solutions:
            # linked from the exercises ("solutions/NN_..." in the chapter's text)
            assert f'href="{ch.solutions[:-len(".ipynb")]}.html' in page.replace("%5F", "_"), ch.stem
            assert (built_site / "notebooks" / ch.solutions.replace(".ipynb", ".html")).is_file()
    assert (built_site / "search.html").is_file() and (built_site / "searchindex.js").is_file()
    for asset in ("mathjax/tex-svg-full.js", "widgets/embed.js"):
        assert (built_site / "_static" / asset).is_file()
    html = "".join(p.read_text() for p in _pages(built_site))
    assert "cdn.jsdelivr" not in html and "cdnjs" not in html and "unpkg.com" not in html


@functools.lru_cache(maxsize=None)
def _ids(page: Path) -> frozenset:
    parser = _Links()
    parser.feed(page.read_text())
    return frozenset(parser.ids)


@pytest.mark.slow
def test_every_internal_link_resolves(built_site):
    broken = []
    for page in _pages(built_site):
        parser = _Links()
        parser.feed(page.read_text())
        for href in parser.hrefs:
            url = urlparse(href)
            if url.scheme or url.netloc or href.startswith(("mailto:", "javascript:")):
                continue
            target = page if not url.path else (page.parent / unquote(url.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(built_site)}: {href}")
                continue
            if url.fragment and target.suffix == ".html" and unquote(url.fragment) not in _ids(target):
                broken.append(f"{page.relative_to(built_site)}: {href} (no such anchor)")
    assert not broken, "\n".join(broken[:30])


_PAGE_CHECK = """
const done = arguments[arguments.length - 1];
(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  await new Promise(r => setTimeout(r, 300));
  const unrendered = Array.from(document.querySelectorAll('.math')).filter(
      e => !e.querySelector('mjx-container') && !e.closest('mjx-container')).length;
  const rendered = document.querySelectorAll('mjx-container').length;
  const imgs = Array.from(document.images);
  const broken = imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src);
  const body = document.body.cloneNode(true);   // the prose: code, scripts and typeset math left out
  body.querySelectorAll('pre, code, script, style, textarea, mjx-container').forEach(e => e.remove());
  const text = body.textContent;
  const views = document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]').length;
  const widgets = document.querySelectorAll('.widget-subarea, .jupyter-widgets').length;
  done({unrendered, rendered, images: imgs.length, broken, raw: (text.match(/\\$\\$|\\\\\\(|\\\\\\[/g) || []).length,
        width: document.documentElement.scrollWidth, viewport: window.innerWidth, views, widgets,
        title: document.title});
})();
"""


@pytest.mark.slow
def test_every_page_renders_offline_in_chromium(built_site, served, browser):
    problems, seen_math, seen_widgets = [], 0, 0
    for page in _pages(built_site):
        rel = page.relative_to(built_site).as_posix()
        browser.get_log("performance")                                          # drop the last page's
        browser.get(f"{served}/{rel}")
        r = browser.execute_async_script(_PAGE_CHECK)
        errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        requests = []
        for entry in browser.get_log("performance"):
            msg = json.loads(entry["message"])["message"]
            if msg["method"] == "Network.requestWillBeSent":
                requests.append(msg["params"]["request"]["url"])
        # chrome:// is the browser's own (e.g. the search box's clear icon), never the network
        outside = [u for u in requests if not u.startswith((served, "data:", "blob:", "about:", "chrome://"))]
        if errors:
            problems.append(f"{rel}: console errors {errors[:3]}")
        if outside:
            problems.append(f"{rel}: requests to other hosts {outside[:3]}")
        if r["broken"]:
            problems.append(f"{rel}: images not loaded {r['broken'][:3]}")
        if r["unrendered"] or r["raw"]:
            problems.append(f"{rel}: math not typeset ({r['unrendered']} elements, {r['raw']} raw delimiters)")
        if r["width"] > r["viewport"]:
            problems.append(f"{rel}: {r['width']} px wide in a {r['viewport']} px window")
        if r["views"] and not r["widgets"]:
            problems.append(f"{rel}: {r['views']} stored widgets, none drawn")
        seen_math += r["rendered"]
        seen_widgets += r["widgets"]
    assert not problems, "\n".join(problems)
    assert seen_math > 0                                   # the checks saw typeset math at all


@pytest.mark.slow
def test_search_finds_a_chapter(served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{served}/search.html?q=rollout")
    WebDriverWait(browser, 60).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#search-results ul.search li"))
    hits = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "#search-results ul.search li a")]
    assert any(h and urljoin(served, "notebooks/03_attention_rollout.html") in h for h in hits), hits[:10]


@pytest.fixture
def fake_sphinx(tmp_path, monkeypatch):
    """site.build without npm and Sphinx: the assets and staging are stubbed, and the Sphinx
    command writes two pages into its output folder (its last argument)."""
    import subprocess

    from vitlab import site

    real_run = subprocess.run
    calls = []

    def run(cmd, *args, **kwargs):
        if "sphinx" not in cmd:
            return real_run(cmd, *args, **kwargs)
        out = Path(cmd[-1])
        calls.append(out)
        (out / "_static").mkdir(parents=True, exist_ok=True)
        (out / "index.html").write_text("<html>index</html>")
        (out / "_static" / "site.css").write_text("body {}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(site, "fetch_assets", lambda dest: tmp_path / "assets")
    monkeypatch.setattr(site, "stage", lambda repo, dest: tmp_path / "src")
    monkeypatch.setattr(subprocess, "run", run)
    return calls


def _build(out, capsys):
    from vitlab import site

    code = site.main(["build", "--out", str(out)])
    return code, capsys.readouterr().err


def test_site_build_refuses_a_folder_of_someone_elses_files_and_deletes_nothing(tmp_path, fake_sphinx, capsys):
    notes = tmp_path / "mine" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("months of notes")
    code, err = _build(notes.parent, capsys)
    assert code != 0
    assert notes.read_text() == "months of notes" and sorted(p.name for p in notes.parent.iterdir()) == ["notes.txt"]
    assert "notes.txt" in err and "no site build wrote" in err and "give --out a new or empty folder" in err
    assert fake_sphinx == []                                  # refused before anything ran
    code, err = _build(notes, capsys)                          # a file as --out
    assert code != 0 and "is a file" in err and notes.read_text() == "months of notes"


def test_site_build_writes_a_new_or_empty_folder_and_replaces_only_its_own_build(tmp_path, fake_sphinx, capsys):
    from vitlab import site

    out = tmp_path / "deep" / "site"
    assert _build(out, capsys)[0] == 0                           # a new folder
    assert (out / "index.html").is_file() and (out / site.BUILD_MARK).is_file()
    (out / "_static" / "stale.js").write_text("from an old build")
    import json
    record = json.loads((out / site.BUILD_MARK).read_text())
    record["paths"].append("_static/stale.js")                  # as if an older build had written it
    (out / site.BUILD_MARK).write_text(json.dumps(record))
    assert _build(out, capsys)[0] == 0                           # its own previous build: replaced
    assert not (out / "_static" / "stale.js").exists() and (out / "index.html").is_file()
    (out / "todo.md").write_text("added after the build")       # a file put into a build folder
    code, err = _build(out, capsys)
    assert code != 0 and "todo.md" in err and "added to it since" in err
    assert (out / "todo.md").read_text() == "added after the build"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _build(empty, capsys)[0] == 0 and (empty / "index.html").is_file()
    (out / "todo.md").unlink()
    (out / site.BUILD_MARK).write_text("not json")              # a damaged record: what else is there is unknown
    code, err = _build(out, capsys)
    assert code != 0 and "not the record" in err and (out / "index.html").is_file()
    assert len(fake_sphinx) == 3


def test_site_build_help_says_what_out_does(capsys):
    from vitlab import site

    with pytest.raises(SystemExit):
        site.main(["build", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--out" in text and "refused" in text and "nothing of yours is deleted" in text
