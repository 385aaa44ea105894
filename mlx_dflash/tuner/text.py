"""Training sequences from text that already exists: a dataset's reference answers, chats, source code.

A drafter learns the target's own choices over this text (`TrainConfig.labels = "target"`): one target
forward over the text gives both the features the drafter reads and, at every position, the token the
target would choose there. The data then costs a forward per token instead of a generation.

Each source becomes (token ids, index where supervision starts) sequences, the shape `iter_sequences`
gives for the target's answers:
- a .jsonl/.json file of records holding a prompt and its reference answer (GSM8K `question`/`answer`,
  HumanEval `prompt`/`canonical_solution`, ShareGPT `conversations` with a human and a gpt turn):
  the prompt through the chat template, the answer as the assistant's turn;
- a text or source file, or a directory of them (the Python standard library, say): plain text, no
  template, in chunks of `chunk_tokens`, supervised throughout.
"""

from pathlib import Path
from typing import Iterator

from ..errors import DFlashError
from ..decoding.prompt import encode_prompt
from .data import prompt_of, read_records

# Fields that hold a record's reference answer, in the sources we know.
_ANSWER_FIELDS = ("answer", "response", "output", "completion", "canonical_solution")
# Plain text files a directory source contributes.
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


def _answer_of(record: dict):
    for key in _ANSWER_FIELDS:
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key]
    conversations = record.get("conversations") or record.get("messages")
    if isinstance(conversations, list):  # ShareGPT / chat: the first reply after the first human turn
        seen_human = False
        for turn in filter(lambda t: isinstance(t, dict), conversations):
            role = turn.get("from", turn.get("role"))
            seen_human = seen_human or role in ("human", "user")
            if seen_human and role in ("gpt", "assistant"):
                reply = turn.get("value", turn.get("content"))
                return reply if isinstance(reply, str) else None
    return None


def record_sequences(tokenizer, records: list, where: str) -> Iterator[tuple]:
    """(prompt ids + answer ids, answer start) per record that holds a prompt and an answer."""
    found = 0
    for _, record in records:
        prompt, answer = (prompt_of(record), _answer_of(record)) if isinstance(record, dict) else (None, None)
        if not isinstance(prompt, str) or answer is None:
            continue
        prompt_ids = encode_prompt(tokenizer, prompt, chat_template=None)
        answer_ids = list(tokenizer.encode(answer, add_special_tokens=False))
        if len(answer_ids) >= 2:
            found += 1
            yield prompt_ids + answer_ids, len(prompt_ids)
    if not found:
        raise DFlashError(f"{where} holds no record with both a prompt and an answer (answer fields: "
                          f"{', '.join(_ANSWER_FIELDS)}, or a conversation with a reply)")


def plain_sequences(tokenizer, files: list, chunk_tokens: int) -> Iterator[tuple]:
    """Each file's text, tokenized, in chunks of chunk_tokens (the last one kept if 2+ tokens)."""
    for path in files:
        ids = list(tokenizer.encode(_read_text(path), add_special_tokens=False))
        for start in range(0, len(ids), chunk_tokens):
            chunk = ids[start : start + chunk_tokens]
            if len(chunk) >= 2:
                yield chunk, 0


def text_sequences(tokenizer, source, chunk_tokens: int = 512) -> list:
    """Training sequences of one text source: a records file (or a prompt set's name), a text file, or a
    directory of them."""
    from ..downloads import PROMPT_SETS, ensure_prompt_set

    path = Path(source)
    if source in PROMPT_SETS and not path.exists():
        path = ensure_prompt_set(source)
    if not path.exists():
        raise DFlashError(f"--text {source}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise DFlashError(f"--text {source}: the directory holds no {'/'.join(TEXT_SUFFIXES)} files")
        return list(plain_sequences(tokenizer, files, chunk_tokens))
    if path.suffix in (".jsonl", ".json"):
        return list(record_sequences(tokenizer, read_records(path), f"--text {source}"))
    if path.suffix not in TEXT_SUFFIXES:
        raise DFlashError(f"--text {source}: not a file kind it reads (.jsonl/.json records, or "
                          f"{'/'.join(TEXT_SUFFIXES)} text); decompress or convert it first")
    return list(plain_sequences(tokenizer, [path], chunk_tokens))


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"--text: cannot read {path} as UTF-8 text ({e})") from None
