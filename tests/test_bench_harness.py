"""bench/harness.py, what the benchmarks share: the run record, the writer of a run's files, the side-by-side
order, the training runs, the check that mlx_dflash is this tree's, and bench/ free of sys.path edits."""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import harness  # noqa: E402


def test_the_record_has_the_machine_the_versions_and_a_portable_command(tmp_path):
    inside = harness.ROOT / "bench" / "data"
    record = harness.run_record(str(harness.ROOT / "bench" / "e2e.py"),
                                ["--prompts", str(inside), "--name", "quick", "--bare-rows", ""], seconds=1.5)
    # a path inside the clone is shown from its root; an empty argument stays empty (not ".")
    assert record["command"] == "python bench/e2e.py --prompts bench/data --name quick --bare-rows "
    assert {"platform", "chip", "device"} <= set(record["machine"])
    assert {"mlx", "mlx_lm", "python", "mlx_dflash"} <= set(record["versions"])
    assert datetime.datetime.fromisoformat(record["date"]).utcoffset() == datetime.timedelta(0)
    assert record["seconds"] == 1.5


@pytest.mark.parametrize("charts", [True, False])
def test_the_writer_leaves_no_temporary_file_and_draws_only_where_it_can(tmp_path, monkeypatch, charts):
    monkeypatch.setattr(harness, "charts_available", lambda: charts)
    drawn = []

    def chart():
        drawn.append(True)
        return b"png bytes"

    out = tmp_path / "run"
    written = harness.write_results(out, "run", {"rows": [1, 2]}, "| a |", chart=chart)
    names = {"run.json", "run.md"} | ({"run.png"} if charts else set())
    assert {p.name for p in out.iterdir()} == names == {p.name for p in written}  # nothing else, no temporary
    assert json.loads((out / "run.json").read_text()) == {"rows": [1, 2]}
    assert (out / "run.md").read_text() == "| a |\n"
    assert drawn == ([True] if charts else [])  # the chart is not even drawn where it could not be written
    if charts:
        assert (out / "run.png").read_bytes() == b"png bytes"


def test_side_by_side_order_alternates_by_turn():
    assert harness.alternate(["a", "b"], 0) == ["a", "b"]
    assert harness.alternate(["a", "b"], 1) == ["b", "a"]
    assert harness.alternate({"x": 1, "y": 2, "z": 3}, 3) == ["z", "y", "x"]  # a dict's keys, as configs are
    assert harness.alternate(range(3), 4) == [0, 1, 2]


def test_train_passes_the_training_flags_on(tmp_path, monkeypatch):
    ap = argparse.ArgumentParser()
    harness.training_args(ap, steps=3, sequences=2, anchors=4, lr=1e-4, eval_every=1, eval_sequences=5)
    ran = []

    def run(command, check):
        ran.append(command)
        (tmp_path / "trainer_state.json").write_text('{"history": [{"step": 3, "tau": 1.5}]}')

    monkeypatch.setattr(harness.subprocess, "run", run)
    history = harness.train("shape", ["--prompts", "p.jsonl"], ap.parse_args(["--seed", "7"]), tmp_path)
    assert history == [{"step": 3, "tau": 1.5}]
    assert ran[0][1:] == ["-m", "mlx_dflash.cli", "train", "--prompts", "p.jsonl", "--out", str(tmp_path),
                          "--steps", "3", "--sequences", "2", "--anchors", "4", "--lr", "0.0001", "--eval-every", "1",
                          "--eval-sequences", "5", "--seed", "7"]


def test_a_package_from_another_tree_is_refused_in_one_line(tmp_path):
    """The harness of a clone at tmp_path, with this tree's package on the path: it says both and the fix."""
    clone = tmp_path / "clone"
    (clone / "bench").mkdir(parents=True)
    shutil.copy(harness.ROOT / "bench" / "harness.py", clone / "bench" / "harness.py")
    done = subprocess.run([sys.executable, str(clone / "bench" / "harness.py")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(harness.ROOT)})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert str(harness.ROOT) in done.stderr and f"PYTHONPATH={clone}" in done.stderr
    assert f"pip install -e {clone}" in done.stderr


def test_nothing_under_bench_edits_sys_path():
    """Scripts import their siblings from their own folder and mlx_dflash from the install: no sys.path edits."""
    found = [str(p.relative_to(harness.ROOT)) for p in sorted((harness.ROOT / "bench").rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and b"sys.path" in p.read_bytes()]
    assert not found, f"these files under bench/ name sys.path: {found}"
