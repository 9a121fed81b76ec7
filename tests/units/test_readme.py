"""The README's set-up as a newcomer reads it: how to install comes before the results, and `make install`,
which installs without running anything, is documented and is what the Makefile does."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_install_comes_before_the_results_and_make_install_is_documented():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", readme, flags=re.MULTILINE)
    assert headings.index("Set up") < headings.index("Install") < headings.index("Results")
    set_up = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^make install\s+#.*nothing runs", set_up, flags=re.MULTILINE)
    assert 'pip install "forge-rl[demo]"' in readme.split("## Results", 1)[0]


def test_make_install_installs_and_runs_nothing():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    install = re.search(r"^install:(.*)$", makefile, flags=re.MULTILINE).group(1).split()
    assert install == ["$(VENV)/.demo-installed"]  # a file target: pip installs, no command runs after
    recipe = makefile.split("$(VENV)/.demo-installed: ", 1)[1].split("\n\n", 1)[0]
    assert "forge demo" not in recipe and "pytest" not in recipe
