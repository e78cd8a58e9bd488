"""MkDocs hook: links from the docs to files of the repository outside docs/.

The Markdown pages link to the code (``../jaxprep/state.py``) and to the root files
(``../DIVERGENCES.md``) so that they read well on GitHub too. On the site, a link to a root file that
a page includes (DIVERGENCES.md, BENCHMARKS.md) goes to that page; a link to any other file of the
repository goes to ``repo_url``'s copy when mkdocs.yml sets one, and is plain text otherwise. A link
to a path that does not exist in the repository is a warning, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger("mkdocs.hooks.repo_links")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INCLUDED = {"DIVERGENCES.md": "divergences.md", "BENCHMARKS.md": "benchmarks.md"}
"""Root files shown as a docs page: repository path -> page (under docs/)."""


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = os.path.abspath(config["docs_dir"])
    root = os.path.dirname(docs_dir)
    page_dir = os.path.dirname(page.file.abs_src_path)

    def rewrite(match: re.Match) -> str:
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match[0]
        path, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(page_dir, path))
        if where == docs_dir or where.startswith(docs_dir + os.sep) or not where.startswith(root + os.sep):
            return match[0]  # a docs page or file: MkDocs checks it
        relative = os.path.relpath(where, root).replace(os.sep, "/")
        if relative in INCLUDED:
            page_path = os.path.relpath(os.path.join(docs_dir, INCLUDED[relative]), page_dir).replace(os.sep, "/")
            return f"[{match['text']}]({page_path}{'#' + anchor if anchor else ''})"
        if not os.path.exists(where):
            log.warning("%s links to '%s', which is not in the repository", page.file.src_uri, target)
            return match[0]
        if config.get("repo_url"):
            kind = "tree" if os.path.isdir(where) else "blob"
            return f"[{match['text']}]({config['repo_url'].rstrip('/')}/{kind}/main/{relative})"
        return match["text"]

    parts, end = [], 0
    for fence in FENCE.finditer(markdown):  # leave code blocks alone
        parts += [LINK.sub(rewrite, markdown[end:fence.start()]), fence[0]]
        end = fence.end()
    return "".join([*parts, LINK.sub(rewrite, markdown[end:])])
