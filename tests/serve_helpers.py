"""Pieces for the server tests: an engine whose replies are given by the test (a forced output), tokenizers
whose chat template renders tools or opens a thinking section, and a tiny random pair with a context length.

`ScriptedEngine` runs every request as the real engine does (chat template, queue, stop strings, rounds,
cancellation, wire formats) but answers with the next of its `scripts`: that text's tokens, three per
round, then the stop token, as its scheduler would send them. It records each request's prompt as
text, so a test can see what the chat template made of the tools and tool results it sent.
"""

import json
import time
from pathlib import Path

from mlx_dflash.decoding.batch_decoder import BatchStats
from mlx_dflash.decoding.decoder import Round
from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.models.target import Target
from mlx_dflash.server.engine import Engine

# Qwen2.5's way of rendering tools, tool calls and tool results, over SmolLM2's ChatML tokens (mlx-lm infers
# its json_tools parser from `<tool_call>` and `tool_call.name`, as for Qwen2.5).
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call, return <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# Qwen3's thinking switch over ChatML, its section opened by the generation prompt (as in Qwen3-2507's
# thinking models): `enable_thinking=False` closes it empty, so the model answers at once. No tools.
THINKING_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
THINK_TOKENS = {3: "<think>", 4: "</think>"}  # SmolLM2's <repo_name> and <reponame>, renamed (no new ids)


def tools_tokenizer(tokenizer_dir: Path, out: Path):
    """SmolLM2's tokenizer with TOOLS_TEMPLATE as its chat template, loaded as mlx-lm loads tokenizers."""
    return templated_tokenizer(tokenizer_dir, out, TOOLS_TEMPLATE)


def thinking_tokenizer(tokenizer_dir: Path, out: Path):
    """SmolLM2's tokenizer with THINKING_TEMPLATE and two special tokens renamed `<think>` and `</think>` (as
    Qwen3's, not special), so that mlx-lm finds a thinking section in it."""
    return templated_tokenizer(tokenizer_dir, out, THINKING_TEMPLATE, THINK_TOKENS)


def templated_tokenizer(tokenizer_dir: Path, out: Path, template: str, renamed: dict = None):
    """SmolLM2's tokenizer with `template` as its chat template and the added tokens `renamed` ({id: text})
    renamed, loaded as mlx-lm loads tokenizers."""
    from mlx_lm.utils import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for token in tokenizer["added_tokens"]:
        if token["id"] in (renamed or {}):
            del vocab[token["content"]]
            token["content"], token["special"] = renamed[token["id"]], False
            vocab[token["content"]] = token["id"]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return load_tokenizer(out)


class ScriptedScheduler:
    """The scheduler's events for each request submitted: the next of the engine's scripts, that text's tokens
    `per_round` a round, then the stop token (max_tokens cuts it); the requests' prompts recorded as text."""

    def __init__(self, engine, per_round: int = 3):
        self.engine, self.per_round = engine, per_round
        self.stats = BatchStats()
        self.running: list = []  # [handle, tokens left, admitted]
        self.ending: set = set()

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def submit(self, request):
        tokenizer = self.engine.tokenizer
        self.engine.prompt_texts.append(tokenizer.decode(request.ids))
        text = self.engine.scripts.pop(0)
        ids = (tokenizer.encode(text, add_special_tokens=False) + [min(tokenizer.eos_token_ids)])[:request.max_tokens]
        self.running.append([request.handle, ids, False])

    def cancel(self, handle):
        self.ending.add(handle)

    def step(self) -> list:
        events = []
        for entry in list(self.running):
            handle, ids, admitted = entry
            if handle in self.ending or not ids:
                self.running.remove(entry)
                self.ending.discard(handle)
                events.append((handle, "done", None))
                continue
            if not admitted:
                events.append((handle, "admitted", (0, time.perf_counter())))
                entry[2] = True
            tokens, entry[1] = ids[: self.per_round], ids[self.per_round :]
            events.append((handle, "round", Round(tokens, drafted=len(tokens) - 1, accepted=len(tokens) - 1)))
        return events


class ScriptedEngine(Engine):
    """The engine, answering each request with the next of `scripts` (set by the test) instead of decoding."""

    def __init__(self, *args, **kwargs):
        self.scripts, self.prompt_texts = [], []
        super().__init__(*args, **kwargs)

    def _new_scheduler(self) -> ScriptedScheduler:
        scheduler = ScriptedScheduler(self)
        self.batch_stats = scheduler.stats
        return scheduler


def pair_with_context(tokenizer, context: int, seed: int = 11):
    """(target, drafter, tokenizer): conftest's tiny random llama (seed `seed`) with a context of `context`
    tokens (max_position_embeddings), and an untrained block-8 drafter for it."""
    from conftest import tiny_llama

    model = tiny_llama(seed)
    model.args.max_position_embeddings = context
    target = Target(model)
    config = drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2)
    return target, init_drafter(config, seed=0).bind(target), tokenizer
