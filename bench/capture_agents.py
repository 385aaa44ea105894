"""Capture real coding agents' editing requests for bench/editing.py: Claude Code and Codex are each asked to change
a file, against a loopback stand-in for the model that answers their first request with a call reading that file
and records the request that brings its contents back (what an agent sends a model mid-edit).

    python bench/capture_agents.py          # writes bench/data/agent-requests/{claude-code,codex}.json

The clients are the npm packages tests/test_agents_real.py pins, installed into the project's cache as there.
The file is four of HumanEval's canonical solutions as one module (bench/editing.py `functions`); the ask is to
rename one function and write the whole file back. What varies per run (ids, checksums, the scratch folder's
path) is replaced by fixed strings, so a capture is the same file on every machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from editing import functions
from mlx_dflash.utils import cache_dir, write_atomic

OUT = Path(__file__).resolve().parent / "data" / "agent-requests"
MODEL = "local-model"
FILE = "utils.py"
SCRATCH = "/srv/project"  # the scratch folder's path as a capture names it


def ask(funcs: list) -> str:
    name = funcs[1][0]
    return (f"In {FILE}, rename the function `{name}` to `{name}_v2` (its calls too) and add a one-line comment "
            f"above it. Read the file first, then write the whole new {FILE}.")


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_reply(call: dict | None) -> bytes:
    """A streamed Messages reply: a tool_use block (call) or the text "Done."."""
    head = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
    block = ({"type": "tool_use", "id": "toolu_1", "name": call["name"], "input": {}} if call
             else {"type": "text", "text": ""})
    delta = ({"type": "input_json_delta", "partial_json": json.dumps(call["arguments"])} if call
             else {"type": "text_delta", "text": "Done."})
    return b"".join([
        sse("message_start", {"type": "message_start", "message": head}),
        sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": 5},
                              "delta": {"stop_reason": "tool_use" if call else "end_turn", "stop_sequence": None}}),
        sse("message_stop", {"type": "message_stop"})])


def responses_reply(call: dict | None) -> bytes:
    """A streamed Responses reply: a function_call item (call) or the message "Done."."""
    item = ({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": call["name"],
             "arguments": json.dumps(call["arguments"]), "status": "completed"} if call
            else {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                  "content": [{"type": "output_text", "text": "Done.", "annotations": []}]})
    response = {"id": "resp_1", "object": "response", "created_at": 0, "model": MODEL, "status": "in_progress",
                "output": []}
    done = {**response, "status": "completed", "output": [item],
            "usage": {"input_tokens": 1, "output_tokens": 5, "total_tokens": 6}}
    return b"".join([
        sse("response.created", {"type": "response.created", "response": response}),
        sse("response.output_item.added", {"type": "response.output_item.added", "output_index": 0, "item": item}),
        sse("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
        sse("response.completed", {"type": "response.completed", "response": done})])


def read_call(body: dict, path: Path) -> dict:
    """The call that reads the file, with the tool the request offers for it."""
    names = {t.get("name") for t in body.get("tools", [])}
    if "Read" in names:
        return {"name": "Read", "arguments": {"file_path": str(path)}}
    if "shell" in names:
        return {"name": "shell", "arguments": {"command": ["cat", FILE], "workdir": str(path.parent)}}
    if "exec_command" in names:
        return {"name": "exec_command", "arguments": {"cmd": f"cat {FILE}", "workdir": str(path.parent)}}
    raise SystemExit(f"no tool to read a file among {sorted(n for n in names if n)}")


def carries_result(body: dict) -> bool:
    """The request holds a tool's result (the file read back)."""
    text = json.dumps(body.get("messages", body.get("input", [])))
    return '"tool_result"' in text or '"function_call_output"' in text


class StandIn(ThreadingHTTPServer):
    def __init__(self, path: Path):
        super().__init__(("127.0.0.1", 0), Handler)
        self.path, self.captured = path, None


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.send_response(200)
        self.end_headers()

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        done = carries_result(body)
        if done and self.server.captured is None:
            self.server.captured = body
        call = None if done else read_call(body, self.server.path)
        reply = anthropic_reply(call) if "/messages" in self.path else responses_reply(call)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


def npm_client(name: str) -> Path:
    path = cache_dir() / "npm" / "node_modules" / ".bin" / name
    if not path.exists():
        raise SystemExit(f"{name} is not installed: run `python -m pytest -m slow tests/test_agents_real.py` once "
                         f"(it installs the pinned clients), or npm install it into {cache_dir() / 'npm'}")
    return path


def run(client: str, scratch: Path, url: str, prompt: str):
    home = scratch / "home"
    home.mkdir()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home)}
    if client == "claude-code":
        env.update({"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": MODEL,
                    "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_ATTRIBUTION_HEADER": "0"})
        cmd = [npm_client("claude"), "-p", prompt, "--output-format", "json", "--tools", "Read,Write",
               "--max-turns", "3"]
    else:
        codex_home = home / "codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "local"\n\n[model_providers.local]\nname = "local"\n'
            f'base_url = "{url}/v1"\nenv_key = "LOCAL_API_KEY"\nwire_api = "responses"\n')
        env.update({"CODEX_HOME": str(codex_home), "LOCAL_API_KEY": "unused"})
        cmd = [npm_client("codex"), "exec", "--skip-git-repo-check", "--ephemeral",
               "--dangerously-bypass-approvals-and-sandbox", prompt]
    return subprocess.run([str(c) for c in cmd], env=env, cwd=scratch / "project", stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)


def scrubbed(body: dict, scratch: Path) -> dict:
    """The body with the run's own strings fixed: the scratch path, ids, checksums and dates."""
    text = json.dumps(body, indent=1).replace(str(scratch / "project"), SCRATCH).replace(str(scratch), "/srv")
    text = re.sub(r"cch=[0-9a-f]+", "cch=0", text)
    uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    text = re.sub(uuid, "00000000-0000-0000-0000-000000000000", text)
    text = re.sub(r"OS Version: [^\\]*", "OS Version: Linux", text)
    text = re.sub(r"Chunk ID: \w+", "Chunk ID: 000000", re.sub(r"Wall time: [0-9.]+", "Wall time: 0.0010", text))
    text = re.sub(r"_unix_ms\\\":\d+", "_unix_ms\\\":0", text)
    text = re.sub(r"\b20\d\d-\d\d-\d\d\b", "2026-01-01", text)
    return json.loads(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="claude-code,codex")
    args = ap.parse_args(argv)
    funcs = functions()[:4]
    OUT.mkdir(parents=True, exist_ok=True)
    for client in args.clients.split(","):
        with tempfile.TemporaryDirectory() as folder:
            scratch = Path(folder)
            (scratch / "project").mkdir()
            path = scratch / "project" / FILE
            path.write_text("\n\n".join(source for _, source in funcs))
            server = StandIn(path)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            try:
                done = run(client, scratch, f"http://127.0.0.1:{server.server_address[1]}", ask(funcs))
            finally:
                server.shutdown()
            if server.captured is None:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{client}: no request carried the file back")
            out = write_atomic(OUT / f"{client}.json",
                               json.dumps(scrubbed(server.captured, scratch), indent=1, sort_keys=True) + "\n")
            print(f"{client}: {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
