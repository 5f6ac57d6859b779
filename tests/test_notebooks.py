"""The research notebooks (`notebooks/*.ipynb`): stored clean, and the tracking helpers they read runs with.

CI executes the notebooks themselves (`pytest --nbmake notebooks/`); these tests are the fast part: every notebook
is stored without outputs (a diff shows only what changed in its code and text) and opens with a markdown cell
saying what it shows.
"""

import json
import math
import pathlib

import pytest

from feynrl_jax.tracking import Tracker, metric_series, plot_run, read_metrics

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"new_loss.ipynb", "inspect_rollout.ipynb", "compare_runs.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs_and_opens_with_markdown(path):
    notebook = json.loads(path.read_text())
    cells = notebook["cells"]
    assert cells and cells[0]["cell_type"] == "markdown", "the first cell must say, in markdown, what it shows"
    assert "".join(cells[0]["source"]).lstrip().startswith("# "), "the first cell opens with a title"
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"cell {index} keeps outputs: strip them before committing"
            assert cell["execution_count"] is None, f"cell {index} keeps an execution count"
    assert notebook["metadata"]["kernelspec"]["name"] == "python3"


def test_metric_series_gives_the_steps_that_logged_a_number(tmp_path):
    run_dir = str(tmp_path / "run")
    with Tracker(run_dir, progress_bar=False) as tracker:
        tracker.log(1, {"loss/total": 1.0, "train/grad_norm": 3})
        tracker.log(2, {"loss/total": math.nan})  # written as null
        tracker.log(3, {"loss/total": 0.25, "train/grad_norm": 2})
    records = read_metrics(run_dir)
    assert metric_series(records, "loss/total") == ([1, 3], [1.0, 0.25])
    steps, values = metric_series(records, "train/grad_norm")
    assert steps == [1, 3] and values == [3.0, 2.0] and all(type(v) is float for v in values)
    assert metric_series(records, "rollout/never_logged") == ([], [])


def test_plot_run_leaves_the_pyplot_backend_alone(tmp_path):
    # The RL loop plots its run when it ends; called from a notebook, it must not switch the notebook's backend
    # (inline figures would stop showing).
    import matplotlib
    import matplotlib.pyplot as plt

    run_dir = str(tmp_path / "run")
    with Tracker(run_dir, progress_bar=False) as tracker:
        for step in range(1, 4):
            tracker.log(step, {"loss/total": 1.0 / step})
    previous = matplotlib.get_backend()
    plt.switch_backend("svg")
    try:
        assert [pathlib.Path(p).name for p in plot_run(run_dir)] == ["loss.png"]
        assert matplotlib.get_backend() == "svg"
    finally:
        plt.switch_backend(previous)
