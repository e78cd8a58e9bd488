"""The API reference (docs/reference/*.md, rendered by mkdocstrings from the docstrings), checked
from the sources with griffe, the library mkdocstrings reads them with, without building the site:

- no docstring of jaxprep or torch_bridge renders a Markdown heading. A worked example
  (``# num_scheduled [2, 5, 3] -> ...``, STYLE.md's comment form) goes in a fenced code block in a
  docstring: a bare ``# ...`` line is an ``<h1>`` on the page, and an indented block is not enough,
  since ``inspect.cleandoc`` dedents a docstring whose only body is the example;
- every member a reference page shows has a signature: a jitted function is a ``def`` under
  ``@jax.jit`` (or ``functools.partial(jax.jit, ...)``) that calls its ``_body``; ``f = jax.jit(body)``
  is an attribute to griffe, shown with no signature, and without a docstring not at all;
- every name a reference page lists (a module's ``__all__``, a ``members:`` option) has a docstring:
  mkdocstrings leaves out an undocumented member without a word;
- every docstring parses in the style mkdocs.yml gives mkdocstrings (Google's): an ``Args:``,
  ``Attributes:``, ``Returns:`` or ``Raises:`` section that does not parse stays one paragraph of text
  on the page, and griffe's warnings (an entry it cannot read) fail the check too;
- an example in a docstring is fenced: an indented one is dedented with the docstring and renders as
  prose;
- every field of the step and of the configurations is described in its class's ``Attributes:``.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap

import griffe  # griffelib and markdown: the test extra (mkdocstrings reads the docstrings with both)
import markdown
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxprep", "torch_bridge")
SECTION_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters|Attributes|Returns|Raises|Yields|Examples?|Notes?|"
                            r"Warnings?|Warns|Receives|Other Parameters|Methods|Functions|Classes|Modules):\s*$", re.M)
"""A line Google's style reads as a section header: left in a text section, it was not parsed."""
FENCED = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.S | re.M)
CODE_LINE = re.compile(r"^\s*(?:[\w.\[\], ]+ = [\w.]+\(|[\w.]+\(.*\)\s*$|>>> |\$ |jaxprep \w+ --)", re.M)
"""A line of code outside a fence: an assignment from a call, a bare call, a prompt, a command line."""
DESCRIBED = ("jaxprep.StepInputs", "jaxprep.AttentionMetadata", "jaxprep.PrepConfig", "jaxprep.FeatureConfig",
             "jaxprep.serving.ServingConfig", "jaxprep.serving.AdapterStep")
"""The classes whose every field the reference describes (their ``Attributes:`` sections)."""
DIRECTIVE = re.compile(r"^::: ([\w.]+)\n((?:[ \t]+.*\n?)*)", re.M)
HEADING = re.compile(r"<h[1-6][^>]*>(.*?)</h[1-6]>", re.S)


def load(packages=PACKAGES, root=ROOT):
    """griffe's view of ``packages`` (as mkdocstrings loads them: statically, aliases resolved)."""
    loader = griffe.GriffeLoader(search_paths=[root])
    for package in packages:
        loader.load(package)
    loader.resolve_aliases(implicit=False, external=False)
    return loader.modules_collection


def walk(obj):
    """``obj`` and every object defined under it (not the names it imports)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from walk(member)


def rendered_headings(docstring: str) -> list[str]:
    """The headings ``docstring`` renders to as Markdown (fenced code blocks on, as on the site)."""
    html = markdown.markdown(docstring, extensions=["fenced_code"])
    return [re.sub(r"<[^>]+>", "", heading) for heading in HEADING.findall(html)]


def heading_docstrings(objects) -> dict[str, list[str]]:
    """{object path: the headings its docstring renders} for the objects whose docstring has one."""
    found = {}
    for obj in objects:
        if obj.docstring is not None and (headings := rendered_headings(obj.docstring.value)):
            found[obj.path] = headings
    return found


def reference_directives(folder: str = os.path.join(ROOT, "docs", "reference")) -> list[tuple[str, list | None]]:
    """``(object path, members option or None)`` of every ``::: path`` block of the reference pages."""
    found = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), encoding="utf-8") as file:
            for match in DIRECTIVE.finditer(file.read()):
                members = re.search(r"^\s+members:\s*\[(.*)\]\s*$", match[2], re.M)
                found.append((match[1], [m.strip() for m in members[1].split(",")] if members else None))
    return found


def listed_names(module, members: list | None) -> list[str]:
    """The names a ``::: module`` block shows: its ``members:`` option, else its ``__all__``, else its
    public names."""
    if members is not None:
        return members
    if module.exports is not None:
        return [str(name) for name in module.exports]
    return [name for name in module.members if not name.startswith("_")]


def page_members(collection, directives) -> dict[str, object]:
    """{path on the page: object} of what the reference pages show: every member a ``::: module`` block
    lists, and the object of a ``::: module.name`` block (aliases not yet resolved)."""
    shown = {}
    for path, members in directives:
        obj = collection[path]
        if not obj.is_module:
            shown[path] = obj
            continue
        for name in listed_names(obj, members):
            shown[f"{path}.{name}"] = obj[name]
    return shown


def target(obj):
    return obj.final_target if obj.is_alias else obj


def unrendered(shown: dict) -> list[str]:
    """Listed members the page leaves out: those without a docstring, and a name that is also a
    submodule's (``jaxprep.validate``: griffe sees the module, which ``show_submodules: false`` hides)
    unless a ``::: module.name`` block shows the function itself."""
    missing = []
    for path, obj in shown.items():
        found = target(obj)
        if found.is_module:
            if f"{found.path}.{path.rsplit('.', 1)[1]}" not in shown:
                missing.append(path)
        elif found.docstring is None:
            missing.append(path)
    return sorted(missing)


def without_signature(shown: dict, search_path: str = ROOT) -> list[str]:
    """Listed members that are callables bound as attributes (``f = jax.jit(body)``): the page shows
    them with no signature."""
    missing = []
    for path, obj in shown.items():
        found = target(obj)
        if found.kind is not griffe.Kind.ATTRIBUTE or not found.parent.is_module:  # a property, a field
            continue
        if search_path not in sys.path:
            sys.path.insert(0, search_path)
        value = getattr(importlib.import_module(found.parent.path), found.name)
        if callable(value):
            missing.append(path)
    return sorted(missing)


@pytest.fixture(scope="module")
def collection():
    return load()


def test_no_docstring_renders_a_heading(collection):
    objects = [obj for package in PACKAGES for obj in walk(collection[package])]
    assert len(objects) > 1000  # every module, class, function and documented attribute
    found = heading_docstrings(objects)
    assert not found, ("docstring lines that render as Markdown headings (put a worked example in a ``` fence): "
                       f"{found}")


def test_the_heading_check_catches_a_bare_or_indented_example():
    """Negative controls: LoRAConfig.captured_lora_counts' example as it was (a bare ``# ...`` line),
    the same indented as an example-only body (cleandoc dedents it), and a setext underline; fenced
    it renders as code."""
    before = "The capture sizes.\n\n# max_loras 4: specialize -> (1, 2, 4, 5); else -> (5,)"
    assert rendered_headings(before) == ["max_loras 4: specialize -&gt; (1, 2, 4, 5); else -&gt; (5,)"]
    indented = griffe.Docstring('The capture sizes.\n\n        # max_loras 4 -> (5,)\n    ').value
    assert rendered_headings(indented) == ["max_loras 4 -&gt; (5,)"]
    assert rendered_headings("The counts\n----------\n") == ["The counts"]
    assert rendered_headings("The capture sizes.\n\n```\n# max_loras 4 -> (5,)\n```") == []


def test_every_listed_member_is_documented_with_a_signature(collection):
    directives = reference_directives()
    assert ("jaxprep", None) in directives and len(directives) >= 6
    shown = page_members(collection, directives)
    assert {"jaxprep.prepare_padded", "jaxprep.features.drafter.draft_prefill",
            "jaxprep.features.grammar.apply_grammar_bitmask",
            "jaxprep.layouts.tpu_inference.tpu_inference_layout"} <= set(shown)
    missing = unrendered(shown)
    assert not missing, f"listed on a reference page but not rendered (no docstring, or a submodule's name): {missing}"
    assert not without_signature(shown), ("callables bound as attributes, shown with no signature (make them a def "
                                          f"under @jax.jit that calls the body): {without_signature(shown)}")
    assert target(shown["jaxprep.PAD_SLOT_ID"]).is_attribute  # a constant passes
    assert target(shown["jaxprep.validate"]).is_module and "jaxprep.validate.validate" in shown  # shown on its own


def test_the_member_checks_catch_a_bound_jit(tmp_path):
    """Negative control: a package whose ``__all__`` lists ``bound = jax.jit(body)`` (the old form of
    `draft_prefill`), the same with a ``__doc__`` set at runtime (the old `prepare_padded`: griffe
    never sees it), the ``def`` form, and a function named as its module (`jaxprep.validate`); only
    the ``def`` passes, and the function once a ``::: module.name`` block shows it."""
    package = tmp_path / "boundjit"
    package.mkdir()
    (package / "check.py").write_text('"""The check\'s module."""\n\n\ndef check():\n    """A check."""\n')
    (package / "__init__.py").write_text(textwrap.dedent('''
        """A package."""
        import jax

        from boundjit.check import check

        __all__ = ["bound", "bound_with_doc", "check", "wrapped", "LIMIT"]

        LIMIT = 3
        """A constant."""


        def body(x):
            """The traced body."""
            return x + 1


        bound = jax.jit(body)
        bound_with_doc = jax.jit(body)
        bound_with_doc.__doc__ = "Set at runtime."


        @jax.jit
        def wrapped(x):
            """`body`, jitted."""
            return body(x)
        '''))
    collection = load(("boundjit",), str(tmp_path))
    shown = page_members(collection, [("boundjit", None)])
    assert unrendered(shown) == ["boundjit.bound", "boundjit.bound_with_doc", "boundjit.check"]
    assert without_signature(shown, str(tmp_path)) == ["boundjit.bound", "boundjit.bound_with_doc"]
    shown = page_members(collection, [("boundjit", None), ("boundjit.check.check", None)])
    assert unrendered(shown) == ["boundjit.bound", "boundjit.bound_with_doc"]


def docstring_style(path: str = os.path.join(ROOT, "mkdocs.yml")) -> tuple[str | None, dict]:
    """mkdocstrings' ``docstring_style`` and ``docstring_options`` as mkdocs.yml sets them."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    style = re.search(r"^\s+docstring_style:\s*(\w+)", text, re.M)[1]
    options = dict(re.findall(r"^\s+(warn_\w+):\s*(true|false)", text, re.M))
    return (None if style == "null" else style), {name: value == "true" for name, value in options.items()}


def section_problems(objects, style: str | None, options: dict) -> dict[str, list[str]]:
    """{object path: what renders wrong}: a section header left in a text section (not parsed), or a
    warning griffe gave while parsing (an entry it could not read, and left out)."""
    import logging

    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    handler = Collect()
    logging.getLogger("griffe").addHandler(handler)
    found = {}
    try:
        for obj in objects:
            if obj.docstring is None:
                continue
            seen = len(warnings)
            sections = obj.docstring.parse(style, **options) if style else obj.docstring.parse(None)
            problems = [f"unparsed section {match[1]!r}" for section in sections
                        if section.kind is griffe.DocstringSectionKind.text
                        for match in SECTION_HEADER.finditer(section.value)]
            problems += warnings[seen:]
            if problems:
                found[obj.path] = problems
    finally:
        logging.getLogger("griffe").removeHandler(handler)
    return found


def unfenced_code(objects) -> dict[str, list[str]]:
    """{object path: its lines of code outside a fence}."""
    found = {}
    for obj in objects:
        if obj.docstring is not None:
            lines = [match[0].strip() for match in CODE_LINE.finditer(FENCED.sub("", obj.docstring.value))]
            if lines:
                found[obj.path] = lines
    return found


def described_fields(cls) -> tuple[list[str], list[str]]:
    """(the dataclass fields of griffe's ``cls``, read from the class itself; the names its ``Attributes:``
    section describes, as mkdocstrings parses it)."""
    import dataclasses

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    fields = [field.name for field in dataclasses.fields(getattr(importlib.import_module(cls.parent.path), cls.name))]
    style, options = docstring_style()
    sections = cls.docstring.parse(style, **options)
    described = [attribute.name for section in sections if section.kind is griffe.DocstringSectionKind.attributes
                 for attribute in section.value]
    return fields, described


def test_mkdocs_renders_google_sections():
    assert docstring_style()[0] == "google"


def test_every_docstring_parses_in_the_sites_style(collection):
    objects = [obj for package in PACKAGES for obj in walk(collection[package])]
    style, options = docstring_style()
    found = section_problems(objects, style, options)
    assert not found, f"docstring sections the API reference shows as plain text, or entries it drops: {found}"


def test_the_section_check_catches_an_unparsed_section():
    """Negative controls: PrepConfig's docstring read as mkdocs.yml once read it (``docstring_style: null``:
    its ``Attributes:`` one paragraph), and an entry Google's style cannot read (a continuation line not
    indented: griffe warns and drops it); the same docstring indented right passes."""
    collection = load(("jaxprep",))
    prep = collection["jaxprep.config.PrepConfig"]
    assert section_problems([prep], None, {}) == {"jaxprep.config.PrepConfig": ["unparsed section 'Attributes'"]}
    good = griffe.Docstring("A switch.\n\nAttributes:\n  mrope: M-RoPE positions\n    (docs/semantics.md).\n")
    bad = griffe.Docstring("A switch.\n\nAttributes:\n  mrope: M-RoPE positions\n  (docs/semantics.md).\n")
    for docstring in (good, bad):
        docstring.parent = prep
    objects = [type("Obj", (), dict(docstring=d, path=p))() for d, p in ((good, "good"), (bad, "bad"))]
    found = section_problems(objects, "google", {"warn_missing_types": False})
    assert list(found) == ["bad"] and "name: description" in found["bad"][0]


def test_examples_in_docstrings_are_fenced(collection):
    objects = [obj for package in PACKAGES for obj in walk(collection[package])]
    found = unfenced_code(objects)
    assert not found, f"code in a docstring outside a ``` fence (it renders as prose): {found}"


def test_the_fence_check_catches_the_packages_example_as_it_was():
    """Negative control: the ``jaxprep`` package's example as it was, indented (cleandoc dedents it into a
    paragraph); fenced it passes."""
    before = griffe.Docstring("jaxprep: input preparation.\n\n    config = jaxprep.PrepConfig(max_num_reqs=8)\n"
                              "    step = jaxprep.prepare_inputs(state, config)\n")
    after = griffe.Docstring("jaxprep: input preparation.\n\n```python\nconfig = jaxprep.PrepConfig(max_num_reqs=8)\n"
                             "```\n")
    objects = [type("Obj", (), dict(docstring=d, path=p))() for d, p in ((before, "before"), (after, "after"))]
    assert unfenced_code(objects) == {"before": ["config = jaxprep.PrepConfig(", "step = jaxprep.prepare_inputs("]}


@pytest.mark.parametrize("path", DESCRIBED)
def test_every_field_of_the_step_and_the_configs_is_described(collection, path):
    cls = target(collection[path])
    fields, described = described_fields(cls)
    assert len(fields) >= 5 and sorted(fields) == sorted(described), (
        f"{path}: fields without a description {sorted(set(fields) - set(described))}, described but no field "
        f"{sorted(set(described) - set(fields))}")
