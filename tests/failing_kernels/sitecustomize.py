"""Imported at start-up by every Python process with this folder on PYTHONPATH (site.py): where FAILING_KERNEL is
compile, launch or run, Metal is faked and our kernels fail at that stage (tests/metal_fakes.py), their race
verdicts kept in the file VERDICTS. The sharded tests start their ranks (`mlx-dflash serve --shard`, the sharded
worker) so."""

import os
import sys
from pathlib import Path

if os.environ.get("FAILING_KERNEL"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from metal_fakes import install_failing_kernels

    install_failing_kernels(os.environ["FAILING_KERNEL"], Path(os.environ["VERDICTS"]))
