"""`mlx-dflash serve`: the command that starts the OpenAI- and Anthropic-compatible server (`server/`) over one
pair."""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import click

from .errors import DFlashError
from .options import grouped, kv_options, pair_options, sampling_options, shard_options, width_options
from .policies.dcut import build_policy
from .policies.verify_costs import read_cost_table
from .server.limits import Limits
from .server.security import Access


@dataclass(frozen=True)
class Listen:
    """--host and --port, and who may call the server there (security.py `Access`)."""

    host: str
    port: int
    access: Access

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise DFlashError(f"--port must be from 0 to 65535 (0: any free port), got {self.port}")


@dataclass(frozen=True)
class Batching:
    """--max-batch, --max-queue and --prefill-step-size: how the engine takes requests (server/engine.py)."""

    max_batch: Optional[int] = None  # None: the machine's (8 with Metal, 4 on the CPU)
    max_queue: int = 16
    prefill_step_size: Optional[int] = None  # None: the scheduler takes the machine's

    def __post_init__(self):
        for flag, value in {"--max-batch": self.max_batch, "--prefill-step-size": self.prefill_step_size}.items():
            if value is not None and value < 1:
                raise DFlashError(f"{flag} must be at least 1, got {value}")
        if self.max_queue < 0:
            raise DFlashError(f"--max-queue must be at least 0, got {self.max_queue}")

    @property
    def rows(self) -> int:
        from .machine import metal_available

        return self.max_batch or (8 if metal_available() else 4)


@dataclass(frozen=True)
class PromptCacheOptions:
    """--prompt-cache-size, --prompt-cache-bytes and --prompt-cache-dir (decoding/prompt_cache.py)."""

    size: int = 10  # 0: off
    max_bytes: Optional[int] = None
    directory: Optional[str] = None

    def __post_init__(self):
        if self.size < 0 or (self.max_bytes is not None and self.max_bytes < 1):
            raise DFlashError("--prompt-cache-size must be at least 0 (0 turns the cache off), --prompt-cache-bytes "
                              "at least 1")

    def keywords(self) -> Optional[dict]:
        """The PromptCache's keywords, or None where the cache is off."""
        return dict(max_entries=self.size, max_bytes=self.max_bytes, directory=self.directory) if self.size else None


listen_options = grouped(
    "listen", lambda host, port, api_key, allowed_hosts, allowed_origins: Listen(
        host, port, Access.from_flags(host, api_key, allowed_hosts, allowed_origins)),
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address to bind; 0.0.0.0 exposes the server (then consider --api-key and --allowed-hosts)."),
    click.option("--port", default=8080, show_default=True, type=int),
    click.option("--api-key", "api_key", multiple=True, envvar="MLX_DFLASH_API_KEY",
                 help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health "
                      "(env MLX_DFLASH_API_KEY). Repeat it, or separate keys by commas, for several: each key's "
                      "clients then get prefix-cache hits only from their own key's requests."),
    click.option("--allowed-hosts", default="", show_default=False,
                 help="Comma-separated Host names to answer besides the loopback ones (* for any); bound to a "
                      "non-loopback --host without it, any Host is answered."),
    click.option("--allowed-origins", default="",
                 help="Comma-separated web origins (e.g. http://localhost:3000, or *) whose pages may call the "
                      "server (CORS); others are refused."),
)
limit_options = grouped(
    "limits", Limits,
    click.option("--max-connections", default=128, show_default=True, type=int,
                 help="Open connections at most; one more is answered 503 and closed. Request bodies in flight from "
                      "all client addresses together: half of it."),
    click.option("--max-uploads-per-client", default=None, type=int,
                 help="Request bodies one client address may be sending at once (default: a quarter of "
                      "--max-connections); past it a new one replaces one in flight for over a second, else gets "
                      "429."),
    click.option("--max-body", "max_body_bytes", default=4 << 20, show_default=True, type=int,
                 help="Largest request body in bytes (413 above it)."),
    click.option("--max-kept-bytes", default=64 << 20, show_default=True, type=int,
                 help="Bytes of kept Responses (store, for previous_response_id and GET) per API key, as JSON; 4x "
                      "that across keys; the least recently used dropped first, a bigger response answered, not "
                      "kept."),
    click.option("--header-timeout", default=10.0, show_default=True, type=float,
                 help="Seconds a connection has to send a whole request head."),
    click.option("--body-timeout", default=30.0, show_default=True, type=float,
                 help="Seconds a request has to send its whole body (408 after)."),
    click.option("--max-tokens-limit", default=8192, show_default=True, type=int,
                 help="The most tokens one request may generate: larger max_tokens are cut to it (and to what the "
                      "context leaves)."),
    click.option("--shutdown-grace", default=10.0, show_default=True, type=float,
                 help="On Ctrl-C or SIGTERM: seconds the running requests (every row of the batch) may go on before "
                      "they end with an error."),
)
batching_options = grouped(
    "batching", Batching,
    click.option("--max-batch", default=None, type=int,
                 help="Requests decoded together (continuous batching; 1: one at a time). Default: 8 with Metal, 4 "
                      "on the CPU."),
    click.option("--max-queue", default=16, show_default=True, type=int,
                 help="Requests that may wait beyond the batch's --max-batch rows (with --max-batch 1: behind the "
                      "running one); more get 503 with Retry-After."),
    click.option("--prefill-step-size", default=None, type=int,
                 help="Prompt tokens per prefill chunk (chunks take turns with decoding rounds); a client that leaves "
                      "stops its prefill within a chunk. Default: 512 with Metal, 128 on the CPU (its attention "
                      "reads small chunks fastest)."),
)
prompt_cache_options = grouped(
    "prompt_cache", lambda prompt_cache_size, prompt_cache_bytes, prompt_cache_dir: PromptCacheOptions(
        prompt_cache_size, prompt_cache_bytes, prompt_cache_dir),
    click.option("--prompt-cache-size", default=10, show_default=True, type=int,
                 help="Conversation states the prefix cache keeps (least recently used go first); 0 turns it off."),
    click.option("--prompt-cache-bytes", default=None, type=int,
                 help="Most bytes the kept states may take (default: a quarter of this machine's memory)."),
    click.option("--prompt-cache-dir", default=None, type=click.Path(file_okay=False),
                 help="Also keep the states on disk here, so a restart keeps them (one file each, naming its pair)."),
)


@click.command("serve")
@pair_options
@listen_options
@click.option("--model-name", default=None, help="The model id clients send (default: the target directory's name).")
@limit_options
@click.option("--max-tokens", default=256, show_default=True, type=int, help="Default for requests without max_tokens.")
@batching_options
@click.option("--no-generic-tools", is_flag=True,
              help="Refuse tools (400) where the target's chat template does not render them, instead of putting "
                   "them in the system prompt in the generic <tool_call> JSON form.")
@sampling_options
@width_options
@prompt_cache_options
@kv_options
@shard_options
def main(pair, listen, model_name, limits, max_tokens, batching, no_generic_tools, sampling, widths, prompt_cache,
         kv, shard):
    """Serve the pair over OpenAI- and Anthropic-compatible HTTP APIs (/v1/chat/completions, /v1/completions,
    /v1/responses, /v1/messages).

    --max-tokens and the sampling flags are the defaults of requests that leave those fields out. The verify
    width defaults to --width auto (D-cut, as in generate: one width for the whole batch each round).
    With --shard (under mlx.launch) only rank 0 listens; the other ranks follow its requests."""
    from .decoding.engine_report import announce
    from .distributed import Ranks, launched_group
    from .downloads import default_target, shipped_drafter_dir
    from .machine import slow_blas_warning
    from .pitfalls import pair_warnings
    from .server.protocol import Defaults
    from .server.routes import ServerConfig, bind, run_server

    if max_tokens < 1:
        raise DFlashError(f"--max-tokens must be at least 1, got {max_tokens}")
    launch_notes = []  # said once the pair has loaded, so a refused pair's error stands alone
    max_batch = batching.rows
    widths = widths.with_default()
    if widths.cost_table:  # read before anything loads, so a bad table is the only line
        read_cost_table(widths.cost_table)
    if blas := slow_blas_warning():
        launch_notes.append(blas)
    rank = 0
    if shard:
        rank = launched_group("serve").rank()
    sock = bind(listen.host, listen.port) if rank == 0 else None  # only rank 0 listens
    target_path = default_target(pair.model_path)

    def load_models():  # on the engine's thread (rank 0), or the main one (the others)
        target, drafter, tokenizer, group = pair.load(kv, shard, "serve")
        policy = build_policy(target, drafter, widths, max_batch)
        policy.notes += pair_warnings(target, drafter, tokenizer)
        for note in policy.notes if rank == 0 else ():
            announce(note)  # once: each request's statistics keep them
        for note in launch_notes if rank == 0 else ():
            click.echo(note, err=True)
        if not shard:
            return target, drafter, tokenizer, policy
        ranks = Ranks(group, policy.block_size, shard.mode == "pipeline", shard.rank_timeout, max_batch)
        return target, drafter, tokenizer, policy, ranks

    if rank != 0:
        import signal

        from .server.sharded import follow

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops rank 0, whose shutdown reaches us
        follow(*load_models(), max_batch, batching.prefill_step_size)
        return
    config = ServerConfig(model_name or Path(target_path).name, Defaults(max_tokens, sampling), limits, listen.access,
                          generic_tools=not no_generic_tools,
                          drafter_name=Path(pair.drafter_path or shipped_drafter_dir()).name)
    if shard:
        from .server.sharded import ShardedEngine as Engine
    else:
        from .server.engine import Engine
    cache = prompt_cache.keywords()
    if cache and shard:
        cache = None
        launch_notes.append("note: --shard: the prefix cache is off (each rank would keep its own shard's states)")
    # a load error ends here
    engine = Engine(load_models, batching.max_queue, batching.prefill_step_size, cache, max_batch)
    try:
        run_server(engine, config, sock)
    except DFlashError as e:  # a sharded server lost a rank
        click.echo(f"error: {e}", err=True)
        _leave(1)
    _leave(0)


def _leave(status: int):
    """End the process now, without the interpreter's teardown: with MLX 0.32.4 that teardown can abort
    ("terminate called without an active exception", about 1 exit in 3 here) once a thread other than the
    main one has run MLX work, as the server's engine thread has."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
