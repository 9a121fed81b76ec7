"""GRPOConfig's field docstrings as documentation: the `forge train --help` text and docs/config.md.

    python -m forge.core.config_docs > docs/config.md

tests/math/test_config.py fails when docs/config.md differs from what this prints.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
import textwrap
from dataclasses import fields

from forge.core.config import GRPOConfig


def field_docs() -> dict[str, str]:
    """Field name -> the docstring written under it in GRPOConfig."""
    docs, body = {}, ast.parse(textwrap.dedent(inspect.getsource(GRPOConfig))).body[0].body
    for node, following in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr) \
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
            docs[node.target.id] = following.value.value.strip()
    return docs


def reference_markdown() -> str:
    """docs/config.md: every field under its block's heading (the `# --- block ---` comments), with its type,
    default and docstring."""
    docs, defaults = field_docs(), {f.name: f.default for f in fields(GRPOConfig)}
    out = ["# GRPOConfig reference", "",
           ("Generated from the field docstrings of `forge/core/config.py` by `python -m forge.core.config_docs > "
            "docs/config.md`; tests/math/test_config.py fails when the two differ. Every field is also a `forge train` "
            "flag (`--name value`) and a key of a `--config` YAML file.")]
    for line in inspect.getsource(GRPOConfig).splitlines():
        block = re.fullmatch(r"\s*# --- (.*) ---", line)
        field = re.fullmatch(r"\s*(\w+): (.+?) = .*", line)
        if block:
            title = block.group(1)
            out += ["", f"## {title[0].upper()}{title[1:]}", "", "| field | type | default | |", "|---|---|---|---|"]
        elif field and field.group(1) in defaults:
            name, kind = field.groups()
            text = " ".join(docs.get(name, "").split()).replace("|", "\\|")
            out.append(f"| `{name}` | `{kind}` | `{defaults[name]!r}` | {text} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
