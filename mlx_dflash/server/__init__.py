"""`mlx-dflash serve`: an OpenAI- and Anthropic-compatible HTTP server over one target + drafter pair.

A Starlette app on uvicorn. One engine thread owns the models and decodes up to --max-batch requests together
(engine.py); a bounded queue feeds it and answers 503 when full. Each request is a `Job` (jobs.py): the engine
pushes its text to the request's asyncio queue round by round, and checks the job's cancel flag at every step, so
a client that goes away (streamed or not) stops its generation within a round, or a chunk of its prompt.

The routes, the settings and the uvicorn server are routes.py; a request's prompt prompts.py; the wire formats
protocol.py (OpenAI chat and completions), openai_responses.py (Responses) and anthropic.py (Messages); tool calls
in replies tools.py; what the network may send limits.py; who may send it security.py; the log logs.py. A sharded
target (`--shard`, rank 0's engine and the other ranks' loop) is sharded.py. A thinking model's reasoning is cut
from its answer by thinking.py.
"""
