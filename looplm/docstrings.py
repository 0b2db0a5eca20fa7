"""Attribute docstrings of a dataclass (the string literal under each field), read from its source: the one
place the recipe's reference (recipe/config.field_docs) and the decode flags' help (inference/options.py)
take their words from."""

from __future__ import annotations

import ast
import functools
import inspect


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """field -> its docstring on one line (whitespace collapsed), for the fields that have one. Cached: every
    `looplm` command builds its parser, whose decode flags read these (reading the source costs ~10 ms)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())
    return docs
