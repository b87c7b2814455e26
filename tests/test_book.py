"""The book (`./run.sh book`, scripts/build_book.py): the site is built from the committed notebooks
and opened from disk in headless Chromium, with the network off. Every page of the sidebar shows
its notebook's headings, all its figures (loaded: naturalWidth > 0) and its math (typeset by the
bundled MathJax, no error); no page logs a console error or asks for the network; no link between
the site's files is broken (target file and #anchor); search works from disk; the API page
documents every name of `pa_tile.__all__`. A screenshot of chapter 00 goes to
docs/book_screenshot.png (the README shows it). The checkers are shown to catch a deleted figure,
a figure taken out of a page, a link to a missing page and a link to a missing anchor.

Chromium (Debian's `chromium`) and the `book` extra are installed by .ci/run: in CI (CI=true)
their absence fails the test; elsewhere it skips. The browser is driven over the DevTools
protocol on a pipe (`--remote-debugging-pipe`), with the standard library only."""

from __future__ import annotations

import base64
import fcntl
import importlib.util
import json
import os
import posixpath
import queue
import re
import shutil
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("PA_TILE_CHROMIUM", "/usr/bin/chromium")  # Debian's; another build by path
SCREENSHOT = ROOT / "docs" / "book_screenshot.png"
SCREENSHOT_PAGE = "notebooks/00_paged_decode"  # the first chapter: a figure, math, the sidebar
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

_spec = importlib.util.spec_from_file_location("build_book", ROOT / "scripts" / "build_book.py")
book = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(book)


def _missing(what: str):
    """CI must have every tool the test needs; a reader's machine may lack Chromium or the extra."""
    if IN_CI:
        pytest.fail(f"{what} (.ci/run installs it)")
    pytest.skip(what)


# ---------------------------------------------------------------- what each page must show


# a fenced code block: a `# comment` inside it is no heading, `$$` no math
FENCED = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.M | re.S)


def _norm(text: str) -> str:
    """A heading's words, whatever the markup: letters and digits only, lower case."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [text](url) -> text
    return "".join(ch for ch in text.lower() if ch.isalnum())


@dataclass
class Expected:
    headings: list[str]  # normalized
    figures: int         # image outputs shown
    display_math: int    # $$...$$ blocks


def expected(source: Path) -> Expected:
    """What the page of a notebook or Markdown file must show, read off the source."""
    if source.suffix != ".ipynb":
        md = [FENCED.sub("", source.read_text())]
        figures = 0
    else:
        nb = json.loads(source.read_text())
        md = [FENCED.sub("", "".join(c["source"])) for c in nb["cells"] if c["cell_type"] == "markdown"]
        figures = sum(
            1
            for cell in nb["cells"] if cell["cell_type"] == "code"
            and not {"remove-output", "remove-cell"} & set(cell.get("metadata", {}).get("tags", []))
            for out in cell.get("outputs", []) if any(m.startswith("image/") for m in out.get("data", {})))
    headings = [_norm(m) for text in md for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)]
    return Expected(headings, figures, sum(text.count("$$") // 2 for text in md))


# ---------------------------------------------------------------- links between the site's files


class _Refs(HTMLParser):
    REF_ATTRS = {"a": "href", "link": "href", "img": "src", "script": "src", "iframe": "src", "source": "src"}

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key])
        ref = a.get(self.REF_ATTRS.get(tag, ""))
        if ref:
            self.refs.append(ref)
        if tag == "meta" and (a.get("http-equiv") or "").lower() == "refresh":
            m = re.search(r"url=(.+)", a.get("content") or "", flags=re.I)
            if m:
                self.refs.append(m.group(1).strip())


def html_pages(site: Path) -> list[Path]:
    """The site's pages (theme templates under _static are not pages)."""
    return sorted(p for p in site.rglob("*.html") if p.relative_to(site).parts[0] not in {"_static", "_sources"})


def broken_links(site: Path) -> list[str]:
    """Every reference from a page to a file of the site (a, link, img, script, meta refresh) whose
    file is missing, or whose #anchor is not an id of the target page."""
    parsed: dict[Path, _Refs] = {}

    def parse(page: Path) -> _Refs:
        if page not in parsed:
            parsed[page] = _Refs()
            parsed[page].feed(page.read_text(errors="replace"))
        return parsed[page]

    problems = []
    for page in html_pages(site):
        for ref in parse(page).refs:
            parts = urlsplit(ref)
            if parts.scheme or parts.netloc:  # http(s), mailto, data, javascript: not the site's files
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            where = f"{page.relative_to(site)}: {ref}"
            if not target.is_file():
                problems.append(f"{where} -> missing file")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in parse(target).ids:
                problems.append(f"{where} -> no id {parts.fragment!r} in {target.relative_to(site)}")
    return problems


# ---------------------------------------------------------------- headless Chromium, DevTools protocol on a pipe


def _above_4(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class Chromium:
    """One headless Chromium, one tab, driven over `--remote-debugging-pipe` (fd 3 in, fd 4 out,
    messages JSON, each ended by a NUL byte). The network is switched off: a page that asks for
    anything but a local file is reported."""

    FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--remote-debugging-pipe", "--hide-scrollbars"]

    def __init__(self, binary: str, profile: Path):
        (r, to_browser), (from_browser, w) = os.pipe(), os.pipe()
        r, w = (_above_4(fd) for fd in (r, w))  # so that putting one on 3 or 4 cannot close the other
        # bash puts the browser's ends of the pipes on fd 3 and 4 and execs it (no preexec_fn:
        # the test may run in a process with threads, e.g. an xdist worker)
        onto_3_and_4 = f'exec "$@" 3<&{r} 4>&{w} {r}<&- {w}>&-'
        self.log = profile / "chromium.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(["bash", "-c", onto_3_and_4, "chromium", binary, *self.FLAGS,
                                          f"--user-data-dir={profile}"],
                                         pass_fds=(r, w), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        os.close(r)
        os.close(w)
        self._out = os.fdopen(to_browser, "wb")
        self._in = os.fdopen(from_browser, "rb")
        self._queue: queue.Queue = queue.Queue()
        self._events: list[dict] = []
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.call(f"{domain}.enable", session=True)
            self.call("Network.emulateNetworkConditions", session=True, offline=True, latency=0,
                      downloadThroughput=-1, uploadThroughput=-1)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def _read(self):
        buf = b""
        while chunk := self._in.read1(1 << 16):
            buf += chunk
            *messages, buf = buf.split(b"\0")
            for m in messages:
                self._queue.put(json.loads(m))
        self._queue.put(None)

    def _next(self, deadline: float) -> dict:
        try:
            m = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("Chromium did not answer in time") from None
        if m is None:
            raise RuntimeError(f"Chromium exited; its log:\n{self.log.read_text()[-2000:]}")
        return m

    def call(self, method: str, session: bool = False, timeout: float = 60, **params) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self._out.write(json.dumps(msg).encode() + b"\0")
        self._out.flush()
        deadline = time.monotonic() + timeout
        while True:
            m = self._next(deadline)
            if m.get("id") == self._next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m["result"]
            self._events.append(m)

    def _wait_for(self, event: str, timeout: float = 60) -> None:
        if any(e.get("method") == event for e in self._events):
            return
        deadline = time.monotonic() + timeout
        while True:
            m = self._next(deadline)
            self._events.append(m)
            if m.get("method") == event:
                return

    def evaluate(self, expression: str):
        r = self.call("Runtime.evaluate", session=True, expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, url: str) -> list[str]:
        """Load `url` and wait for its load event; -> its console errors, exceptions and network asks."""
        self._events.clear()
        self.call("Page.navigate", session=True, url=url)
        self._wait_for("Page.loadEventFired")
        return self.errors()

    def errors(self) -> list[str]:
        found = []
        for e in self._events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                found.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif method == "Runtime.consoleAPICalled" and p["type"] in {"error", "assert"}:
                found.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                found.append(f"console: {p['entry']['text']} {p['entry'].get('url', '')}".strip())
            elif method == "Network.requestWillBeSent":
                scheme = urlsplit(p["request"]["url"]).scheme
                if scheme not in {"file", "data", "about", "blob"}:
                    found.append(f"network request: {p['request']['url']}")
        return found

    def screenshot(self, url: str, width: int = 1280, height: int = 800) -> bytes:
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        try:
            self.open(url)
            self.evaluate(PAGE_FACTS)  # math typeset, images decoded
            return base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png")["data"])
        finally:
            self.call("Emulation.clearDeviceMetricsOverride", session=True)

    def close(self):
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# What a page shows once loaded: MathJax finished, every image decoded (or failed).
PAGE_FACTS = """(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  await Promise.all([...document.images].map(i => i.decode().catch(() => null)));
  const main = document.querySelector('article') || document.body;
  return {
    headings: [...main.querySelectorAll('h1, h2, h3, h4, h5, h6')].map(h => h.textContent),
    images: [...document.images].map(i => ({src: i.getAttribute('src'), ok: i.complete && i.naturalWidth > 0,
                                           inMain: main.contains(i)})),
    math: [...main.querySelectorAll('.math')].map(m => ({typeset: !!m.querySelector('mjx-container'),
                                                         error: !!m.querySelector('mjx-merror'),
                                                         tex: m.textContent.slice(0, 60)})),
    mathjax: !!window.MathJax,
  };
})()"""


def page_problems(browser: Chromium, site: Path, docname: str, want: Expected | None) -> list[str]:
    """Open one page from disk; -> what is wrong with it (empty: it renders as it should)."""
    url = (site / f"{docname}.html").as_uri()
    problems = browser.open(url)
    facts = browser.evaluate(PAGE_FACTS)
    problems += browser.errors()[len(problems):]  # anything logged while math and images finished
    shown = {_norm(h) for h in facts["headings"]}
    if not shown:
        problems.append("no heading")
    for img in facts["images"]:
        if not img["ok"]:
            problems.append(f"image not loaded: {img['src']}")
    for m in facts["math"]:
        if not m["typeset"] or m["error"]:
            problems.append(f"math not typeset: {m['tex']!r}")
    if want:
        problems += [f"heading missing: {h!r}" for h in want.headings if h not in shown]
        figures = sum(img["inMain"] for img in facts["images"])
        if figures < want.figures:
            problems.append(f"{figures} figures shown, the notebook has {want.figures}")
        if len(facts["math"]) < want.display_math:
            problems.append(f"{len(facts['math'])} math elements, the notebook has {want.display_math} $$ blocks")
        if want.display_math and not facts["mathjax"]:
            problems.append("MathJax not loaded")
    return [f"{docname}: {p}" for p in problems]


# ---------------------------------------------------------------- fixtures


@dataclass
class Site:
    html: Path
    warnings: str
    sources: dict[str, Path] = field(default_factory=dict)  # docname -> source file, sidebar order


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Site:
    for module in ("sphinx", "myst_nb", "sphinx_book_theme"):
        if importlib.util.find_spec(module) is None:
            _missing(f"{module} is not installed: pip install -e '.[book]'")
    out = tmp_path_factory.mktemp("book") / "html"
    warnings = out.parent / "warnings.txt"
    try:
        book.build(out, warnings_file=warnings)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"the book does not build:\n{(e.stdout or '')[-3000:]}\n{(e.stderr or '')[-3000:]}")
    sources = {book.docname(p): ROOT / p for section in book.pages().values() for p in section}
    return Site(out, warnings.read_text(), sources)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not os.access(CHROMIUM, os.X_OK):
        _missing(f"no {CHROMIUM} (Debian: apt-get install chromium)")
    b = Chromium(CHROMIUM, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


# ---------------------------------------------------------------- the tests


def test_pages_are_read_off_the_files_in_reading_order():
    pages = book.pages()
    chapters = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    appendices = sorted(p.name for p in (ROOT / "notebooks").glob("appendix_*.ipynb"))
    assert [Path(p).name for p in pages["Chapters"]] == chapters and chapters
    assert [Path(p).name for p in pages["Appendices"]] == appendices
    assert pages["Reference"] == [book.GLOSSARY, book.API]  # the glossary is on main: it must be a page


def test_pages_follow_a_renamed_split_or_added_chapter(tmp_path):
    nb = tmp_path / "notebooks"
    nb.mkdir()
    for name in ("06_new.ipynb", "05_a.ipynb", "appendix_z.ipynb", "appendix_b.ipynb", "05_a.py", "nbval.cfg"):
        (nb / name).write_text("{}")
    assert book.pages(tmp_path) == {"Chapters": ["notebooks/05_a.ipynb", "notebooks/06_new.ipynb"],
                                    "Appendices": ["notebooks/appendix_b.ipynb", "notebooks/appendix_z.ipynb"],
                                    "Reference": []}


def test_book_builds_without_warnings(site):
    assert site.warnings.strip() == "", site.warnings


def test_sidebar_lists_every_page_in_reading_order(site):
    landing = book.docname(book.LANDING)
    index = (site.html / f"{landing}.html").read_text()
    nav = re.search(r'<nav class="[^"]*\bbd-docs-nav\b.*?</nav>', index, flags=re.S).group(0)
    linked = [posixpath.normpath(posixpath.join(posixpath.dirname(landing), unquote(h))).removesuffix(".html")
              for h in re.findall(r'<a class="reference internal" href="([^"#]+)"', nav)]
    assert linked == list(site.sources), linked


def test_every_page_renders_its_headings_figures_and_math_with_no_console_error(site, browser):
    problems = []
    for docname, source in [(book.docname(book.LANDING), None), *site.sources.items()]:
        problems += page_problems(browser, site.html, docname, expected(source) if source else None)
    assert not problems, "\n".join(problems)
    # the root index.html leads to the landing page
    assert not browser.open((site.html / "index.html").as_uri())
    landing, deadline = f"{book.docname(book.LANDING)}.html", time.monotonic() + 10
    while not _location(browser).endswith(landing):
        assert time.monotonic() < deadline, "index.html does not redirect to the landing page"
        time.sleep(0.1)


def _location(browser: Chromium) -> str:
    try:
        return browser.evaluate("location.href")
    except RuntimeError:  # asked while the page was being replaced
        return ""


def test_chapters_show_figures_and_math():
    # the checks above are not vacuous: the chapters have figures and display math to check
    want = [expected(ROOT / p) for p in book.pages()["Chapters"]]
    assert sum(w.figures for w in want) >= 10 and sum(w.display_math for w in want) >= 3
    assert all(w.headings for w in want)


def test_no_internal_link_is_broken(site):
    assert len(html_pages(site.html)) >= len(site.sources) + 1
    problems = broken_links(site.html)
    assert not problems, "\n".join(problems)


def test_search_works_from_disk(site, browser):
    url = (site.html / "search.html").as_uri() + "?q=softmax"
    assert not browser.open(url)
    hits = browser.evaluate("""(async () => {
      for (let i = 0; i < 150; i++) {  // until Sphinx's search says it has finished
        const summary = document.querySelector('#search-results .search-summary');
        if (summary && /finished/i.test(summary.textContent)) break;
        await new Promise(r => setTimeout(r, 100));
      }
      return [...document.querySelectorAll('#search-results li a')].map(a => a.getAttribute('href'));
    })()""")
    chapters_hit = {h.split("#")[0] for h in hits if h.startswith("notebooks/")}
    assert len(chapters_hit) >= 2, hits  # softmax: in most chapters
    assert not browser.errors()


def test_api_reference_documents_every_public_name(site):
    import pa_tile

    html = (site.html / f"{book.docname(book.API)}.html").read_text()
    for name in pa_tile.__all__:
        assert f'id="pa_tile.{name}"' in html, name


def test_screenshot_of_a_chapter_for_the_readme(site, browser):
    png = browser.screenshot((site.html / f"{SCREENSHOT_PAGE}.html").as_uri())
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1280, 800)
    assert len(png) > 20_000  # a rendered page, not a blank one
    if not SCREENSHOT.is_file() or SCREENSHOT.read_bytes() != png:
        SCREENSHOT.write_bytes(png)


def test_checkers_catch_a_removed_figure_and_a_broken_link(site, browser, tmp_path):
    mutated = tmp_path / "html"
    shutil.copytree(site.html, mutated, ignore=shutil.ignore_patterns("mathjax"))
    shutil.copytree(site.html / "_static" / "mathjax", mutated / "_static" / "mathjax", copy_function=os.link)
    chapters = [book.docname(p) for p in book.pages()["Chapters"]]
    with_figures = [c for c in chapters if expected(site.sources[c]).figures]
    first, second = with_figures[:2]
    gone = next(c for c in chapters if c not in (first, second))
    # 1. a figure's file deleted
    img = re.search(r'<img [^>]*src="(\.\./_images/[^"]+)"', (mutated / f"{first}.html").read_text()).group(1)
    (mutated / first).parent.joinpath(img).unlink()
    # 2. a figure taken out of a page, 3. an anchor gone (one its own contents list links to)
    page = mutated / f"{second}.html"
    text = re.sub(r'<img [^>]*src="\.\./_images/[^>]*>', "", page.read_text(), count=1)
    heading_id = re.findall(r'<section id="([^"]+)"', text)[1]
    page.write_text(text.replace(f'<section id="{heading_id}"', "<section", 1))
    # 4. a page gone: every link to it breaks
    (mutated / f"{gone}.html").unlink()

    links = broken_links(mutated)
    assert any(f"{img} -> missing file" in p for p in links), links
    assert any(p.endswith("-> missing file") and gone in p for p in links), links
    assert any(f"no id '{heading_id}'" in p for p in links), links

    shown = {c: page_problems(browser, mutated, c, expected(site.sources[c])) for c in (first, second)}
    assert any(f"image not loaded: {img}" in p for p in shown[first]), shown
    assert any("console" in p for p in shown[first]), shown  # the failed load is logged
    assert any("figures shown, the notebook has" in p for p in shown[second]), shown


def test_run_sh_book_is_documented():
    r = subprocess.run(["bash", str(ROOT / "run.sh"), "help"], capture_output=True, text=True, timeout=60)
    assert "\n  book" in r.stdout
    assert "./run.sh book" in (ROOT / "README.md").read_text()
