"""The documentation cannot rot: the site builds with `mkdocs build --strict`, every Python block in README.md
and docs/ runs to the end (a block that talks to `127.0.0.1:8000` gets a real server), and every `python run.py
...` command they show composes under Hydra into a mode run.py knows."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from tests.conftest import make_engine, once
from toolkit.config import register_configs
from toolkit.modes import MODES
from toolkit.sampling.params import SamplingParams

pytestmark = once  # nothing here depends on the kernels: the fallback run leaves it out
ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SERVER_URL = "http://127.0.0.1:8000"


def python_blocks() -> list[tuple[str, str]]:
    return [
        (f"{page.relative_to(ROOT)}#{i}", code)
        for page in PAGES
        for i, (lang, code) in enumerate(m.groups() for m in BLOCK.finditer(page.read_text()))
        if lang == "python"
    ]


def run_commands() -> list[tuple[str, str]]:
    """(where, command) for each `python run.py ...` in a code block's line or an inline code span."""
    found = []
    for page in PAGES:
        text = page.read_text()
        lines = [
            line
            for _, code in (m.groups() for m in BLOCK.finditer(text))
            for line in code.replace("\\\n", " ").splitlines()
        ]  # a shell line continued with \
        spans = re.findall(r"`(python run\.py[^`]*)`", BLOCK.sub("", text))
        for command in [line.split("python run.py", 1)[1] for line in lines if "python run.py" in line] + [
            s.split("python run.py", 1)[1] for s in spans
        ]:
            found.append((page.name, command.split(" #", 1)[0].strip()))
    return found


def test_the_pages_hold_what_the_checks_below_read():
    assert len(python_blocks()) >= 4 and len(run_commands()) >= 40  # a regex that finds nothing fails here


@pytest.mark.native
@pytest.mark.parametrize("where,code", python_blocks(), ids=[w for w, _ in python_blocks()])
def test_every_python_block_runs(where, code, smollm2, tmp_path):
    server = None
    if SERVER_URL in code:
        from toolkit.serve.main import start_server

        engine = make_engine(smollm2, max_num_seqs=8, sampling=SamplingParams())
        server = start_server(engine, tmp_path / "served", {"model": {"name": "smollm2"}})
        code = code.replace(SERVER_URL, server.url)
    try:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        if server is not None:
            server.stop()
    assert proc.returncode == 0, f"{where} failed:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{where} printed nothing"  # every block shows its reader something


def _first_of_each_sweep(overrides: list[str]) -> list[str]:
    """A multirun's overrides with each sweep (a,b,c / range / glob) replaced by its first value."""
    out = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            first = next(iter(o.sweep_string_iterator()))
            out.append(f"{o.get_key_element()}={first}")
        else:
            out.append(o.input_line)
    return out


def filled(command: str) -> list[list[str]]:
    """A documented command as the overrides a reader would type: `mode=<mode>` / `experiment=<name>` (any of
    them) dropped, `<a|b|c>` each alternative in turn, any other `<placeholder>` a value, `[...]` and `...` and
    `-m` left out."""
    command = re.sub(r"\b(mode|experiment)=<[^<>|]*>", "", command)
    command = re.sub(r"\[[^\]]*\]|(?<!\S)\.\.\.(?!\S)", "", command)
    command = re.sub(r"<[^<>|]*>", "x", command)
    variants = [command]
    while "<" in variants[0]:
        group = re.search(r"<([^<>]*)>", variants[0])
        variants = [v.replace(group.group(0), a, 1) for v in variants for a in group.group(1).split("|")]
    return [[a for a in shlex.split(v) if a not in ("-m", "--multirun")] for v in variants]


def test_every_run_py_command_in_the_docs_composes_into_a_known_mode():
    register_configs()
    failures, composed = [], 0
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        for where, command in run_commands():
            if "--" in command.split("#")[0].split()[0:1] or command.startswith("--"):
                continue  # --help, --cfg job: Hydra's own flags
            for args in filled(command):
                try:
                    cfg = compose(config_name="config", overrides=_first_of_each_sweep(args))
                    composed += 1
                    if cfg.mode not in MODES:
                        failures.append(f"{where}: {command}: mode {cfg.mode!r} is not one of run.py's")
                except Exception as exc:  # noqa: BLE001  (every failure is listed, not only the first)
                    failures.append(
                        f"{where}: python run.py {command}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                    )
    assert not failures, "\n".join(failures)
    assert composed >= 40


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        reason = "MkDocs is not installed (pip install -e '.[docs]'; make test installs it)"
        print(f"SKIP reason: {reason}")
        pytest.skip(reason)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "SamplingParams" in api and "temperature" in api  # the API page is made from the docstrings
