"""MkDocs hook: links from the docs to files of the repository outside docs/.

The Markdown pages link to the code (``../../examples/torch_llama_loop.py``) and to the root files
(``../DIVERGENCES.md``) so that they read well in the repository too. On the site:

- a link to a root file that a page includes (DIVERGENCES.md, BENCHMARKS.md) goes to that page;
- a link to any other file of the repository goes to a page of the site that shows the file as it
  was when the site was built (``source/<path>/``, generated here, not in the navigation), so the
  link works wherever the site is served, offline included, and shows the same version as the docs;
- a link to a path that is not a file of the repository (missing, or a folder) is a warning, so
  ``mkdocs build --strict`` fails on it.

``repo_url`` (mkdocs.yml, from ``$JAXPREP_REPO_URL``) only adds the theme's link to the repository:
this repository names no public home of its own, so the site does not invent one.
"""

from __future__ import annotations

import functools
import logging
import os
import re

log = logging.getLogger("mkdocs.hooks.repo_links")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INCLUDED = {"DIVERGENCES.md": "divergences.md", "BENCHMARKS.md": "benchmarks.md"}
"""Root files shown as a docs page: repository path -> page (under docs/)."""
SOURCE_DIR = "source"
"""Where the pages showing repository files go, under docs/ (generated; nothing is written there)."""
LANGUAGES = {".py": "python", ".md": "markdown", ".sh": "bash", ".toml": "toml", ".yml": "yaml", ".yaml": "yaml",
             ".json": "json"}


def repo_target(target: str, page_dir: str, docs_dir: str) -> str | None:
    """The repository path (relative to its root, ``/``-separated) a link target points to outside
    docs/, or None (a URL, an anchor, a docs page or file, a path outside the repository)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    root = os.path.dirname(docs_dir)
    where = os.path.normpath(os.path.join(page_dir, target.partition("#")[0]))
    if where == docs_dir or where.startswith(docs_dir + os.sep) or not where.startswith(root + os.sep):
        return None
    return os.path.relpath(where, root).replace(os.sep, "/")


def outside_fences(markdown: str, rewrite) -> str:
    """``markdown`` with ``rewrite`` applied to every link outside fenced code blocks."""
    parts, end = [], 0
    for fence in FENCE.finditer(markdown):
        parts += [LINK.sub(rewrite, markdown[end:fence.start()]), fence[0]]
        end = fence.end()
    return "".join([*parts, LINK.sub(rewrite, markdown[end:])])


def linked_files(pages: dict[str, str], docs_dir: str) -> set[str]:
    """Repository files (not the included root files) that ``pages`` ({absolute path: Markdown}) link to."""
    root = os.path.dirname(docs_dir)
    found = set()

    def collect(match: re.Match, page_dir: str) -> str:
        path = repo_target(match["target"], page_dir, docs_dir)
        if path is not None and path not in INCLUDED and os.path.isfile(os.path.join(root, path)):
            found.add(path)
        return match[0]

    for page_path, markdown in pages.items():
        outside_fences(markdown, functools.partial(collect, page_dir=os.path.dirname(page_path)))
    return found


def source_page(path: str, text: str) -> str:
    """The Markdown of the page showing repository file ``path`` (its ``text`` in one code block,
    fenced longer than any backtick run in it)."""
    longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=0)
    fence = "`" * max(3, longest + 1)
    language = LANGUAGES.get(os.path.splitext(path)[1], "text")
    return (f"# `{path}`\n\nThe repository's `{path}` as of this build of the site.\n\n"
            f"{fence}{language}\n{text.rstrip()}\n{fence}\n")


def source_uri(path: str) -> str:
    return f"{SOURCE_DIR}/{path}.md"


def on_files(files, config):
    """Adds a generated page for every repository file a docs page (or an included root file) links to."""
    from mkdocs.structure.files import File, InclusionLevel

    docs_dir = os.path.abspath(config["docs_dir"])
    root = os.path.dirname(docs_dir)
    pages = {}
    for file in files.documentation_pages():
        with open(file.abs_src_path, encoding="utf-8") as handle:
            pages[file.abs_src_path] = handle.read()
    for path in INCLUDED:
        with open(os.path.join(root, path), encoding="utf-8") as handle:
            pages[os.path.join(root, path)] = handle.read()
    for path in sorted(linked_files(pages, docs_dir)):
        with open(os.path.join(root, path), encoding="utf-8") as handle:
            content = source_page(path, handle.read())
        files.append(File.generated(config, source_uri(path), content=content, inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def rewrite_links(markdown: str, page_dir: str, docs_dir: str, src_uri: str) -> str:
    """``markdown`` with its links to repository files pointed at their pages on the site."""
    root = os.path.dirname(docs_dir)

    def rewrite(match: re.Match) -> str:
        path = repo_target(match["target"], page_dir, docs_dir)
        if path is None:
            return match[0]  # a docs page or file (MkDocs checks it), a URL or an anchor
        anchor = match["target"].partition("#")[2]
        if path in INCLUDED:
            target = os.path.join(docs_dir, INCLUDED[path])
        elif os.path.isfile(os.path.join(root, path)):
            target = os.path.join(docs_dir, source_uri(path))
        else:
            log.warning("%s links to '%s', which is not a file of the repository", src_uri, match["target"])
            return match[0]
        relative = os.path.relpath(target, page_dir).replace(os.sep, "/")
        return f"[{match['text']}]({relative}{'#' + anchor if anchor else ''})"

    return outside_fences(markdown, rewrite)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.generated_by is not None:  # a source page: its code block is the file itself
        return markdown
    docs_dir = os.path.abspath(config["docs_dir"])
    page_dir = os.path.dirname(page.file.abs_src_path)
    return rewrite_links(markdown, page_dir, docs_dir, page.file.src_uri)
