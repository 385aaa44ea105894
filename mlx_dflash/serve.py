"""`mlx-dflash serve`: the command that starts the OpenAI-compatible server (`server/`) over one pair."""

import sys
from pathlib import Path

import click

from .errors import DFlashError
from .options import check_rank_timeout, pair_options, sampling_options, shard_options, width_options
from .policy import build_policy, check_width_options
from .sampling import SamplingParams


@click.command("serve")
@pair_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the server (then consider --api-key and --allowed-hosts).")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--model-name", default=None, help="The model id clients send (default: the target directory's name).")
@click.option("--api-key", default=None, envvar="MLX_DFLASH_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health "
                   "(env MLX_DFLASH_API_KEY).")
@click.option("--allowed-hosts", default="", show_default=False,
              help="Comma-separated Host names to answer besides the loopback ones (* for any); bound to a "
                   "non-loopback --host without it, any Host is answered.")
@click.option("--allowed-origins", default="",
              help="Comma-separated web origins (e.g. http://localhost:3000, or *) whose pages may call the "
                   "server (CORS); others are refused.")
@click.option("--max-queue", default=16, show_default=True, type=int,
              help="Requests that may wait behind the running one; more get 503 with Retry-After.")
@click.option("--max-connections", default=128, show_default=True, type=int,
              help="Open connections at most; one more is answered 503 and closed.")
@click.option("--max-body", "max_body_bytes", default=4 << 20, show_default=True, type=int,
              help="Largest request body in bytes (413 above it).")
@click.option("--header-timeout", default=10.0, show_default=True, type=float,
              help="Seconds a connection has to send a whole request head.")
@click.option("--body-timeout", default=30.0, show_default=True, type=float,
              help="Seconds a request has to send its whole body (408 after).")
@click.option("--max-tokens", default=256, show_default=True, type=int, help="Default for requests without max_tokens.")
@click.option("--max-tokens-limit", default=8192, show_default=True, type=int,
              help="The most tokens one request may generate: larger max_tokens are cut to it (and to what the "
                   "context leaves).")
@click.option("--prefill-step-size", default=512, show_default=True, type=int,
              help="Prompt tokens per prefill chunk; a client that leaves stops its prefill within a chunk.")
@click.option("--shutdown-grace", default=10.0, show_default=True, type=float,
              help="On Ctrl-C or SIGTERM: seconds the running request may go on before it ends with an error.")
@sampling_options
@width_options
@shard_options
def main(model_path, drafter_path, host, port, model_name, api_key, allowed_hosts, allowed_origins, max_queue,
         max_connections, max_body_bytes, header_timeout, body_timeout, max_tokens, max_tokens_limit,
         prefill_step_size, shutdown_grace, temp, top_p, top_k, min_p, width, n_max, force_width, p_min, n_min,
         cost_table, prompt_lookup, shard, rank_timeout):
    """Serve the pair over OpenAI- and Anthropic-compatible HTTP APIs (/v1/chat/completions, /v1/completions,
    /v1/messages).

    --max-tokens and the sampling flags are the defaults of requests that leave those fields out.
    With --shard (under mlx.launch) only rank 0 listens; the other ranks follow its requests."""
    from .distributed import Ranks, launched_group, load_sharded_pair
    from .downloads import default_target, shipped_drafter_dir
    from .server.app import Engine, ServerConfig, bind
    from .server.protocol import Defaults
    from .server.routes import run_server
    from .server.security import allowed_hosts as hosts_for, check_api_key
    from .utils import load

    if min(max_tokens, max_tokens_limit, max_body_bytes, max_connections, prefill_step_size) < 1 or max_queue < 0:
        raise DFlashError("--max-tokens, --max-tokens-limit, --max-body, --max-connections and --prefill-step-size "
                          "must be at least 1, --max-queue at least 0")
    if not min(header_timeout, body_timeout) > 0 or not shutdown_grace >= 0:
        raise DFlashError("--header-timeout and --body-timeout must be positive seconds, --shutdown-grace at least 0")
    check_api_key(api_key)
    sampling = SamplingParams(temp, top_p, top_k, min_p)  # refuse bad defaults before loading anything
    check_width_options(width, n_max, cost_table)
    rank = 0
    if shard:
        check_rank_timeout(rank_timeout)
        rank = launched_group("serve").rank()
    sock = bind(host, port) if rank == 0 else None  # only rank 0 listens
    target_path = default_target(model_path)

    def load_models():  # on the engine's thread (rank 0), or the main one (the others)
        if not shard:
            target, drafter, tokenizer = load(target_path, drafter_path)
        else:
            target, drafter, tokenizer, group = load_sharded_pair(target_path, drafter_path or shipped_drafter_dir(),
                                                                  shard, "serve")
        policy = build_policy(target, drafter, width, n_max, force_width, p_min, n_min, cost_table, prompt_lookup)
        for note in policy.notes if rank == 0 else ():
            click.echo(note, err=True)
        if not shard:
            return target, drafter, tokenizer, policy
        return target, drafter, tokenizer, policy, Ranks(group, policy.block_size, shard == "pipeline", rank_timeout)

    if rank != 0:
        import signal

        from .server.sharded import follow

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops rank 0, whose shutdown reaches us
        follow(*load_models(), prefill_step_size)
        return
    config = ServerConfig(model_name or Path(target_path).name, Defaults(max_tokens, sampling), api_key=api_key,
                          max_body_bytes=max_body_bytes, max_tokens_limit=max_tokens_limit,
                          max_connections=max_connections, header_timeout=header_timeout, body_timeout=body_timeout,
                          shutdown_grace=shutdown_grace, allowed_hosts=hosts_for(host, _names(allowed_hosts)),
                          allowed_origins=set(_names(allowed_origins)))
    if shard:
        from .server.sharded import ShardedEngine as Engine
    engine = Engine(load_models, max_queue, prefill_step_size)  # a load error ends here, in one line
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
