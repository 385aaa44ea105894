"""A prompt as the decoder takes it: token ids (through the chat template where asked) that fit the target's
context."""

from typing import Optional

from ..errors import DFlashError
from ..models.target import Target


def encode_prompt(tokenizer, prompt, chat_template: Optional[bool] = False) -> list:
    """Token ids of a prompt: a string as mlx-lm encodes it (special tokens added unless it already starts
    with the BOS token), or, with chat_template, through the tokenizer's chat template (a string as one
    user message, or a list of messages), as mlx-lm's CLI does. chat_template None: the template when the
    tokenizer has one."""
    if chat_template is None:
        chat_template = getattr(tokenizer, "chat_template", None) is not None
    if chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DFlashError("the target's tokenizer has no chat template; use --no-chat-template")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))


class ContextFull(DFlashError):
    """A prompt that leaves no room in the target's context."""

    def __init__(self, prompt_tokens: int, context: int):
        super().__init__(f"the prompt is {prompt_tokens} tokens and the target's context is {context} "
                         "(max_position_embeddings): shorten the prompt")
        self.prompt_tokens, self.context = prompt_tokens, context


def check_context(target: Target, prompt_tokens: int, max_tokens: int) -> int:
    """The tokens that may be generated: a prompt that fills the target's context is refused before any
    work (`ContextFull`); max_tokens past the context is cut to what fits. The one context rule of every
    entry: `generate`, `batch_generate`, the server (server/prompts.py `Prompts.fit`)."""
    limit = target.context_length
    if limit is None:
        return max_tokens
    if prompt_tokens >= limit:
        raise ContextFull(prompt_tokens, limit)
    return min(max_tokens, limit - prompt_tokens)
