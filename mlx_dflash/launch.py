"""`mlx-dflash claude`, `mlx-dflash codex`, `mlx-dflash opencode`: a coding agent on `mlx-dflash serve` in one
command.

Each uses the mlx-dflash server already answering on 127.0.0.1:--port, or starts `mlx-dflash serve` there (its
log in the cache dir's `launch/`) and waits for it; runs the client with the settings docs/server.md documents
as tested (the server's address, its model's name, timeouts a local prefill needs) and the arguments after
`--`; and stops the server it started once the client exits, with the client's exit status. The client comes
from npm: found on PATH, or where the tests install it (the cache dir's `npm/`); a missing one is one line
naming its package. Nothing is written to the client's own configuration: Claude Code and OpenCode read
theirs from the environment, Codex from `-c` overrides.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click

from .errors import DFlashError

START_SECONDS = 1800  # a first start converts the default target; a big model loads for minutes
REQUEST_TIMEOUT_MS = 1_800_000  # a CPU reads an agent's first prompt (4-12k tokens) for minutes


@dataclass
class Client:
    name: str
    package: str  # on npm
    env: Callable[[str, str, str], dict]  # (server url, model, key) -> the client's variables
    args: Callable[[str, str], list] = lambda url, model: []  # arguments before the user's


def _claude_env(url: str, model: str, key: str) -> dict:
    return {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key, "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model, "API_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS), "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}


def _codex_args(url: str, model: str) -> list:
    provider = (f'{{name = "mlx-dflash", base_url = "{url}/v1", env_key = "MLX_DFLASH_API_KEY", '
                f'wire_api = "responses", stream_idle_timeout_ms = {REQUEST_TIMEOUT_MS}}}')
    return ["-c", f"model={json.dumps(model)}", "-c", 'model_provider="mlx_dflash"',
            "-c", f"model_providers.mlx_dflash={provider}"]


def _opencode_env(url: str, model: str, key: str) -> dict:
    config = {"$schema": "https://opencode.ai/config.json", "model": f"mlx-dflash/{model}", "provider": {
        "mlx-dflash": {"npm": "@ai-sdk/openai-compatible", "name": "mlx-dflash",
                       "options": {"baseURL": f"{url}/v1", "apiKey": key},
                       "models": {model: {"name": model}}}}}
    return {"OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1"}


CLIENTS = {
    "claude": Client("claude", "@anthropic-ai/claude-code", _claude_env),
    "codex": Client("codex", "@openai/codex", lambda url, model, key: {"MLX_DFLASH_API_KEY": key}, _codex_args),
    "opencode": Client("opencode", "opencode-ai", _opencode_env),
}


def executable(client: Client) -> str:
    from .utils import cache_dir

    installed = cache_dir() / "npm" / "node_modules" / ".bin"  # where the tests install the clients
    found = shutil.which(client.name) or shutil.which(client.name, path=str(installed))
    if found is None:
        raise DFlashError(f"{client.name} is not installed: npm install -g {client.package} (Node.js 20 or newer)")
    return found


def _get(url: str, key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        return json.loads(r.read())


def served_model(url: str, key: str | None) -> str | None:
    """The model an mlx-dflash server at `url` serves; None where nothing listens there."""
    try:
        health = _get(url + "/health", None)
    except urllib.error.URLError as e:
        if isinstance(getattr(e, "reason", None), ConnectionRefusedError):
            return None
        raise DFlashError(f"{url} answers, but not as mlx-dflash serve ({e.reason}): choose another --port") from None
    except (OSError, ValueError) as e:
        raise DFlashError(f"{url} answers, but not as mlx-dflash serve ({e}): choose another --port") from None
    if health.get("status") != "ok" or "model" not in health:
        raise DFlashError(f"{url} answers, but not as mlx-dflash serve: choose another --port")
    return health["model"]


def start_server(port: int, serve_args: list, key: str | None) -> tuple[subprocess.Popen, Path]:
    """`mlx-dflash serve` on 127.0.0.1:port (with the API key, if one is given), its output in a log file;
    (the process, the log)."""
    from .utils import cache_dir

    log = cache_dir() / "launch" / f"serve-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        env = {**os.environ, **({"MLX_DFLASH_API_KEY": key} if key else {})}
        process = subprocess.Popen([sys.executable, "-m", "mlx_dflash.cli", "serve", "--port", str(port), *serve_args],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return process, log


def wait_until_served(process: subprocess.Popen, log: Path, url: str) -> str:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(nothing)"]
            raise DFlashError(f"mlx-dflash serve exited ({process.returncode}): {last[0]} (the log: {log})")
        try:
            return _get(url + "/health", None)["model"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.5)
    process.terminate()
    raise DFlashError(f"mlx-dflash serve did not answer within {START_SECONDS} s (the log: {log})")


def stop(process: subprocess.Popen):
    process.terminate()  # a clean stop: the running request is given --shutdown-grace
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def launch(client: Client, port: int, serve_args: list, key: str | None, args: tuple) -> int:
    """Run the client against the server on `port` (started here where none answers); its exit status."""
    program = executable(client)  # before a server starts: a missing client costs nothing
    url = f"http://127.0.0.1:{port}"
    started = None
    model = served_model(url, key)
    if model is None:
        started, log = start_server(port, serve_args, key)
        click.echo(f"mlx-dflash: starting serve at {url} for {client.name} (the log: {log})", err=True)
        try:
            model = wait_until_served(started, log, url)
        except BaseException:
            stop(started)
            raise
    else:
        click.echo(f"mlx-dflash: {client.name} on the server already at {url} ({model})", err=True)
    env = {**os.environ, **client.env(url, model, key or "unused")}
    try:
        return subprocess.run([program, *client.args(url, model), *args], env=env).returncode
    except KeyboardInterrupt:
        return 130
    finally:
        if started is not None:
            stop(started)


def command(name: str) -> click.Command:
    client = CLIENTS[name]

    @click.command(name, context_settings={"ignore_unknown_options": True})
    @click.option("--port", default=8080, show_default=True, type=int,
                  help="The server's port on 127.0.0.1: the one answering there is used, else one is started.")
    @click.option("--model", "model_path", default=None, help="The target a started server loads (serve --model).")
    @click.option("--drafter", "drafter_path", default=None, help="Its drafter (serve --drafter).")
    @click.option("--serve-flag", "serve_flags", multiple=True,
                  help="Any other flag for a started server, e.g. --serve-flag=--max-batch=2 (repeatable).")
    @click.option("--api-key", envvar="MLX_DFLASH_API_KEY", default=None,
                  help="The server's API key, where it has one (env MLX_DFLASH_API_KEY); a started server gets it.")
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def run(port, model_path, drafter_path, serve_flags, api_key, args):
        serve_args = [*(["--model", model_path] if model_path else []), *(["--drafter", drafter_path] if drafter_path
                                                                          else []), *serve_flags]
        sys.exit(launch(client, port, serve_args, api_key, args))

    run.help = (f"Run {client.name} ({client.package} on npm) on mlx-dflash serve: the server on --port, started "
                f"and stopped here where none answers. Arguments after -- go to {client.name}.")
    return run
