"""The real coding-agent clients, headless, against the real `mlx-dflash serve` process (slow tier).

Claude Code and Codex come from npm (pinned versions, installed once under the mlx-dflash cache dir, then
reused), openai-agents from PyPI. The server runs Qwen2.5-Coder-0.5B-Instruct (its template renders tools)
with a random DFlash drafter made for it: decoding is lossless, so any drafter gives the target's own
answers. Each client gets a home of its own in a temporary directory, talks to 127.0.0.1 only, and every
process is bounded in time. What is checked is that each client completes its turn (exit 0, an answer),
not what the 0.5B model says.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from serving import free_port, raw, wait_for_health
from sharded_models import save_random_drafter
from mlx_dflash.downloads import cache_dir

pytestmark = pytest.mark.slow

NPM_CLIENTS = {"claude": ("@anthropic-ai/claude-code", "2.1.332"), "codex": ("@openai/codex", "0.171.0"),
               "opencode": ("opencode-ai", "1.18.33")}
CLIENT_SECONDS = 1800  # one client run: a 3-12k-token prompt prefilled on a shared 2-core CPU
HELLO = "Reply with one word: hello"


def npm_client(name: str):
    """The path of client `name`'s executable, npm-installed at its pinned version into the cache once."""
    package, version = NPM_CLIENTS[name]
    prefix = cache_dir() / "npm"
    manifest = prefix / "node_modules" / package / "package.json"
    if not manifest.is_file() or json.loads(manifest.read_text())["version"] != version:
        if shutil.which("npm") is None:
            pytest.fail(f"{name} comes from npm: install Node.js (20 or newer), which brings npm")
        subprocess.run(["npm", "install", "--prefix", str(prefix), "--save-exact", "--no-audit", "--no-fund",
                        f"{package}@{version}"], check=True, capture_output=True, timeout=900)
    return prefix / "node_modules" / ".bin" / name


class Server:
    """The `mlx-dflash serve` subprocess on a free loopback port, its log in a file."""

    def __init__(self, root, drafter: bool = True):
        """drafter: a random DFlash drafter beside the target; False: none (no --drafter: Qwen has no drafter)."""
        from mlx_dflash.downloads import ensure_qwen25_coder_05b

        target = ensure_qwen25_coder_05b("float32")
        pair = ["--model", str(target)]
        if drafter:
            pair += ["--drafter", str(save_random_drafter(root / "drafter", target, block_size=8, features=3))]
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = root / "server.log"
        with open(self.log_path, "w") as log:
            # --max-tokens-limit bounds what a chatty model may write per request (clients ask for 32000).
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlx_dflash.cli", "serve", *pair,
                 "--port", self.url.rsplit(":", 1)[1], "--max-tokens-limit", "512"],
                stdout=log, stderr=subprocess.STDOUT)
        wait_for_health(self.process, self.url, seconds=600)
        self.model = raw(self.url, "/v1/models")[2]["data"][0]["id"]

    def health(self) -> dict:
        return raw(self.url, "/health")[2]

    def requests(self) -> list:
        """The log's request lines so far."""
        return [line for line in self.log_path.read_text().splitlines() if " /v1/" in line]

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("agents-server"))
    try:
        yield s
    finally:
        s.stop()
    print("".join(f"\n  {line}" for line in s.requests()))  # the request sizes, for `pytest -s`


def run_client(cmd, env, cwd, timeout=CLIENT_SECONDS):
    """(exit status, stdout, stderr, seconds) of one client run, stdin closed, only `env` passed on."""
    tic = time.time()
    r = subprocess.run([str(c) for c in cmd], env={"PATH": os.environ.get("PATH", ""), **env}, cwd=cwd,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr, time.time() - tic


def claude_code(server, home, *args):
    """Claude Code headless (`-p`, JSON result) with the Agent and Read tools: (exit status, result, stderr)."""
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": server.model, "ANTHROPIC_SMALL_FAST_MODEL": server.model,
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           "API_TIMEOUT_MS": str(CLIENT_SECONDS * 1000)}
    code, out, err, _ = run_client([npm_client("claude"), "-p", *args, "--output-format", "json",
                                    "--tools", "Agent,Read", "--max-turns", "3"], env, home)
    return code, json.loads(out) if out.strip() else None, err


def test_claude_code_answers_and_its_second_turn_reads_the_first_from_the_prefix_cache(server, tmp_path):
    code, result, err = claude_code(server, tmp_path, HELLO)
    assert code == 0, (result or {}).get("result") or err
    assert result["is_error"] is False and result["result"].strip(), result
    hits = server.health()["prompt_cache"]["hits"]

    code, second, err = claude_code(server, tmp_path, "--resume", result["session_id"], "Now reply with: bye")
    assert code == 0, (second or {}).get("result") or err
    assert second["is_error"] is False and second["result"].strip(), second
    # The second request's prompt starts with the first's (system prompt, tools, first turn): the first's
    # prompt is read from the prefix cache, near all of it, and the server says so in Anthropic's usage.
    assert server.health()["prompt_cache"]["hits"] > hits
    first_prompt = result["usage"]["cache_creation_input_tokens"] + result["usage"]["cache_read_input_tokens"]
    assert second["usage"]["cache_read_input_tokens"] >= 0.9 * first_prompt, (result["usage"], second["usage"])


def test_codex_exec_answers(server, tmp_path):
    codex_turn(server, tmp_path)


def test_codex_exec_answers_a_server_without_a_drafter(tmp_path_factory, tmp_path):
    """`mlx-dflash serve --model DIR` with no drafter for the model: it says so in one line, and Codex's turn
    completes on speculation from the context alone."""
    lone = Server(tmp_path_factory.mktemp("agents-no-drafter"), drafter=False)
    try:
        codex_turn(lone, tmp_path)
    finally:
        lone.stop()
    log = lone.log_path.read_text().splitlines()
    assert sum(line.startswith("speculation: no drafter") for line in log) == 1


def codex_turn(server, tmp_path):
    """One `codex exec` turn on the server over the Responses API: it answers, and nothing is cancelled."""
    home = tmp_path / "codex-home"
    home.mkdir()
    # Codex drops a stream quiet for stream_idle_timeout_ms (default 300000) and an SSE comment (the server's
    # ping) does not count: its ~6k-token first prompt takes longer than that to prefill on a CPU.
    (home / "config.toml").write_text(
        f'model = "{server.model}"\nmodel_provider = "local"\n\n[model_providers.local]\nname = "local"\n'
        f'base_url = "{server.url}/v1"\nenv_key = "LOCAL_API_KEY"\nwire_api = "responses"\n'
        f'stream_idle_timeout_ms = {CLIENT_SECONDS * 1000}\n')
    answer = tmp_path / "answer.txt"
    env = {"HOME": str(tmp_path), "CODEX_HOME": str(home), "LOCAL_API_KEY": "unused"}
    code, out, err, _ = run_client([npm_client("codex"), "exec", "--skip-git-repo-check", "--ephemeral",
                                    "--output-last-message", answer, HELLO], env, tmp_path)
    assert code == 0, err[-4000:]
    assert answer.read_text().strip(), out + err[-4000:]
    assert not [line for line in server.requests() if "/v1/responses" in line and "finish=cancelled" in line]


def test_openai_agents_runs_its_function_tool_over_responses(server):
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"Sunny and 21 C in {city}."

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=CLIENT_SECONDS, max_retries=0)
    # The provider's default model is its Responses model; tool_choice "required" makes the first turn a
    # call (the SDK resets it to auto once a tool has run, so the next turn answers).
    agent = Agent(name="weather", instructions="Answer with the get_weather tool.", tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required"))
    config = RunConfig(model=server.model, model_provider=OpenAIProvider(openai_client=client),
                       tracing_disabled=True)
    result = Runner.run_sync(agent, "What is the weather in Paris?", run_config=config, max_turns=4)
    assert cities, "the tool did not run"
    assert isinstance(result.final_output, str) and result.final_output.strip()


# The launchers: `mlx-dflash claude|codex|opencode`, as a user runs them.

def launcher(name: str, home, port: int, *args, serve=()):
    """`mlx-dflash NAME --port PORT [SERVE...] -- ARGS` with `home` as HOME: (exit status, stdout, stderr)."""
    npm_client(name)  # installed in the cache dir's npm/, where the launcher finds it too
    env = {"HOME": str(home), "MLX_DFLASH_CACHE": str(cache_dir())}
    code, out, err, _ = run_client([sys.executable, "-m", "mlx_dflash.cli", name, "--port", str(port), *serve, "--",
                                    *args], env, home)
    return code, out, err


def serve_processes(port: int) -> list:
    """The `mlx-dflash serve` processes on `port` still running."""
    lines = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in lines if "mlx_dflash.cli serve" in line and f"--port {port}" in line]


def test_the_claude_launcher_starts_a_server_runs_a_turn_and_stops_it(tmp_path):
    from mlx_dflash.downloads import ensure_qwen25_coder_05b

    target = ensure_qwen25_coder_05b("float32")
    drafter = save_random_drafter(tmp_path / "drafter", target, block_size=8, features=3)
    port = free_port()
    code, out, err = launcher("claude", tmp_path, port, "-p", HELLO, "--output-format", "json", "--tools",
                              "Agent,Read", "--max-turns", "3",
                              serve=["--model", str(target), "--drafter", str(drafter),
                                     "--serve-flag=--max-tokens-limit=512"])
    assert code == 0, err[-4000:]
    result = json.loads(out)
    assert result["is_error"] is False and result["result"].strip(), result
    assert f"starting serve at http://127.0.0.1:{port}" in err
    with pytest.raises(OSError):  # nothing left listening, nor running
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert not serve_processes(port)


def test_the_codex_launcher_runs_a_turn_on_the_server_already_there(server, tmp_path):
    answer = tmp_path / "answer.txt"
    port = int(server.url.rsplit(":", 1)[1])
    code, out, err = launcher("codex", tmp_path, port, "exec", "--skip-git-repo-check", "--ephemeral",
                              "--output-last-message", str(answer), HELLO)
    assert code == 0, err[-4000:]
    assert answer.read_text().strip(), out + err[-4000:]
    assert "on the server already at" in err and server.process.poll() is None  # it is left running


def test_the_opencode_launcher_runs_a_turn_on_the_server_already_there(server, tmp_path):
    port = int(server.url.rsplit(":", 1)[1])
    code, out, err = launcher("opencode", tmp_path, port, "run", HELLO)
    assert code == 0, err[-4000:]
    assert out.strip(), err[-4000:]
    assert server.process.poll() is None
