"""`mlx-dflash generate` as a user runs it: a real process on a tiny saved pair, interrupted with Ctrl-C."""

import re
import select
import signal
import subprocess
import sys


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
