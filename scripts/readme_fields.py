"""Rewrite the README's recipe-field tables from the config docstrings.

    python scripts/readme_fields.py
"""

from pathlib import Path

from looplm.config import field_docs

START, END = "<!-- recipe-fields:start -->", "<!-- recipe-fields:end -->"


def tables() -> str:
    rows = []
    for section, fields in field_docs().items():
        rows.append(f"\n### `[{section}]`\n\n| field | default | allowed values and meaning |\n|---|---|---|")
        rows += [f"| `{section}.{name}` | `{default}` | {doc.replace('|', '/')} |" for name, default, doc in fields]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    path = Path(__file__).parent.parent / "README.md"
    text = path.read_text()
    head, rest = text.split(START) if START in text else (text, END)
    tail = rest.split(END, 1)[1] if END in rest else ""
    path.write_text(head + START + "\n" + tables() + END + tail)
