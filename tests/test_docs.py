"""The documentation site's sources, checked without building it (CI builds it with
`mkdocs build --strict`, which checks every link and anchor of the pages themselves).

- every `docs/semantics.md#...` anchor the code and the root files cite is an anchor of that index page
  (the account itself lives in docs/semantics/*.md, one page per topic);
- every page in mkdocs.yml's navigation exists, and every guide, semantics page and placeholder
  page under docs/ is in the navigation;
- links to repository files lead to the site's pages of those files (docs/_hooks/repo_links.py);
- each navigation entry's label is how its page's title begins, and the guides come in groups;
- the site's extra stylesheet widens the page so that a 120-character code line fits;
- a reader's link to a section of the semantics (README, the root files, the guides) goes to the page that
  holds the section, not to the index (where an anchor only leads to a row of its table).
"""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CITATION = re.compile(r"docs/semantics\.md#([\w-]+)")
SOURCE_DIRS = ("jaxprep", "torch_bridge", "benchmarks", "tests", "notebooks")
ROOT_FILES = ("README.md", "DIVERGENCES.md", "BENCHMARKS.md")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as file:
        return file.read()


def index_anchors() -> set[str]:
    return set(re.findall(r'<a id="([\w-]+)"></a>', read("docs/semantics.md")))


def cited_anchors() -> dict[str, str]:
    """{anchor: one file citing it} over the code, the tests, the notebooks and the root files."""
    cited = {}
    paths = [os.path.relpath(os.path.join(folder, name), ROOT)
             for top in SOURCE_DIRS for folder, _, names in os.walk(os.path.join(ROOT, top))
             for name in names if name.endswith((".py", ".md", ".sh"))]
    for path in [*paths, *ROOT_FILES]:
        for anchor in CITATION.findall(read(path)):
            cited.setdefault(anchor, path)
    return cited


def test_every_cited_semantics_anchor_is_on_the_index_page():
    anchors, cited = index_anchors(), cited_anchors()
    assert len(cited) > 30  # the docstrings cite dozens of sections
    missing = {anchor: path for anchor, path in cited.items() if anchor not in anchors}
    assert not missing, f"docs/semantics.md has no anchor for {missing}"
    assert "no-such-section" not in anchors  # negative control: a made-up anchor is not found


@pytest.mark.parametrize("anchor", ["jax-traps", "example-a-step-1", "spec-decode"])
def test_an_index_anchor_leads_to_the_page_with_that_section(anchor):
    link = re.search(rf'<a id="{anchor}"></a>\[[^\]]*\]\((semantics/[\w-]+\.md)#{anchor}\)', read("docs/semantics.md"))
    headings = re.findall(r"^#+ (.+)$", read(f"docs/{link.group(1)}"), flags=re.M)
    slugs = {re.sub(r"[^\w\- ]", "", heading.lower()).strip().replace(" ", "-") for heading in headings}
    assert anchor in slugs


INDEX_LINK = re.compile(r"\]\(((?:\.\./)*(?:docs/)?semantics\.md#[\w-]+)\)")
"""A Markdown link into the semantics index with an anchor (a citation in code stays plain text)."""


def test_readers_links_to_a_semantics_section_go_to_its_page():
    pages = [*ROOT_FILES, *(os.path.relpath(os.path.join(folder, name), ROOT) for folder, _, names in
                            os.walk(os.path.join(ROOT, "docs")) for name in names if name.endswith(".md"))]
    found = {page: INDEX_LINK.findall(read(page)) for page in pages if page != os.path.join("docs", "semantics.md")}
    assert not {page: links for page, links in found.items() if links}, "link the section's page, not the index"
    assert INDEX_LINK.findall("[example A](docs/semantics.md#example-a-step-1)")  # negative control
    assert "semantics/examples.md#example-a-step-1" in read("README.md")


def nav_pages() -> list[str]:
    return re.findall(r"^\s+- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", read("mkdocs.yml"), flags=re.M)


def test_the_navigation_lists_existing_pages_and_every_page():
    pages = nav_pages()
    assert len(pages) == len(set(pages)) > 30
    for page in pages:
        assert os.path.isfile(os.path.join(ROOT, "docs", page)), f"mkdocs.yml: docs/{page} does not exist"
    on_disk = {os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, "docs")).replace(os.sep, "/")
               for folder, _, names in os.walk(os.path.join(ROOT, "docs")) for name in names if name.endswith(".md")}
    assert on_disk <= set(pages), f"pages not in mkdocs.yml's nav: {sorted(on_disk - set(pages))}"
    for name in ("serving_updates", "vllm", "errors", "attention", "real_models", "gpu"):  # the guides of issues
        assert f"guides/{name}.md" in pages  # 21-24 slot in under these names


def repo_links_hook():
    """docs/_hooks/repo_links.py, the MkDocs hook, as a module (it needs MkDocs only when MkDocs calls it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("repo_links", os.path.join(ROOT, "docs", "_hooks", "repo_links.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_links_to_repository_files_lead_to_their_pages_on_the_site(caplog):
    """A link from a page to a file of the repository becomes a link to the site's page of that file
    (generated by the hook, so it works without a repository URL); a link to an included root file
    goes to its docs page. Negative controls: a link to a missing file or to a folder is a warning (a
    strict build fails on it), and a link inside a code block is left alone."""
    hook, docs = repo_links_hook(), os.path.join(ROOT, "docs")
    pages = {os.path.join(docs, page): read(f"docs/{page}") for page in nav_pages()}
    linked = hook.linked_files(pages, docs)
    assert {"examples/torch_llama_loop.py", "notebooks/01_chunked_prefill.py"} <= linked
    assert all(os.path.isfile(os.path.join(ROOT, path)) for path in linked) and "DIVERGENCES.md" not in linked
    guide = os.path.join(docs, "guides")
    page = ("[loop](../../examples/torch_llama_loop.py) and [why](../../DIVERGENCES.md#why) and "
            "[a page](padding.md)\n```\n[kept](../../examples/torch_llama_loop.py)\n```\n")
    assert hook.rewrite_links(page, guide, docs, "guides/x.md") == (
        "[loop](../source/examples/torch_llama_loop.py.md) and [why](../divergences.md#why) and "
        "[a page](padding.md)\n```\n[kept](../../examples/torch_llama_loop.py)\n```\n")
    for broken in ("../../examples/no_such_file.py", "../../examples"):
        with caplog.at_level("WARNING", logger="mkdocs.hooks.repo_links"):
            caplog.clear()
            assert hook.rewrite_links(f"[x]({broken})", guide, docs, "guides/x.md") == f"[x]({broken})"
        assert "is not a file of the repository" in caplog.text, broken


def test_a_source_page_holds_the_whole_file_in_one_code_block():
    """The generated page shows the file verbatim; its fence outlasts any fence inside the file
    (negative control: a file with a ``` block would close a three-backtick fence early)."""
    hook = repo_links_hook()
    text = read("examples/torch_llama_loop.py")
    page = hook.source_page("examples/torch_llama_loop.py", text)
    assert page.startswith("# `examples/torch_llama_loop.py`") and text.rstrip() in page
    assert "\n```python\n" in page and page.endswith("\n```\n")
    nested = hook.source_page("guide.md", "Intro\n```python\nx = 1\n```\n")
    assert "\n````markdown\n" in nested and nested.endswith("\n````\n")


INCLUDE = re.compile(r'\{% include-markdown "\.\./([\w.]+)" %\}')


def page_title(page: str) -> str:
    """The first ``# `` heading of ``docs/page``, or of the root file it includes, without backticks."""
    text = read(f"docs/{page}")
    if included := INCLUDE.search(text):
        text = read(included[1])
    return re.search(r"^# (.+)$", text, re.M)[1].replace("`", "")


def nav_entries() -> list[tuple[str, str]]:
    return re.findall(r"^\s+- ([^:\n]+): ([\w/.-]+\.md)\s*$", read("mkdocs.yml"), flags=re.M)


def test_each_navigation_label_begins_its_pages_title():
    entries = [(label, page) for label, page in nav_entries() if label != "Home"]
    assert len(entries) > 30
    differ = {label: page_title(page) for label, page in entries if not page_title(page).startswith(label)}
    assert not differ, f"navigation labels that are not how their page's title begins: {differ}"
    labels = {page: label for label, page in entries}
    gpu, runbook = labels["guides/gpu.md"], labels["guides/gpu-runbook.md"]
    assert not gpu.startswith(runbook) and not runbook.startswith(gpu)  # the two GPU pages told apart


def test_the_guides_come_in_groups_of_a_few():
    nav = read("mkdocs.yml")
    guides = nav[nav.index("  - Guides:"):nav.index("  - Semantics:")]
    groups = re.split(r"^      - [^:\n]+:\s*$", guides, flags=re.M)[1:]
    assert len(groups) >= 3 and sum(len(re.findall(r"\.md\s*$", g, re.M)) for g in groups) == 18
    assert all(len(re.findall(r"\.md\s*$", group, re.M)) <= 7 for group in groups)


def test_the_extra_stylesheet_widens_code_blocks():
    assert "stylesheets/extra.css" in read("mkdocs.yml")
    css = read("docs/stylesheets/extra.css")
    assert re.search(r"\.md-grid\s*\{\s*max-width:\s*100rem", css) and "pre > code" in css
