"""`mlx-dflash generate` as a user runs it: a real process on a tiny saved pair, interrupted with Ctrl-C; what
it prints on the way (notes on lines of their own, the prompt cache's statistics)."""

import re
import select
import signal
import subprocess
import sys

from click.testing import CliRunner

from mlx_dflash.decoding import engine_report
from mlx_dflash.cli import main


def test_ctrl_c_prints_the_statistics_so_far_and_exits_130(tiny_pair_dirs):
    target, drafter = tiny_pair_dirs
    proc = subprocess.Popen([sys.executable, "-m", "mlx_dflash.cli", "generate", "--model", str(target), "--drafter",
                             str(drafter), "--prompt", "Tell me about the sea.", "--max-tokens", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)  # a loaded 2-core machine starts slowly
        first = proc.stdout.read1(64) if ready else b""
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err.decode()
    assert first, f"no text came before the interrupt: {err}"
    assert proc.returncode == 130, err
    assert "Aborted!" not in err and "Traceback" not in err
    assert re.search(r"^generation: [1-9]\d* tokens", err, re.M) and "finish: interrupted" in err


def test_a_note_during_a_verbose_run_gets_a_line_of_its_own(tiny_pair_dirs, monkeypatch):
    target, drafter = tiny_pair_dirs
    calls = []

    def fallback_notes(routes):  # a fallback met in the third round, when text and markers have come out
        calls.append(1)
        return ["note: a fallback met mid-run"] if len(calls) >= 4 else []

    monkeypatch.setattr(engine_report.routes, "fallback_notes", fallback_notes)
    result = CliRunner().invoke(main, ["generate", "--model", str(target), "--drafter", str(drafter), "--prompt",
                                       "Tell me about the sea.", "--max-tokens", "40", "--width", "4", "--verbose"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()  # stdout and stderr as a terminal shows them
    assert lines.count("note: a fallback met mid-run") == 1, result.output
    assert re.search(r" \[\d+/\d+\]", result.output)  # the round markers are there too


def test_the_second_run_on_a_prompt_cache_file_says_what_it_saved(tiny_pair_dirs, tmp_path):
    target, drafter = tiny_pair_dirs
    kept = tmp_path / "cache.safetensors"
    run = ["generate", "--model", str(target), "--drafter", str(drafter), "--max-tokens", "4",
           "--prompt-cache-file", str(kept), "--prompt"]
    prompt = "Tell me about the sea, the ships on it and the fish in it. " * 4  # a prefill long enough to time
    first = CliRunner().invoke(main, [*run, prompt])
    assert first.exit_code == 0 and "cached" not in first.stderr, first.output
    second = CliRunner().invoke(main, [*run, prompt + "And the birds?"])  # a new process would read the same file
    saved = re.search(r"prompt: \d+ tokens \((\d+) cached, ~([\d.]+) s saved\)", second.stderr)
    assert saved and int(saved.group(1)) > 32 and float(saved.group(2)) > 0, second.stderr
