"""`mlx-dflash doctor`: what this machine runs, checked in under a minute, as a report to share.

The machine (chip, Metal or not, memory, MLX and mlx-lm versions, on Linux the BLAS behind MLX's CPU
matmuls), then the checks, one line each:
* blas (Linux CPU): which BLAS serves MLX's matmuls, and a measured float32 matmul rate;
* kernel sources (no Metal): the Metal source MLX generates for each of our kernels' launches;
* wide_qmm, mr_attention (Metal): each kernel compiled and run on a few shapes (the worst the router sends
  among them), raced against MLX's path and soaked longer than a first use does, then compared with MLX's
  own result within the tests' tolerances: launch size, verdict, timings and soak per shape; a kernel that
  fails to compile, launch or run is a warning (MLX's path serves it), a wrong result a failure;
* race verdicts: the verdicts this machine's race gate has cached: disagreements, failures and stalls;
* verify-width sweep: what a quantized matmul costs per verify width, MLX's (and ours on Metal);
* pair, generation: the target and drafter (given, or the default pair once it is downloaded): the
  pitfalls checked before generating, then a short generation and what served it (decoding/engine_report.py).
Checks that need a Mac say so elsewhere. `--json FILE` writes everything; a failed check exits 1.
"""

from __future__ import annotations

import datetime
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import mlx.core as mx

from .errors import DFlashError
from .kernels import checks, routes
from .kernels.race_gate import RaceGate, describe, is_fallback, shared_gate
from .machine import blas_library, machine_info, metal_available, slow_blas_warning, versions
from .utils import portable_path, write_json

SCHEMA = "mlx-dflash/doctor/1"
STATUSES = ("ok", "warn", "fail", "skipped")
NEEDS_A_MAC = "needs a Mac (Metal): compiled, compared with MLX's result and raced there"
PROMPT = "What is 17 times 23? Show your steps."
SWEEP_SHAPES = {True: "4096x4096", False: "1024x1024"}  # Metal, CPU (whose quantized matmul is ~100x slower)


@dataclass
class Check:
    name: str
    status: str  # one of STATUSES
    line: str  # what it found, in one line
    details: list = field(default_factory=list)  # what it measured, one dict per shape or item
    notes: list = field(default_factory=list)  # lines printed under it (per shape, per note)
    seconds: float = 0.0  # how long it took


def matmul_gflops(n: int = 512, repeats: int = 5) -> float:
    """Float32 GFLOP/s of an n x n matmul on the default device (median of `repeats`)."""
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b, a @ b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times)[repeats // 2] / 1e9


def check_blas() -> Check:
    blas = blas_library()
    rate = matmul_gflops()
    details = [{**blas, "gflops_float32_512": round(rate, 2)}]
    warning = slow_blas_warning(blas)
    if warning:
        return Check("blas", "warn", f"{warning} (measured {rate:.1f} GFLOP/s)", details)
    return Check("blas", "ok", f"{blas['kind']} BLAS ({blas['library']}): {rate:.1f} GFLOP/s on a 512x512 float32 "
                 "matmul", details)


def check_sources() -> Check:
    try:
        found = [{"kernel": "wide_qmm", **e} for e in checks.qmm_sources()]
        found += [{"kernel": "mr_attention", **e} for e in checks.attention_sources()]
    except Exception as e:  # a missing source file, a template MLX rejects, a metal_kernel API change
        return Check("kernel sources", "fail", f"MLX could not generate our kernels' Metal source: "
                     f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    count = sum(len(e["sources"]) for e in found)
    return Check("kernel sources", "ok", f"MLX generates the Metal source of all {count} launches of our kernels on "
                 f"{len(found)} shapes (compiling them needs a Mac)", found)


DOCTOR_SOAK = 200  # calls of each in the doctor's soak (a first use soaks SOAK_REPEATS)


def _shape_line(entry: dict) -> str:
    if "error" in entry:
        return f"{entry['shape']}: {entry['error']}" + ("; MLX's path serves it" if entry.get("failed_to_run") else "")
    share = entry["error_share_of_tolerance"]
    line = f"{entry['shape']}, {entry['threads']} threads: error {share:.2g} of the tolerance"
    if entry.get("dflash_ms") is not None:
        who = "ours" if entry["route"] == "dflash" else "MLX's"
        line += f"; race: ours {entry['dflash_ms']:.3g} ms, MLX's {entry['mlx_ms']:.3g} ms"
        if entry["soak_calls"]:
            line += (f"; soak of {entry['soak_calls']}: ours {entry['soak_dflash_ms']:.3g} ms (slowest "
                     f"{entry['soak_dflash_worst_ms']:.3g}), MLX's {entry['soak_mlx_ms']:.3g} ms"
                     + (", a stall" if entry["stalled"] else ""))
        line += f": {who}"
    return line


def check_kernel(name: str, run, what: str) -> Check:
    """One kernel on a Mac: per shape, the launch, the race and a long soak, then the numerics. A wrong result
    fails the check; a kernel that fails to run on a shape is a warning (MLX's path serves it)."""
    with tempfile.TemporaryDirectory(prefix="mlx-dflash-doctor-") as tmp:
        found = run(RaceGate(Path(tmp) / "race_verdicts.json", soak_repeats=DOCTOR_SOAK))
    lines = [_shape_line(e) for e in found]
    wrong = [e for e in found if not e["ok"] and not e.get("failed_to_run")]
    failed = [e for e in found if e.get("failed_to_run")]
    if wrong:
        return Check(name, "fail", f"{len(wrong)} of {len(found)} shapes wrong against {what}: "
                     f"{_shape_line(wrong[0])}", found, lines)
    if failed:
        return Check(name, "warn", f"ours failed to run on {len(failed)} of {len(found)} shapes, {what} serves "
                     f"those: {_shape_line(failed[0])}", found, lines)
    ours = sum(e["route"] == "dflash" for e in found)
    stalls = sum(e.get("stalled", False) for e in found)
    return Check(name, "ok", f"agrees with {what} on {len(found)} shapes; the race picked ours on {ours}"
                 + (f"; {stalls} stalled in the soak" if stalls else ""), found, lines)


def check_verdict_cache() -> Check:
    gate = shared_gate()
    where = portable_path(gate.path)
    verdicts = gate.verdicts
    details = [{"key": k, **v, "current": gate.current(k) is not None} for k, v in sorted(verdicts.items())]
    faults = [d for d in details if is_fallback(d)]
    if faults:
        return Check("race verdicts", "warn", f"{len(faults)} of {len(details)} cached verdicts ({where}) send a "
                     f"shape to MLX's path for a fault of ours, e.g. {faults[0]['key']}: {describe(faults[0])}",
                     details)
    ours = sum(d["route"] == "dflash" for d in details)
    stale = sum(not d["current"] for d in details)
    more = f"; {stale} made under other versions, raced again on first use" if stale else ""
    return Check("race verdicts", "ok", f"{len(details)} cached ({where}), ours in {ours}{more}" if details else
                 f"none cached yet ({where})", details)


def check_sweep(metal: bool) -> Check:
    """A quantized matmul at verify widths 1..16: MLX's (and ours on Metal), with the cliff verdict."""
    from .bench_widths import run_widths_bench

    shape = SWEEP_SHAPES[metal]
    with tempfile.TemporaryDirectory(prefix="mlx-dflash-doctor-") as tmp:
        results = run_widths_bench(None, tmp, shapes=[shape], repeats=3 if metal else 2, warmup=1, log=None,
                                   progress=False)
    series = [s for s in results["series"] if s["kind"] == "matmul"]
    details = [{"impl": s["impl"], "widths": s["widths"], "median_ms": [t * 1e3 for t in s["median_seconds"]],
                "clock": s["clock"], "cliff_width": s["cliff_width"], "verdict": s["verdict"]} for s in series]
    who = {"mlx": "MLX's", "dflash": "ours"}
    verdicts = "; ".join(f"{who[s['impl']]}: {s['verdict']}" for s in series)
    return Check("verify-width sweep", "ok", f"{shape} 4-bit quantized matmul, {results['settings']['dtype']}, "
                 f"widths 1..16: {verdicts}", details)


def _default_pair_cached() -> bool:
    from .downloads import DEFAULT_MODEL
    from .utils import cache_dir

    return any((cache_dir() / "models").glob(f"{DEFAULT_MODEL}-*/config.json"))


def check_pair(model_path, drafter_path, cost_table, loaded: dict) -> Check:
    """The pair's pitfalls, policy notes and verify paths; `loaded` receives the pair for check_generation."""
    from .decoding.engine_report import verify_paths
    from .downloads import default_target, shipped_drafter_dir
    from .models.no_drafter import NoDrafter
    from .pair import load
    from .pitfalls import pair_warnings
    from .policies.dcut import build_policy
    from .policies.width import WidthOptions

    if model_path is None and drafter_path is None and not _default_pair_cached():
        return Check("pair", "skipped", "the default target is not downloaded yet: run `mlx-dflash prepare`, or "
                     "pass --model and --drafter")
    try:
        target, drafter, tokenizer = load(model_path, drafter_path)
        policy = build_policy(target, drafter, WidthOptions("auto" if cost_table else None, cost_table=cost_table))
    except DFlashError as e:
        return Check("pair", "fail", str(e))
    drafter_name = "no drafter" if isinstance(drafter, NoDrafter) else Path(drafter_path or shipped_drafter_dir()).name
    name = f"{Path(default_target(model_path)).name} + {drafter_name}"
    warnings = pair_warnings(target, drafter, tokenizer)
    paths, engine_notes = verify_paths(target)
    notes = warnings + policy.notes + engine_notes
    loaded.update(target=target, drafter=drafter, tokenizer=tokenizer, policy=policy, notes=notes)
    details = [{"pair": name, "notes": notes, "verify": paths}]
    found = f"{len(warnings)} pitfall warning{'s' * (len(warnings) != 1)}" if warnings else "no known pitfall"
    more = len(notes) - len(warnings)
    return Check("pair", "warn" if warnings else "ok", f"{name}: {found}" + (f", {more} notes" if more else ""),
                 details, notes)


def check_generation(loaded: dict, max_tokens: int = 8) -> Check:
    """A short greedy generation with the pair, and what served it (decoding/engine_report.py)."""
    from .decoding.engine_report import silenced
    from .decoding.prompt import encode_prompt
    from .generate import generate

    if not loaded:
        return Check("generation", "skipped", "no pair to run")
    tokenizer = loaded["tokenizer"]
    with silenced():  # the notes are listed under the checks instead
        text = generate(loaded["target"], loaded["drafter"], tokenizer, encode_prompt(tokenizer, PROMPT, None),
                        max_tokens=max_tokens, policy=loaded["policy"])
    s = text.stats
    run = {"tokens": s.generated_tokens, "rounds": s.rounds, "tau": round(s.tau, 3),
           "decode_tokens_per_s": round(s.decode_tps, 2), "drafted_rounds": s.drafted_rounds,
           "plain_steps": s.plain_steps, "looked_up_rounds": s.looked_up_rounds, "verify": s.verify_paths,
           "routes": s.routes, "notes": s.notes}
    notes = [n for n in s.notes if n not in loaded["notes"]] + [routes.route_line(e) for e in s.routes]
    return Check("generation", "ok", f"{s.generated_tokens} tokens, tau {s.tau:.2f}, {s.decode_tps:.1f} tokens/s; "
                 f"verify matmul: {s.verify_paths['matmul']}; attention: {s.verify_paths['attention']}", [run], notes)


def run_doctor(model_path=None, drafter_path=None, cost_table=None, progress=None) -> dict:
    """Every check on this machine; the report (schema SCHEMA). progress(check) is called after each."""
    tic = time.perf_counter()
    metal = metal_available()
    steps = [check_blas] if sys.platform.startswith("linux") and mx.default_device() == mx.cpu else []
    if metal:
        steps.append(lambda: check_kernel("wide_qmm", checks.check_qmm, "MLX's quantized matmul"))
        steps.append(lambda: check_kernel("mr_attention", checks.check_attention, "MLX's SDPA"))
    else:
        steps += [check_sources, lambda: Check("wide_qmm", "skipped", NEEDS_A_MAC),
                  lambda: Check("mr_attention", "skipped", NEEDS_A_MAC)]
    loaded = {}
    steps += [check_verdict_cache, lambda: check_sweep(metal),
              lambda: check_pair(model_path, drafter_path, cost_table, loaded), lambda: check_generation(loaded)]
    found = []
    for step in steps:
        start = time.perf_counter()
        check = step()
        check.seconds = round(time.perf_counter() - start, 2)
        found.append(check)
        if progress:
            progress(check)
    return {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - tic, 2), "machine": machine_info(), "versions": versions(),
            "checks": [asdict(c) for c in found], "failed": [c.name for c in found if c.status == "fail"]}


def machine_line(machine: dict, v: dict) -> str:
    memory = f", {machine['memory_gb']} GB" if machine.get("memory_gb") else ""
    return (f"{machine['chip']} ({machine['device']}, {'Metal' if machine['metal'] else 'no Metal'}{memory}), "
            f"mlx {v['mlx']}, mlx-lm {v['mlx_lm']}, mlx-dflash {v['mlx_dflash']}, Python {v['python']}")


def check_lines(check: Check) -> list[str]:
    """The check's line, then its notes indented (per kernel shape: numerics and race; the pair's notes)."""
    return [f"{check.status:8} {check.name}: {check.line}"] + [f"         {note}" for note in check.notes]


@click.command("doctor")
@click.option("--model", "model_path", help="Target to check (default: SmolLM2-135M-Instruct, if downloaded).")
@click.option("--drafter", "drafter_path", help="Drafter to check (default: the shipped one).")
@click.option("--cost-table", default=None, type=click.Path(dir_okay=False),
              help="A cost_table.json to check against this machine and pair (as --width auto would use it).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the whole report here (JSON), e.g. to attach to a bug report.")
def main(model_path, drafter_path, cost_table, json_path):
    """Check this machine: Metal, BLAS, our kernels against MLX's, the race gate, the verify widths, the pair."""
    if json_path and not Path(json_path).expanduser().parent.is_dir():
        raise DFlashError(f"--json {json_path}: the folder {Path(json_path).parent} does not exist")
    click.echo(f"mlx-dflash doctor: {machine_line(machine_info(), versions())}")
    report = run_doctor(model_path, drafter_path, cost_table,
                        progress=lambda c: click.echo("\n".join(check_lines(c)), err=c.status == "fail"))
    failed, warned = report["failed"], sum(c["status"] == "warn" for c in report["checks"])
    click.echo(f"done in {report['seconds']:.1f} s: {len(report['checks'])} checks, {len(failed)} failed, "
               f"{warned} warnings")
    if json_path:
        write_json(Path(json_path).expanduser(), report)
        click.echo(f"wrote {json_path}")
    if failed:
        raise SystemExit(1)
