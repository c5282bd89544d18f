"""The documentation site builds in strict mode, and its API reference covers every public name.

Strict mode turns every mkdocs / mkdocstrings warning into a failure: a link to a missing page or anchor, a
cross-reference that resolves to nothing, a docstring griffe cannot parse. Public names are those of
``collabopt.__all__`` and of the ``__all__`` of every public module in ``integrations/`` (a module whose name
starts with ``_`` is a private part of an adapter).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTENSION = ROOT / "docs" / "_ext" / "griffe_collabopt.py"
ADAPTERS = sorted(path.stem for path in (ROOT / "integrations").glob("*.py") if not path.stem.startswith("_"))
PUBLIC_MODULES = ["collabopt"] + [f"collabopt.integrations.{name}" for name in ADAPTERS]

try:
    import griffe
    import mkdocs  # noqa: F401
except ImportError as error:  # the docs extra: `pip install -e .[docs]` (python3 scripts/dev.py test installs it)
    raise ImportError(f"{error}: install collabopt's docs extra, e.g. pip install -e '.[docs]'") from error


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    problems = [line for line in (result.stdout + result.stderr).splitlines() if not line.startswith("INFO")]
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems)
    return site_dir


@pytest.fixture(scope="module")
def package() -> griffe.Module:
    """collabopt as the API reference sees it (the docs' griffe extension adds ``collabopt.integrations``)."""
    extensions = griffe.load_extensions(f"{EXTENSION}:CollaboptDocs")
    return griffe.load("collabopt", search_paths=[str(ROOT)], extensions=extensions)


def public_names(package: griffe.Module) -> list[tuple[str, str]]:
    names = []
    for module_path in PUBLIC_MODULES:
        module = package.modules_collection.get_member(module_path)
        exports = [str(name) for name in module.exports or []]
        assert exports, f"{module_path} has no __all__"
        names += [(module_path, name) for name in exports]
    return names


def test_site_builds_in_strict_mode(site: Path) -> None:
    assert (site / "index.html").exists()
    assert (site / "api" / "collabopt" / "index.html").exists()


def test_every_public_name_is_in_the_api_reference(site: Path, package: griffe.Module) -> None:
    anchors = set()
    for page in (site / "api").rglob("*.html"):
        anchors |= set(re.findall(r'id="([^"]+)"', page.read_text(encoding="utf-8")))
    missing = [f"{module}.{name}" for module, name in public_names(package) if f"{module}.{name}" not in anchors]
    assert not missing, (f"public names missing from the API reference (docs/api/*.md): {missing}; a name without a "
                         "docstring is not rendered, and each public module needs a page with a `::: module` block")


def test_every_public_name_has_a_docstring(package: griffe.Module) -> None:
    undocumented = []
    for module_path, name in public_names(package):
        module = package.modules_collection.get_member(module_path)
        obj = module.members.get(name)
        if obj is None:
            undocumented.append(f"{module_path}.{name} (listed in __all__ but not defined)")
            continue
        if obj.is_alias:
            obj = obj.final_target
        if obj.docstring is None or not obj.docstring.value.strip():
            undocumented.append(f"{module_path}.{name}")
    assert not undocumented, f"public names without a docstring: {undocumented}"


def test_the_griffe_extension_links_every_public_module() -> None:
    source = EXTENSION.read_text(encoding="utf-8")
    listed = re.search(r"PUBLIC_MODULES = \((.*?)\)", source, re.S)
    assert listed is not None
    assert sorted(re.findall(r'"([\w.]+)"', listed.group(1))) == sorted(PUBLIC_MODULES)


def test_readme_links_point_to_existing_files() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if "://" not in target and not target.startswith("mailto:")]
    assert any(target.startswith("docs/") for target in local), "the README links into docs/"
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_options_page_matches_the_config() -> None:
    """docs/options.md lists every option of CollabConfig, and every name in its tables is accepted."""
    import dataclasses

    from collabopt.config import CollabConfig, option_names

    page = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    fields = {field.name for field in dataclasses.fields(CollabConfig)} - {"hivemind_options"}
    unlisted = sorted(name for name in fields if f"`{name}`" not in page)
    assert not unlisted, f"options missing from docs/options.md: {unlisted}"
    first_column = [row.split("|")[1] for row in page.splitlines() if row.startswith("| `")]
    listed = {name for cell in first_column for name in re.findall(r"`(\w+)`", cell)}
    constructor = {"scheduler", "scheduler_fn", "optimizer_factory", "model", "dht", "scaler", "grad_scaler", "config"}
    unknown = sorted(listed - option_names() - constructor)
    assert not unknown, f"docs/options.md lists names no constructor accepts: {unknown}"


def test_development_page_maps_every_module() -> None:
    """docs/development.md's layout and engine tables name every module of collabopt/ and integrations/."""
    page = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    engine = page[page.index("## The engine"):]
    missing = []
    for path in sorted((ROOT / "collabopt").rglob("*.py")) + sorted((ROOT / "integrations").glob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("collabopt/engine/"):
            found = path.name == "__init__.py" or f"`{path.name}`" in engine
        else:
            found = f"`{relative}`" in page or (path.name == "__main__.py" and "`__main__.py`" in page)
        if not found:
            missing.append(relative)
    assert not missing, f"modules missing from docs/development.md's tables: {missing}"
