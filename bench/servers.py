"""Servers as benchmarks run them: `mlx-dflash serve` and `mlx_lm.server` subprocesses on free loopback
ports, and one streamed chat request timed from the client's side (the official `openai` client)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (`command` gets `--port` appended) on a free loopback port; stopped by stop().
    env, cwd: the subprocess's, where they differ from this process's."""

    def __init__(self, command: list, log_path: Path, model_id: str | None = None, env: dict | None = None,
                 cwd: str | None = None, api_key: str | None = None):
        self.model_id = model_id  # what requests name as "model" (None: the server's /v1/models says)
        self.api_key = api_key  # for /v1/models, where the server requires one
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([*command, "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, cwd=cwd)

    def wait_ready(self, seconds: float = 900) -> str:
        """The served model's id, once the server answers /health."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit(f"the server did not start in {seconds:.0f} s; see {self.log.name}")
        if self.model_id is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            with urllib.request.urlopen(urllib.request.Request(self.url + "/v1/models", headers=headers),
                                        timeout=30) as r:
                self.model_id = json.loads(r.read())["data"][0]["id"]
        return self.model_id

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="bench", max_retries=0, timeout=3600)

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it (SIGKILL after 60 s); its exit status."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


def dflash_server(flags: list, log_path: Path, tree: Path | None = None, api_key: str | None = None) -> Server:
    """`mlx-dflash serve` of this checkout, or of another revision's checked-out `tree` (imported alone: run
    from a temporary folder, so that the current folder's package does not come first); api_key: one of the
    keys its flags give."""
    if tree is None:
        return Server([sys.executable, "-m", "mlx_dflash.cli", "serve", *flags], log_path, api_key=api_key)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return Server([sys.executable, "-m", "mlx_dflash.cli", "serve", *flags], log_path, env=env,
                  cwd=tempfile.gettempdir(), api_key=api_key)


def mlx_lm_server(model: str, flags: list, log_path: Path) -> Server:
    """mlx-lm's own server; requests name the model by the path it loaded (its /v1/models lists the Hugging
    Face cache instead)."""
    return Server([sys.executable, "-m", "mlx_lm.server", "--model", str(model), *flags], log_path, str(model))


def stream_chat(client: openai.OpenAI, model: str, messages: list, max_tokens: int, tools: list = None) -> dict:
    """One streamed greedy chat request: its text (a tool call's name and arguments included), time to the first
    text, total time, usage."""
    sent = time.perf_counter()
    first, text, usage, stats = None, [], None, {}
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            **({"tools": tools} if tools else {}))
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        pieces = [delta.content] if delta is not None and delta.content else []
        for call in (delta.tool_calls or []) if delta is not None else []:
            pieces += [call.function.name or "", call.function.arguments or ""] if call.function else []
        if any(pieces):
            first = first or time.perf_counter()
            text.extend(pieces)
        if chunk.usage is not None:
            usage, stats = chunk.usage, (chunk.model_extra or {}).get("dflash", {})
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return {"ttft": (first or end) - sent, "seconds": end - sent, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens if usage is not None else None,
            "completion_tokens": usage.completion_tokens if usage is not None else None,
            "cached_tokens": getattr(details, "cached_tokens", None), "dflash": stats}
