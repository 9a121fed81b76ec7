"""GRPOConfig's field docstrings as documentation: the `forge train --help` text and docs/config.md.

    python -m forge.core.config_docs > docs/config.md
    python -m forge.core.config_docs trl      the name tables of docs/from-trl.md (core/trl_names.py)

tests/math/test_config.py fails when docs/config.md differs from what this prints,
tests/units/test_trl_table.py when docs/from-trl.md does not hold the name tables.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
import textwrap
from dataclasses import fields

from forge.core.config import GRPOConfig
from forge.core.trl_fields import TRAINING_ARGUMENTS_FIELDS, TRL_ASYNC_GRPO_FIELDS, TRL_GRPO_FIELDS
from forge.core.trl_names import classify
from forge.core.trl_values import REFUSED_VALUES


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
    out = [
        "# GRPOConfig reference",
        "",
        (
            "Generated from the field docstrings of `forge/core/config.py` by `python -m "
            "forge.core.config_docs > docs/config.md`; tests/math/test_config.py fails when the two differ. "
            "Every field is also a `forge train` flag (`--name value`) and a key of a `--config` YAML file."
        ),
    ]
    for line in inspect.getsource(GRPOConfig).splitlines():
        block = re.fullmatch(r"\s*# --- (.*) ---", line)
        field = re.fullmatch(r"\s*(\w+): (.+?) = .*", line)
        if block:
            title = block.group(1)
            out += ["", f"## {title[0].upper()}{title[1:]}", "", "| field | type | default | |",
                    "|---|---|---|---|"]
        elif field and field.group(1) in defaults:
            name, kind = field.groups()
            text = " ".join(docs.get(name, "").split()).replace("|", "\\|")
            out.append(f"| `{name}` | `{kind}` | `{defaults[name]!r}` | {text} |")
    return "\n".join(out) + "\n"


def trl_tables_markdown() -> str:
    """docs/from-trl.md's tables: every field of transformers' TrainingArguments and of TRL's GRPOConfig, with
    its class (mapped, ignored, refused) and what it is in Forge, from forge/core/trl_names.py."""
    forge_fields = {f.name for f in fields(GRPOConfig)}
    out = []
    for title, names in (("transformers' `TrainingArguments` (5.24)", TRAINING_ARGUMENTS_FIELDS),
                         ("TRL's own `GRPOConfig` fields (1.16)", TRL_GRPO_FIELDS),
                         ("TRL's own `AsyncGRPOConfig` fields (1.16, `trl.experimental.async_grpo`)",
                          TRL_ASYNC_GRPO_FIELDS)):
        rows = [(name, *classify(name, forge_fields)) for name in names]
        counts = {kind: sum(1 for _, k, _ in rows if k == kind) for kind in ("mapped", "ignored", "refused")}
        out += [
            f"### {title}",
            "",
            f"{len(rows)} fields: " + ", ".join(f"{n} {k}" for k, n in counts.items()) + ".",
            "",
            "| name | class | in Forge |",
            "|---|---|---|",
        ]
        out += [f"| `{name}` | {kind} | {text.replace('|', '/')} |" for name, kind, text in rows]
        out.append("")
    return "\n".join(out + refused_values_markdown())


def refused_values_markdown() -> list[str]:
    """The table of TRL configs that TRL accepts and Forge refuses (forge/core/trl_values.py)."""
    said = (f"{len(REFUSED_VALUES)} configs TRL 1.16 accepts, beside a refused name given a value (the "
            f"tables above), and GRPOTrainer's `quantization_config` given one (Forge trains unquantized "
            f"weights):")
    out = ["### TRL configs Forge refuses", "", said, "", "| TRL config | why, and what to set |",
           "|---|---|"]
    for config, why in REFUSED_VALUES:
        given = ", ".join(f"{name}={value!r}" for name, value in config.items())
        out.append(f"| `{given}` | {why.replace('|', '/')} |")
    return out + [""]


if __name__ == "__main__":
    import sys

    print(trl_tables_markdown() if sys.argv[1:] == ["trl"] else reference_markdown(), end="")
