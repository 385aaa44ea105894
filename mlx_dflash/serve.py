"""`mlx-dflash serve`: the command that starts the OpenAI- and Anthropic-compatible server (`server/`) over one
pair."""

import sys
from pathlib import Path

import click

from .errors import DFlashError
from .options import kv_options, pair_options, sampling_options, shard_options, width_options
from .policies.dcut import build_policy
from .policies.verify_costs import read_cost_table


@click.command("serve")
@pair_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the server (then consider --api-key and --allowed-hosts).")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--model-name", default=None, help="The model id clients send (default: the target directory's name).")
@click.option("--api-key", "api_key", multiple=True, envvar="MLX_DFLASH_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health "
                   "(env MLX_DFLASH_API_KEY). Repeat it, or separate keys by commas, for several: each key's "
                   "clients then get prefix-cache hits only from their own key's requests.")
@click.option("--allowed-hosts", default="", show_default=False,
              help="Comma-separated Host names to answer besides the loopback ones (* for any); bound to a "
                   "non-loopback --host without it, any Host is answered.")
@click.option("--allowed-origins", default="",
              help="Comma-separated web origins (e.g. http://localhost:3000, or *) whose pages may call the "
                   "server (CORS); others are refused.")
@click.option("--max-queue", default=16, show_default=True, type=int,
              help="Requests that may wait beyond the batch's --max-batch rows (with --max-batch 1: behind the running "
                   "one); more get 503 with Retry-After.")
@click.option("--max-connections", default=128, show_default=True, type=int,
              help="Open connections at most; one more is answered 503 and closed. Request bodies in flight from "
                   "all client addresses together: half of it.")
@click.option("--max-uploads-per-client", default=None, type=int,
              help="Request bodies one client address may be sending at once (default: a quarter of "
                   "--max-connections); past it a new one replaces one in flight for over a second, else gets 429.")
@click.option("--max-body", "max_body_bytes", default=4 << 20, show_default=True, type=int,
              help="Largest request body in bytes (413 above it).")
@click.option("--max-kept-bytes", default=64 << 20, show_default=True, type=int,
              help="Bytes of kept Responses (store, for previous_response_id and GET) per API key, as JSON; 4x "
                   "that across keys; the least recently used dropped first, a bigger response answered, not kept.")
@click.option("--header-timeout", default=10.0, show_default=True, type=float,
              help="Seconds a connection has to send a whole request head.")
@click.option("--body-timeout", default=30.0, show_default=True, type=float,
              help="Seconds a request has to send its whole body (408 after).")
@click.option("--max-tokens", default=256, show_default=True, type=int, help="Default for requests without max_tokens.")
@click.option("--max-tokens-limit", default=8192, show_default=True, type=int,
              help="The most tokens one request may generate: larger max_tokens are cut to it (and to what the "
                   "context leaves).")
@click.option("--prefill-step-size", default=None, type=int,
              help="Prompt tokens per prefill chunk (chunks take turns with decoding rounds); a client that leaves "
                   "stops its prefill within a chunk. Default: 512 with Metal, 128 on the CPU (its attention "
                   "reads small chunks fastest).")
@click.option("--shutdown-grace", default=10.0, show_default=True, type=float,
              help="On Ctrl-C or SIGTERM: seconds the running requests (every row of the batch) may go on before they "
                   "end with an error.")
@click.option("--max-batch", default=None, type=int,
              help="Requests decoded together (continuous batching; 1: one at a time). Default: 8 with Metal, 4 on "
                   "the CPU.")
@click.option("--no-generic-tools", is_flag=True,
              help="Refuse tools (400) where the target's chat template does not render them, instead of putting "
                   "them in the system prompt in the generic <tool_call> JSON form.")
@sampling_options
@width_options
@click.option("--prompt-cache-size", default=10, show_default=True, type=int,
              help="Conversation states the prefix cache keeps (least recently used go first); 0 turns it off.")
@click.option("--prompt-cache-bytes", default=None, type=int,
              help="Most bytes the kept states may take (default: a quarter of this machine's memory).")
@click.option("--prompt-cache-dir", default=None, type=click.Path(file_okay=False),
              help="Also keep the states on disk here, so a restart keeps them (one file each, naming its pair).")
@kv_options
@shard_options
def main(pair, host, port, model_name, api_key, allowed_hosts, allowed_origins, max_queue,
         max_connections, max_uploads_per_client, max_body_bytes, max_kept_bytes, header_timeout, body_timeout,
         max_tokens, max_tokens_limit, prefill_step_size, shutdown_grace, max_batch, sampling, widths,
         prompt_cache_size, prompt_cache_bytes, prompt_cache_dir, kv, shard, no_generic_tools):
    """Serve the pair over OpenAI- and Anthropic-compatible HTTP APIs (/v1/chat/completions, /v1/completions,
    /v1/responses, /v1/messages).

    --max-tokens and the sampling flags are the defaults of requests that leave those fields out. The verify
    width defaults to --width auto (D-cut, as in generate: one width for the whole batch each round).
    With --shard (under mlx.launch) only rank 0 listens; the other ranks follow its requests."""
    from .decoding.engine_report import announce
    from .distributed import Ranks, launched_group
    from .downloads import default_target, shipped_drafter_dir
    from .machine import metal_available, slow_blas_warning
    from .pitfalls import pair_warnings
    from .server.routes import ServerConfig, bind
    from .server.protocol import Defaults
    from .server.routes import run_server
    from .server.security import allowed_hosts as hosts_for
    from .server.security import api_keys

    chunk = 1 if prefill_step_size is None else prefill_step_size  # None: the scheduler takes the machine's
    if min(max_tokens, max_tokens_limit, max_body_bytes, max_connections, chunk) < 1 or max_queue < 0:
        raise DFlashError("--max-tokens, --max-tokens-limit, --max-body, --max-connections and --prefill-step-size "
                          "must be at least 1, --max-queue at least 0")
    if max_kept_bytes < 0:
        raise DFlashError(f"--max-kept-bytes must be at least 0, got {max_kept_bytes}")
    if max_uploads_per_client is not None and max_uploads_per_client < 1:
        raise DFlashError(f"--max-uploads-per-client must be at least 1, got {max_uploads_per_client}")
    if not min(header_timeout, body_timeout) > 0 or not shutdown_grace >= 0:
        raise DFlashError("--header-timeout and --body-timeout must be positive seconds, --shutdown-grace at least 0")
    if not 0 <= port <= 65535:
        raise DFlashError(f"--port must be from 0 to 65535 (0: any free port), got {port}")
    keys = api_keys(api_key)
    if prompt_cache_size < 0 or (prompt_cache_bytes is not None and prompt_cache_bytes < 1):
        raise DFlashError("--prompt-cache-size must be at least 0 (0 turns the cache off), --prompt-cache-bytes "
                          "at least 1")
    if max_batch is not None and max_batch < 1:
        raise DFlashError(f"--max-batch must be at least 1, got {max_batch}")
    launch_notes = []  # said once the pair has loaded, so a refused pair's error stands alone
    max_batch = max_batch or (8 if metal_available() else 4)
    widths = widths.with_default()
    if widths.cost_table:  # read before anything loads, so a bad table is the only line
        read_cost_table(widths.cost_table)
    if blas := slow_blas_warning():
        launch_notes.append(blas)
    rank = 0
    if shard:
        rank = launched_group("serve").rank()
    sock = bind(host, port) if rank == 0 else None  # only rank 0 listens
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
        follow(*load_models(), max_batch, prefill_step_size)
        return
    config = ServerConfig(model_name or Path(target_path).name, Defaults(max_tokens, sampling), api_keys=keys,
                          drafter_name=Path(pair.drafter_path or shipped_drafter_dir()).name,
                          max_body_bytes=max_body_bytes, max_kept_bytes=max_kept_bytes,
                          max_tokens_limit=max_tokens_limit,
                          max_connections=max_connections, max_uploads_per_client=max_uploads_per_client,
                          header_timeout=header_timeout, body_timeout=body_timeout,
                          shutdown_grace=shutdown_grace, allowed_hosts=hosts_for(host, _names(allowed_hosts)),
                          allowed_origins=set(_names(allowed_origins)), generic_tools=not no_generic_tools)
    if shard:
        from .server.sharded import ShardedEngine as Engine
    else:
        from .server.engine import Engine
    prompt_cache = None
    if prompt_cache_size and not shard:
        prompt_cache = dict(max_entries=prompt_cache_size, max_bytes=prompt_cache_bytes, directory=prompt_cache_dir)
    elif prompt_cache_size:
        launch_notes.append("note: --shard: the prefix cache is off (each rank would keep its own shard's states)")
    engine = Engine(load_models, max_queue, prefill_step_size, prompt_cache, max_batch)  # a load error ends here
    try:
        run_server(engine, config, sock)
    except DFlashError as e:  # a sharded server lost a rank
        click.echo(f"error: {e}", err=True)
        _leave(1)
    _leave(0)


def _names(flag: str) -> tuple:
    return tuple(n.strip() for n in flag.split(",") if n.strip())


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
