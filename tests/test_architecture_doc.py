"""docs/architecture.md stays true: every source path it names exists, and every package is on it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src" / "clusterctl"
DOC = REPO / "docs" / "architecture.md"
PACKAGES = sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py")))


def _where(name: str) -> list[Path]:
    """Where a path named by the doc can be: from the repository, from the package, or inside one package."""
    return [REPO / name, PKG / name, *(PKG / pkg / name for pkg in PACKAGES),
            *(sub / name for pkg in PACKAGES for sub in (PKG / pkg).iterdir() if (sub / "__init__.py").exists())]


def named_paths(text: str) -> set[str]:
    """Every ``x.py``, ``a/b.py``, ``tests/...`` and ``pkg/`` the doc names (in its code blocks and its prose)."""
    out = set(re.findall(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b", text))
    out |= {m for m in re.findall(r"(?<![\w./<-])((?:tests|bench|docs|src)/[\w/.-]*\w)", text)}
    return out


def test_every_path_the_doc_names_exists():
    text = DOC.read_text()
    missing = sorted(n for n in named_paths(text) if not any(p.exists() for p in _where(n)))
    assert not missing, "docs/architecture.md names paths that do not exist: " + ", ".join(missing)


def test_every_package_is_on_the_map():
    text = DOC.read_text()
    absent = [p for p in PACKAGES if not re.search(rf"(?m)^\s*{re.escape(p)}/\s", text)]
    assert not absent, "packages missing from docs/architecture.md: " + ", ".join(absent)


def test_every_module_of_a_package_is_on_the_map():
    text = DOC.read_text()
    absent = [f"{pkg}/{m.name}" for pkg in PACKAGES for m in sorted((PKG / pkg).glob("**/*.py"))
              if m.name not in ("__init__.py", "__main__.py") and not re.search(rf"\b{re.escape(m.name)}\b", text)]
    assert not absent, "modules missing from docs/architecture.md: " + ", ".join(absent)


def test_the_checker_catches_a_wrong_path():
    assert "launch/nosuch.py" in named_paths("see launch/nosuch.py and tests/launch/golden/")
    assert not any(p.exists() for p in _where("launch/nosuch.py"))


README = REPO / "README.md"


def _layout() -> str:
    text = README.read_text()
    start = text.index("## Layout")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_the_readme_layout_names_every_package_and_only_folders_that_exist():
    """The README's Layout (issue 43): every package of src/clusterctl/ is named there as `name/`, and every
    `name/` it names is a package (or tests/, bench/)."""
    layout = _layout()
    named = set(re.findall(r"`([a-z_]+)/`", layout))
    absent = [p for p in PACKAGES if p not in named]
    assert not absent, "packages missing from the README's Layout: " + ", ".join(absent)
    stale = sorted(n for n in named if n not in PACKAGES and not (REPO / n).is_dir())
    assert not stale, "the README's Layout names folders that do not exist: " + ", ".join(stale)
