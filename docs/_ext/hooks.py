"""mkdocs hooks (see mkdocs.yml): files from outside docs/ that the site shows."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
# site path -> file in the repository (the benchmark runner writes the plot; docs/performance.md shows it)
EXTERNAL_FILES = {"assets/benchmarks.png": ROOT / "benchmarks" / "results" / "results.png"}


def on_files(files, config):
    for uri, path in EXTERNAL_FILES.items():
        if path.exists():
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
