"""bench/batching.py's mixed load: which clients send long prompts, what those prompts are, how their times
to first token are summarized apart (the servers themselves are left out: a fake answers)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import batching  # noqa: E402


class WordTokenizer:
    def encode(self, text):
        return text.split()


def test_a_long_document_reaches_its_length_and_asks_for_its_last_problem():
    texts = [f"question {i} has five words" for i in range(50)]
    doc = batching.long_document(WordTokenizer(), texts, start=3, tokens=40)
    problems = [line for line in doc.splitlines() if line.startswith("Problem ")]
    assert problems[0] == "Problem 1: question 3 has five words"
    counted = [len(p.split()) + 1 for p in problems]  # its tokens and the newline after it
    assert sum(counted) >= 40 > sum(counted[:-1])
    assert doc.endswith(f"Solve problem {len(problems)} step by step.")
    assert batching.long_document(WordTokenizer(), texts, start=97, tokens=40) != doc


def test_a_document_longer_than_the_set_is_refused():
    try:
        batching.long_document(WordTokenizer(), ["a b"], start=0, tokens=100)
    except SystemExit as e:
        assert "too short" in str(e)
    else:
        raise AssertionError("a document past the whole set was made")


def test_each_repeat_sends_long_documents_no_server_has_read_before():
    texts = [f"q{i} w{i}" for i in range(50)]
    sets = batching.long_prompt_sets(WordTokenizer(), texts, requests=2, tokens=20, repeats=3)
    starts = [doc.split("\n")[0] for docs in sets for doc in docs.values()]
    assert len(sets) == 3 and len(set(starts)) == 6  # six documents, each from its own first problem


def test_the_last_clients_send_the_long_prompts_and_their_ttft_is_summarized_apart(monkeypatch):
    sent = []

    def fake_chat(client, model, messages, max_tokens, tools=None):
        prompt = messages[0]["content"]
        sent.append(prompt)
        long = prompt.startswith("LONG")
        return {"ttft": 9.0 if long else 1.0, "seconds": 10.0 if long else 2.0, "text": prompt,
                "completion_tokens": 4, "prompt_tokens": 1, "cached_tokens": 0, "dflash": {}}

    monkeypatch.setattr(batching, "stream_chat", fake_chat)
    server = type("Server", (), {"client": lambda self: None})()
    long_prompts = {0: "LONG a", 1: "LONG b", 2: "LONG c", 3: "LONG d"}  # 2 clients x 2 requests
    level = batching.run_level(server, "m", [f"short {i}" for i in range(8)], 4, 2, 8, long_prompts)
    kinds = [(r["client"], r["long"], r["text"]) for r in level["requests"]]
    assert kinds == [(0, False, "short 0"), (0, False, "short 1"), (1, False, "short 2"), (1, False, "short 3"),
                     (2, True, "LONG a"), (2, True, "LONG b"), (3, True, "LONG c"), (3, True, "LONG d")]
    row = batching.summary("ours", 4, [level])
    assert (row["short_ttft_p50_s"], row["long_ttft_p50_s"]) == (1.0, 9.0)
    assert "short / long" in batching.markdown([row, {**row, "server": batching.MLX_LM}], [4])
    assert "short_ttft_p50_s" not in batching.summary("ours", 4, [batching.run_level(
        server, "m", [f"short {i}" for i in range(8)], 4, 2, 8, {})])
