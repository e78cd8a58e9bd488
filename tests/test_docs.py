"""The documentation site's sources, checked without building it (CI builds it with
`mkdocs build --strict`, which checks every link and anchor of the pages themselves).

- every `docs/semantics.md#...` anchor the code and the root files cite is an anchor of that index page
  (the account itself lives in docs/semantics/*.md, one page per topic);
- every page in mkdocs.yml's navigation exists, and every guide, semantics page and placeholder
  page under docs/ is in the navigation.
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
