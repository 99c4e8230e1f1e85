"""Every notebook executes top to bottom on small settings (BRANCH_REPLAY_SMALL=1), so they
cannot rot. Needs nbclient, nbformat and ipykernel (requirements-test.txt)."""

import glob
import os

import pytest
from helpers import slow_where

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_there_are_notebooks():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {"ablations.ipynb", "results_browser.ipynb"} <= names


# ablations.ipynb under -m slow (179 s; results_browser.ipynb kept)
@pytest.mark.parametrize(
  "path", slow_where(NOTEBOOKS, {"ablations.ipynb"}, key=os.path.basename), ids=os.path.basename
)
def test_notebook_executes(path, monkeypatch):
  monkeypatch.setenv("BRANCH_REPLAY_SMALL", "1")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": os.path.dirname(path)}}
  )
  client.execute()  # raises CellExecutionError naming the cell on any error
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs)  # it plotted
