"""Packaging: what `pip install toolkit` pulls (no optional stack), the exact pins `make` and CI install
from (constraints.txt), no cap on the Python version, and a light `import toolkit`. Reads files only
(and one short subprocess); no model, no torch."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("wandb", "matplotlib", "fastapi", "uvicorn", "hydra-joblib-launcher")  # extras only
HEAVY_MODULES = ("torch", "transformers", "numpy", "pyarrow", "wandb", "matplotlib", "fastapi", "uvicorn")


def _name(requirement: str) -> str:
    """The PEP 503 normalised project name of a requirement string ("Jinja2>=3.1" -> "jinja2")."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m, f"not a requirement: {requirement!r}"
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> list[str]:
    project = _project()
    return list(project["dependencies"]) + [r for reqs in project["optional-dependencies"].values() for r in reqs]


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        assert m, f"constraints.txt: {line!r} is not an exact name==version pin"
        assert _name(m.group(1)) not in pins, f"constraints.txt pins {m.group(1)} twice"
        pins[_name(m.group(1))] = m.group(2)
    return pins


def test_core_dependencies_leave_the_optional_stacks_to_extras():
    project = _project()
    core = {_name(r) for r in project["dependencies"]}
    assert not core & set(OPTIONAL), f"core dependencies pull {sorted(core & set(OPTIONAL))}"
    extras = project["optional-dependencies"]
    assert {"serve", "wandb", "bench", "dev"} <= set(extras)
    assert {_name(r) for reqs in extras.values() for r in reqs} >= set(OPTIONAL)
    # dev (what make and CI install) takes every other extra, so the suite has all it tests
    self_ref = [r for r in extras["dev"] if _name(r) == "toolkit"]
    assert self_ref and all(e in self_ref[0] for e in ("serve", "wandb", "bench"))


def test_core_dependencies_are_ranges_not_pins():
    for r in _project()["dependencies"]:
        assert "==" not in r, f"{r!r}: pyproject gives ranges; the exact version belongs in constraints.txt"


def test_every_dependency_named_in_pyproject_has_an_exact_pin_in_constraints():
    pins = _constraints()
    names = {_name(r) for r in _requirements()} - {"toolkit"}
    assert not names - set(pins), f"not pinned in constraints.txt: {sorted(names - set(pins))}"
    assert "toolkit" not in pins
    assert pins["torch"] == "2.13.0"  # exact: replay is bit for bit, and a looser pin may fetch GBs


def test_each_pin_lies_in_its_pyproject_range():
    requirements = pytest.importorskip("packaging.requirements")
    pins = _constraints()
    for r in _requirements():
        req = requirements.Requirement(r)
        if _name(req.name) != "toolkit":
            assert req.specifier.contains(pins[_name(req.name)], prereleases=True), (
                f"constraints.txt {req.name}=={pins[_name(req.name)]} is outside pyproject's {r!r}"
            )


def test_requires_python_has_no_upper_cap():
    spec = _project()["requires-python"]
    clauses = [c.strip() for c in spec.split(",")]
    assert ">=3.11" in clauses
    assert all(c.startswith(">") for c in clauses), f"requires-python {spec!r} caps the version"


def test_import_toolkit_loads_no_heavy_module():
    code = f"import sys, toolkit; print(' '.join(m for m in {HEAVY_MODULES!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [], f"`import toolkit` loads {proc.stdout.split()}"
