"""Rewrite the recipe reference's field tables (docs/recipe.md) from the config docstrings.

    python scripts/readme_fields.py

The tables go between the `<!-- recipe-fields:start -->` and `<!-- recipe-fields:end -->`
markers of docs/recipe.md; the text around them is kept. (The script keeps its old name from
when the tables lived in README.md.) tests/test_recipe_cli.py fails when the file and
`tables()` disagree, so run this after changing a field or its docstring.
"""

from pathlib import Path

from looplm.recipe.config import field_docs

START, END = "<!-- recipe-fields:start -->", "<!-- recipe-fields:end -->"
PATH = Path(__file__).parent.parent / "docs" / "recipe.md"


def tables() -> str:
    rows = []
    for section, fields in field_docs().items():
        rows.append(f"\n### `[{section}]`\n\n| field | default | allowed values and meaning | applies when |\n|---|---|---|---|")
        rows += [f"| `{section}.{name}` | `{default}` | {doc.replace('|', '/')} | {when.replace('|', '/')} |"
                 for name, default, doc, when in fields]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    text = PATH.read_text()
    head, rest = text.split(START) if START in text else (text, END)
    tail = rest.split(END, 1)[1] if END in rest else ""
    PATH.write_text(head + START + "\n" + tables() + END + tail)
