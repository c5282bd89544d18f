"""A griffe extension for collabopt's API reference (mkdocstrings loads it: see mkdocs.yml).

1. ``collabopt.integrations`` lives in the top-level folder ``integrations/`` (pyproject.toml maps it). griffe finds
   subpackages by folder, so this extension visits that folder as the subpackage ``collabopt.integrations``.
2. The docstrings follow reStructuredText habits: ``:class:`x``` roles, ``Example::`` literal blocks, doctest lines,
   ``.. code-block::``. They are turned into the Markdown that mkdocstrings renders: a role becomes a link when its
   target is shown in the API reference, else a code span; literal blocks and doctests become fenced code.

Only the text handed to mkdocstrings changes; the source files are not touched.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from typing import Any

import griffe

# the modules whose __all__ the API reference documents (tests/unit/test_docs.py imports this list)
PUBLIC_MODULES = (
    "collabopt",
    "collabopt.integrations.pytorch",
    "collabopt.integrations.accelerate",
    "collabopt.integrations.lightning",
    "collabopt.integrations.transformers",
)

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`([^`]+)`")
_CODE_BLOCK = re.compile(r"^(\s*)\.\. code-block::\s*(\S*)\s*$")
# a Google-style entry whose list of names wraps onto the next line ("a, b,\n    c: text")
_WRAPPED_NAMES = re.compile(r"^\s+\w+(?:,\s*\w+)*,\s*$")
# an entry that documents several parameters at once ("a, b: text")
_SEVERAL_NAMES = re.compile(r"^(\s+)(\w+(?:,\s*\w+)+):\s*(.*)$")
_ARGS_SECTIONS = ("Args:", "Arguments:", "Parameters:", "Params:")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fence(language: str, block: list[str], indent: int) -> list[str]:
    pad = " " * indent
    body = textwrap.dedent("\n".join(block)).splitlines()
    return [f"{pad}```{language}", *(pad + line if line.strip() else "" for line in body), f"{pad}```"]


def _literal_block(lines: list[str], start: int, indent: int) -> tuple[list[str], int]:
    """The lines indented deeper than ``indent`` from ``start`` on (blank lines inside kept); and where it ends."""
    end = start
    while end < len(lines) and not lines[end].strip():
        end += 1
    block_start, last = end, end
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        if lines[end].strip():
            last = end + 1
        end += 1
    return lines[block_start:last], last


def to_markdown(text: str, link: Any = lambda title, target: f"`{title}`") -> str:
    """Markdown for a docstring written with reStructuredText habits; ``link(title, target)`` renders a role."""
    lines = text.splitlines()
    out: list[str] = []
    args_indent: int | None = None  # inside a Google-style "Args:" section: its header's indentation
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        indent = _indent(line)
        if stripped.startswith(">>>") and (not out or not out[-1].strip()):  # a doctest, up to the next blank line
            end = i
            while end < len(lines) and lines[end].strip():
                end += 1
            previous = [_indent(text) for text in out if text.strip()]
            out += _fence("pycon", lines[i:end], min(indent, previous[-1]) if previous else indent)
            i = end
            continue
        directive = _CODE_BLOCK.match(line)
        if directive or (stripped.endswith("::") and not stripped.startswith("..")):
            block, end = _literal_block(lines, i + 1, indent)
            if block:
                if directive:
                    language = directive.group(2) or "text"
                else:
                    language = "pycon" if block[0].strip().startswith(">>>") else "python"
                    intro = line.rstrip()[:-2].rstrip()
                    if intro.strip():
                        out.append(_convert_roles(intro + ":", link))
                out += ["", *_fence(language, block, indent), ""]
                i = end
                continue
        if stripped in _ARGS_SECTIONS:
            args_indent = indent
        elif stripped and args_indent is not None and indent <= args_indent:
            args_indent = None
        if args_indent is not None and _WRAPPED_NAMES.match(line) and i + 1 < len(lines) \
                and _indent(lines[i + 1]) > indent:
            lines[i + 1] = " " * indent + stripped + " " + lines[i + 1].strip()  # the names on one line
            i += 1
            continue
        several = _SEVERAL_NAMES.match(line) if args_indent is not None else None
        if several:  # "a, b: text" documents each of a and b (griffe takes one name per entry)
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
                end += 1
            continuation = [_convert_roles(text, link) for text in lines[i + 1:end]]
            for name in re.split(r",\s*", several.group(2)):
                out += [_convert_roles(f"{several.group(1)}{name}: {several.group(3)}", link), *continuation]
            i = end
            continue
        out.append(_convert_roles(line, link))
        i += 1
    return "\n".join(out)


def _convert_roles(line: str, link: Any) -> str:
    def replace(match: re.Match) -> str:
        content = match.group(1).strip()
        titled = re.match(r"^(.*?)\s*<(.+)>$", content)
        title, target = (titled.group(1), titled.group(2)) if titled else (None, content)
        short = target.startswith("~")
        target = target.lstrip("~!.")
        return link(title or (target.rsplit(".", 1)[-1] if short else target), target)

    return _ROLE.sub(replace, line)


class CollaboptDocs(griffe.Extension):
    """See the module docstring."""

    def on_module_members(self, *, node: Any, mod: griffe.Module, agent: griffe.Visitor, **kwargs: Any) -> None:
        if mod.path != "collabopt" or "integrations" in mod.members or mod.filepath is None:
            return
        folder = Path(mod.filepath).parent.parent / "integrations"
        if not (folder / "__init__.py").exists():
            return
        package = self._visit(agent, "integrations", folder / "__init__.py", mod)
        mod.set_member("integrations", package)
        for path in sorted(folder.glob("*.py")):
            if path.name != "__init__.py":
                package.set_member(path.stem, self._visit(agent, path.stem, path, package))

    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, agent: griffe.Visitor, **kwargs: Any) -> None:
        """``name = property(getter, doc="...")``: a property documented by its ``doc`` argument."""
        value = getattr(node, "value", None)
        if attr.docstring is not None or not isinstance(value, ast.Call):
            return
        if not (isinstance(value.func, ast.Name) and value.func.id == "property"):
            return
        for keyword in value.keywords:
            doc = keyword.value
            if keyword.arg == "doc" and isinstance(doc, ast.Constant) and isinstance(doc.value, str):
                attr.docstring = griffe.Docstring(doc.value, lineno=doc.lineno, parent=attr,
                                                  parser=agent.docstring_parser,
                                                  parser_options=agent.docstring_options)
                attr.labels = {"property"}
                attr.value = None  # the getter lambda says nothing to a reader

    @staticmethod
    def _visit(agent: griffe.Visitor, name: str, path: Path, parent: griffe.Module) -> griffe.Module:
        code = path.read_text(encoding="utf-8")
        agent.lines_collection[path] = code.splitlines()
        return griffe.visit(name, filepath=path, code=code, parent=parent, extensions=agent.extensions,
                            docstring_parser=agent.docstring_parser, docstring_options=agent.docstring_options,
                            lines_collection=agent.lines_collection, modules_collection=agent.modules_collection)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "collabopt":
            return
        documented = documented_paths(pkg.modules_collection)
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = to_markdown(obj.docstring.value, _linker(obj, documented))


def _objects(obj: griffe.Object):
    yield obj
    for member in list(obj.members.values()):
        if not member.is_alias:
            yield from _objects(member)


def documented_paths(collection: Any) -> dict[str, str]:
    """Canonical path -> the path under which the API reference shows it (public names and their members)."""
    documented: dict[str, str] = {}
    for module_path in PUBLIC_MODULES:
        module = collection.get_member(module_path)
        for name in module.exports or []:
            name = str(name)
            member = module.members.get(name)
            if member is None:
                continue
            shown = f"{module_path}.{name}"
            try:
                target = member.final_target if member.is_alias else member
            except griffe.AliasResolutionError:
                continue
            documented.setdefault(target.canonical_path, shown)
            documented.setdefault(shown, shown)
            if target.is_class:
                for member_name, child in target.members.items():
                    if not member_name.startswith("_") and not child.is_alias and child.docstring is not None:
                        documented.setdefault(child.canonical_path, f"{shown}.{member_name}")
    return documented


def _linker(obj: griffe.Object, documented: dict[str, str]) -> Any:
    def link(title: str, target: str) -> str:
        path = _resolve(obj, target)
        if path is not None and path in documented:
            return f"[`{title}`][{documented[path]}]"
        return f"`{title}`"

    return link


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The canonical path ``target`` names, seen from ``obj``'s scope; None if it names nothing griffe knows."""
    collection = obj.modules_collection
    candidates = [target]
    head, _, rest = target.partition(".")
    scope = obj if obj.is_module or obj.is_class else obj.parent
    for holder in (scope, obj):
        try:
            resolved = holder.resolve(head)
        except (griffe.NameResolutionError, AttributeError):
            continue
        candidates.append(f"{resolved}.{rest}" if rest else resolved)
    for candidate in candidates:
        try:
            found = collection.get_member(candidate)
        except (KeyError, ValueError):
            continue
        try:
            return found.canonical_path
        except griffe.AliasResolutionError:
            return None
    return None
