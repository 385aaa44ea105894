"""A served request's prompt: its token ids through the chat template (tools, thinking, a forced call's opening),
where its chat messages end (for a hybrid target's prefix cache), and its length against the context, before
and after it is tokenized."""

from functools import cached_property

from ..decoding.prompt import ContextFull, check_context, encode_prompt
from .protocol import APIError, GenerationRequest, PromptTooLong
from .tools import forced_prefix, generic_tools_messages

MARKED_MESSAGES = 4  # chat messages, counted from the end, whose ends are kept for a hybrid target
COMPOSED_CHARACTERS = 4  # a tokenizer's normalizer may compose this many characters into one (NFC: ᾇ)


class PromptSurelyTooLong(PromptTooLong):
    """A prompt whose text alone is over the context, refused before it is tokenized (prompt_tokens: at least)."""

    def __init__(self, at_least: int, characters: int, context: int, param: str):
        super().__init__(at_least, context, param)
        self.message = (f"the prompt is at least {at_least} tokens ({characters} characters of text) and this "
                        f"model's context is {context} tokens: shorten the {param}")


class Prompts:
    """What a request's prompt is before it queues: its token ids, and the checks of its length against the
    context. Runs on the tokenizer threads, beside the engine (server/engine.py), with the engine's tokenizer,
    target, tool support and prefix cache."""

    def __init__(self, tokenizer, target, tools, prompt_cache=None):
        self.tokenizer, self.target, self.tools, self.prompt_cache = tokenizer, target, tools, prompt_cache
        untruncated(tokenizer)

    @cached_property
    def chars_per_token(self) -> int:
        """The most characters one token can stand for (`refuse_surely_too_long`)."""
        return longest_token(self.tokenizer) * COMPOSED_CHARACTERS

    def chat_input(self, req: GenerationRequest) -> tuple:
        """A chat request's messages and chat template options: its tools as the template takes them, or in the
        generic form of tools.py where it renders none; enable_thinking where the request sets it."""
        messages, options = req.prompt, {}
        if req.tools and self.tools.renders_tools:
            options["tools"] = req.tools
        elif req.tools:
            messages = generic_tools_messages(messages, req.tools)
        if req.thinking is not None:  # a template without a thinking switch ignores it
            options["enable_thinking"] = req.thinking
        return messages, options

    def prompt_ids(self, req: GenerationRequest) -> list:
        """The prompt's token ids: chat messages (and tools; in the generic form of tools.py where the template
        renders none) through the tokenizer's chat template, a forced tool call's opening (tools.forced_prefix)
        after its text; text as it is. Touches no MLX array: it runs on a worker thread, off the event
        loop and beside the engine."""
        tok = self.tokenizer
        if req.kind == "chat":
            if getattr(tok, "chat_template", None) is None:
                raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")
            turn = (dict(add_generation_prompt=False, continue_final_message=True) if req.continue_final
                    else dict(add_generation_prompt=True))
            messages, options = self.chat_input(req)
            forced = req.force_tool is not None
            try:
                rendered = tok.apply_chat_template(messages, **turn, **options, tokenize=not forced)
            except Exception as e:  # the template's own checks (roles, order) raise its own types
                raise APIError(400, f"the chat template refused these messages: {e}"[:500], param="messages") from None
            if not forced:
                return list(rendered)
            # The opening is encoded with the prompt's text, as the template's own tokenizing encodes it (no
            # special tokens added): alone, a SentencePiece tokenizer would start it with a "▁" token.
            return list(tok.encode(rendered + forced_prefix(self.tools, req.force_tool), add_special_tokens=False))
        if isinstance(req.prompt, str):
            ids = encode_prompt(tok, req.prompt)
        else:
            ids, vocab = req.prompt, self.target.vocab_size
            if max(ids) >= vocab:
                raise APIError(400, f"'prompt' holds token id {max(ids)}; this model's vocabulary has {vocab}",
                               param="prompt")
        if not ids:
            raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
        return ids

    def message_boundaries(self, req: GenerationRequest, ids: list) -> list:
        """Where the last few chat messages end in `ids`, when the prefix cache keeps a hybrid target's state
        only at chosen positions (a trimmable state serves every prefix: nothing to mark)."""
        if req.kind != "chat" or self.prompt_cache is None or self.prompt_cache.trimmable:
            return []
        messages, options = self.chat_input(req)  # as the prompt was rendered: tools and all
        marks = []
        for n in range(max(1, len(messages) - MARKED_MESSAGES), len(messages)):
            try:
                head = list(self.tokenizer.apply_chat_template(messages[:n], add_generation_prompt=True, **options))
            except Exception:  # a template that refuses a partial conversation: no mark there
                continue
            marks.append(next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids))))
        return marks

    def refuse_surely_too_long(self, req: GenerationRequest):
        """Refuse, before it is tokenized, a prompt whose length alone puts it over the context: token ids by
        their count; text (a completion's prompt, the chat messages' but the assistant's, which a template
        may leave out) by its characters over the most that one token can stand for. Tokenizing 4 MB of
        text takes seconds of a tokenizer thread that other requests wait for."""
        context = self.target.context_length
        if context is None:
            return
        if req.kind == "text" and not isinstance(req.prompt, str):
            if len(req.prompt) >= context:
                raise PromptTooLong(len(req.prompt), context, "prompt")
            return
        texts = [req.prompt] if req.kind == "text" else [m["content"] for m in req.prompt if m["role"] != "assistant"]
        characters = sum(len(t) for t in texts if isinstance(t, str))
        at_least = -(-characters // self.chars_per_token)
        if at_least >= context:
            raise PromptSurelyTooLong(at_least, characters, context, "messages" if req.kind == "chat" else "prompt")

    def fit(self, req: GenerationRequest, prompt_tokens: int, limit: int):
        """Refuse a prompt that leaves no room in the context; cut max_tokens to `limit` and to what fits (the
        context rule of decoding/prompt.py, once a request: the engine takes max_tokens as it is)."""
        try:
            req.max_tokens = check_context(self.target, prompt_tokens, min(req.max_tokens, limit))
        except ContextFull as e:
            raise PromptTooLong(e.prompt_tokens, e.context, "messages" if req.kind == "chat" else "prompt") from None


def longest_token(tokenizer) -> int:
    """The most characters one token of the vocabulary is written with (a byte-level vocabulary writes a byte
    as a character, so this bounds the bytes of text a token stands for, and so its characters)."""
    return max(len(piece) for piece in tokenizer.vocab)


def untruncated(tokenizer) -> None:
    """Clear the truncation and padding a tokenizer.json may set on the Rust tokenizer (transformers' fast
    tokenizer, behind mlx-lm's wrapper). transformers clears them on each call that finds them set, and a
    change while another thread tokenizes with it fails ("Already borrowed"): the tokenizer threads share
    one tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is not None:
        backend.no_truncation()
    if backend is not None and backend.padding is not None:
        backend.no_padding()
