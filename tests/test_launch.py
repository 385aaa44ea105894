"""`mlx-dflash claude|codex|opencode` against a server already on the port, with stand-in clients (scripts
that record what they were given) so that what each launcher sets is checked exactly; a missing client and a
port held by something else are one line. The real clients, and a launcher starting its own server, are in
test_agents_real.py (slow tier)."""

import json
import os
import socket
import sys
import threading

import pytest
from click.testing import CliRunner

from mlx_dflash.cli import main

from serving import MODEL, free_port, port_of, running

STAND_IN = """#!{python}
import json, os, sys
names = ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "API_TIMEOUT_MS",
         "MLX_DFLASH_API_KEY", "OPENCODE_CONFIG_CONTENT", "OPENCODE_DISABLE_MODELS_FETCH")
json.dump({{"args": sys.argv[1:], "env": {{n: os.environ.get(n) for n in names}}}}, open(os.environ["RECORD"], "w"))
sys.exit(3)
"""


@pytest.fixture(scope="module")
def served(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    with running((target, drafter, tokenizer)) as (url, _):
        yield url


def launch(name, port, *args, tmp_path, clients=True):
    """(exit status, stderr, what the stand-in recorded) of `mlx-dflash NAME --port PORT -- ARGS`, the command run
    in this process (it starts the client as the real command does: a process of its own)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if clients:
        script = bin_dir / name
        script.write_text(STAND_IN.format(python=sys.executable))
        script.chmod(0o755)
    record = tmp_path / "record.json"
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "HOME": str(tmp_path), "MLX_DFLASH_CACHE": str(tmp_path),
           "RECORD": str(record)}
    r = CliRunner().invoke(main, [name, "--port", str(port), "--", *args], env=env)
    return r.exit_code, r.stderr, json.loads(record.read_text()) if record.exists() else None


def test_claude_gets_the_server_the_model_and_the_timeouts(served, tmp_path):
    code, err, got = launch("claude", port_of(served), "-p", "hi", "--output-format", "json", tmp_path=tmp_path)
    assert code == 3 and got["args"] == ["-p", "hi", "--output-format", "json"], err  # its status, its arguments
    assert got["env"] | {"MLX_DFLASH_API_KEY": None} == {
        "ANTHROPIC_BASE_URL": served, "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "API_TIMEOUT_MS": "1800000", "MLX_DFLASH_API_KEY": None,
        "OPENCODE_CONFIG_CONTENT": None, "OPENCODE_DISABLE_MODELS_FETCH": None}
    assert f"on the server already at {served} ({MODEL})" in err


def test_codex_gets_its_provider_as_overrides_before_the_users_arguments(served, tmp_path):
    code, err, got = launch("codex", port_of(served), "exec", "hi", tmp_path=tmp_path)
    assert code == 3, err
    assert got["args"] == ["-c", f'model="{MODEL}"', "-c", 'model_provider="mlx_dflash"', "-c",
                           f'model_providers.mlx_dflash={{name = "mlx-dflash", base_url = "{served}/v1", '
                           'env_key = "MLX_DFLASH_API_KEY", wire_api = "responses", '
                           'stream_idle_timeout_ms = 1800000}', "exec", "hi"]
    assert got["env"]["MLX_DFLASH_API_KEY"] == "unused"


def test_opencode_gets_its_provider_in_the_environment(served, tmp_path):
    code, err, got = launch("opencode", port_of(served), "run", "hi", tmp_path=tmp_path)
    assert code == 3 and got["args"] == ["run", "hi"], err
    config = json.loads(got["env"]["OPENCODE_CONFIG_CONTENT"])
    assert config["model"] == f"mlx-dflash/{MODEL}"
    assert config["provider"]["mlx-dflash"]["options"] == {"baseURL": f"{served}/v1", "apiKey": "unused"}
    assert got["env"]["OPENCODE_DISABLE_MODELS_FETCH"] == "1"


def test_a_missing_client_is_one_line_naming_its_package(tmp_path):
    code, err, got = launch("opencode", free_port(), tmp_path=tmp_path, clients=False)
    assert code == 1 and got is None
    assert err.strip().splitlines() == [
        "error: opencode is not installed: npm install -g opencode-ai (Node.js 20 or newer)"]


def test_a_port_held_by_another_server_is_one_line(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer():  # not mlx-dflash: a bare HTTP answer with no JSON
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        code, err, got = launch("claude", listener.getsockname()[1], tmp_path=tmp_path)
    finally:
        listener.close()
    assert code == 1 and got is None
    (line,) = err.strip().splitlines()
    assert line.startswith("error: http://127.0.0.1:") and "answers, but not as mlx-dflash serve" in line, line
    assert line.endswith("choose another --port"), line
