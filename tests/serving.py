"""A test server: `mlx-dflash serve`'s app for a (target, drafter, tokenizer) pair on a free loopback port, in
a thread, and the official `openai` client pointed at it."""

import contextlib
import socket
import threading
import time

import openai

from mlx_dflash.policy import build_policy
from mlx_dflash.server.app import Engine, ServerConfig, make_app

MODEL = "tiny"  # the model name the test servers answer to


@contextlib.contextmanager
def running(pair, max_queue=16, prompt_cache=None, **config):
    """A server for `pair` (target, drafter, tokenizer) on a free loopback port: yields (base url, engine);
    stops both after. prompt_cache: the engine's PromptCache keywords (None: no prefix cache)."""
    import uvicorn

    target, drafter, tokenizer = pair
    engine = Engine(lambda: (target, drafter, tokenizer, build_policy(target, drafter)), max_queue=max_queue,
                    prompt_cache=prompt_cache)
    app = make_app(engine, ServerConfig(MODEL, **config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.time() + 20
        while not server.started:
            assert thread.is_alive() and time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        engine.close()
        sock.close()
        assert not thread.is_alive()


def client(url, key="unused", timeout=60):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)
