"""The notebooks under docs/notebooks run top to bottom in a fresh Jupyter kernel (nbmake's runner), on the tiny
model. Each asserts what it tells (a divergence found where the trace says it must be, a replay identical under
another scheduler, exactly the tampered tokens flagged), so a notebook whose story stops being true fails here,
and each shows its plot inline."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import once

pytestmark = once  # they do not depend on the kernels: the fallback run leaves them out
ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))


def test_the_three_workflows_are_there():
    assert [n.name for n in NOTEBOOKS] == ["audit_transcript.ipynb", "replay_scheduler.ipynb", "traces_duckdb.ipynb"]


@pytest.mark.native
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_a_notebook_runs_top_to_bottom_with_its_plot_inline(path):
    from nbmake.nb_run import NotebookRun

    result = NotebookRun(path, default_timeout=600).execute()
    if result.error is not None:
        pytest.fail(
            f"{path.name}, cell {result.error.failing_cell_index}: {result.error.summary}\n{result.error.trace[-3000:]}"
        )
    images = [
        o
        for cell in result.nb.cells
        if cell.cell_type == "code"
        for o in cell.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]
    assert images, f"{path.name} shows no plot"
