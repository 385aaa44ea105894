"""bench/editing.py's captured agent requests and bench/capture_agents.py's stand-in for the model: what the
captured Claude Code and Codex turns become as chat conversations, and the stand-in's replies as the official
clients read them (no model runs here)."""

import json
import sys
import threading
from pathlib import Path

import anthropic
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import capture_agents  # noqa: E402
import editing  # noqa: E402


def source_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.strip()]


def test_the_captured_requests_become_a_file_read_back_and_an_ask_to_rewrite_it():
    claude, codex = editing.captured_prompts()
    module = "\n\n".join(source for _, source in editing.functions()[:4])
    for conversation, tools in ((claude, {"Read", "Write"}), (codex, {"exec_command"})):
        roles = [m["role"] for m in conversation["messages"]]
        assert roles[-2:] == ["assistant", "tool"] and "user" in roles and "system" not in roles
        call = conversation["messages"][-2]["tool_calls"][0]
        assert isinstance(call["function"]["arguments"], dict)  # as chat templates take it
        assert call["id"] == conversation["messages"][-1]["tool_call_id"]
        read_back = conversation["messages"][-1]["content"]
        # the file comes back whole (Claude Code numbers its lines: "12\t" before each)
        assert all(line.split("\t", 1)[-1] in read_back for line in source_lines(module))
        asks = [m["content"] for m in conversation["messages"] if m["role"] == "user"]
        assert any("rename the function" in a for a in asks)
        assert {t["function"]["name"] for t in conversation["tools"]} == tools
    sent = editing.over_http(claude)
    assert json.loads(sent["messages"][-2]["tool_calls"][0]["function"]["arguments"])["file_path"].endswith("utils.py")
    assert claude["messages"][-2]["tool_calls"][0]["function"]["arguments"]["file_path"].endswith("utils.py")


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / capture_agents.FILE
    path.write_text("def f():\n    return 1\n")
    server = capture_agents.StandIn(path)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_stand_in_asks_an_anthropic_client_to_read_the_file_then_keeps_the_turn_that_reads_it_back(stand_in):
    server, url = stand_in
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tools = [{"name": "Read", "description": "read a file", "input_schema": {"type": "object", "properties": {}}}]
    messages = [{"role": "user", "content": "rename f"}]
    with client.messages.stream(model="m", max_tokens=10, messages=messages, tools=tools) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use" and first.content[0].input == {"file_path": str(server.path)}
    assert server.captured is None
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[0].id,
                                               "content": server.path.read_text()}]}]
    with client.messages.stream(model="m", max_tokens=10, messages=messages, tools=tools) as stream:
        assert stream.get_final_text() == "Done."
    assert server.captured["messages"] == json.loads(json.dumps(messages))


def test_the_stand_in_asks_a_responses_client_to_run_cat_then_keeps_the_turn_with_its_output(stand_in):
    server, url = stand_in
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}]
    items = [{"role": "user", "content": "rename f"}]
    with client.responses.stream(model="m", input=items, tools=tools) as stream:
        first = stream.get_final_response()
    call = first.output[0]
    assert call.type == "function_call" and json.loads(call.arguments)["cmd"] == "cat utils.py"
    items += [call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": server.path.read_text()}]
    with client.responses.stream(model="m", input=items, tools=tools) as stream:
        assert stream.get_final_response().output_text == "Done."
    assert server.captured["input"][-1]["output"] == server.path.read_text()


def test_a_request_offering_no_tool_to_read_with_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="no tool to read a file among"):
        capture_agents.read_call({"tools": [{"name": "Grep"}]}, tmp_path / "utils.py")
