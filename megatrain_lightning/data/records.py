"""Fine-tuning records from local JSON / JSONL files, in the formats fine-tuners bring, as conversations.

Every format becomes one shape, a conversation: a list of ``{"role", "content"}`` messages with roles
``system``, ``user`` and ``assistant``, so that one renderer (``data/chat.py``) handles them all.

| format     | a record                                                      | becomes                           |
| ---------- | ------------------------------------------------------------- | --------------------------------- |
| `metamath` | ``{"query": q, "response": r}`` (MetaMathQA; keys settable)   | user q, assistant r               |
| `alpaca`   | ``{"instruction": i, "input": x, "output": o}`` (input optional) | user ``i\\n\\nx``, assistant o    |
| `messages` | ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI) | the messages, multi-turn          |
| `sharegpt` | ``{"conversations": [{"from": "human"/"gpt"/"system", "value": ...}]}`` | the same, roles renamed  |

``format="auto"`` picks the format by the first record's keys; every record must then have them. Bad
input (a line that is not JSON, a record of no known format, an unknown role, a conversation without an
assistant turn) is a ConfigError naming the file and line and what to change.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from megatrain_lightning.errors import ConfigError

log = logging.getLogger(__name__)

Conversation = list[dict[str, str]]

FORMATS = {
    "metamath": "metamath (query, response: MetaMathQA; other names via data.query_key / data.response_key)",
    "alpaca": "alpaca (instruction, input, output)",
    "messages": "messages (messages: [{role, content}], OpenAI chat)",
    "sharegpt": "sharegpt (conversations: [{from, value}])",
}
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def read_records(path: str) -> list[tuple[int, Any]]:
    """(line number, parsed value) of each record of a JSON Lines file or a JSON array file."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a leading byte-order mark (Windows editors) is not text
            text = f.read()
    except UnicodeDecodeError as err:
        with open(path, "rb") as fb:
            line = fb.read(err.start).count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text ({err.reason} at byte {err.start}): save the file as UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8)"
        ) from None
    decoder = json.JSONDecoder()
    start = len(text) - len(text.lstrip())
    records: list[tuple[int, Any]] = []
    try:
        if text.startswith("[", start):  # one JSON array: walk it so every record keeps its line number
            pos = start + 1
            while True:
                while pos < len(text) and text[pos] in " \t\r\n,":
                    pos += 1
                if pos >= len(text):
                    raise json.JSONDecodeError("unterminated array (no closing ']')", text, pos)
                if text[pos] == "]":
                    break
                value, end = decoder.raw_decode(text, pos)
                records.append((_line_of(text, pos), value))
                pos = end
            after = text[pos + 1:]
            if after.strip():  # more after the array: two arrays, junk, or JSON Lines of arrays
                rest = len(text) - len(after.lstrip())
                raise ConfigError(
                    f"{path}:{_line_of(text, rest)}: more text after the JSON array that closed on line "
                    f"{_line_of(text, pos)}: a .json file holds one array of objects, a .jsonl file one object "
                    "per line (not one array per line)"
                )
        else:
            for number, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    records.append((number, json.loads(line)))
    except json.JSONDecodeError as err:
        line = err.lineno if text.startswith("[", start) else number
        raise ConfigError(
            f"{path}:{line}: not valid JSON ({err.msg}, column {err.colno}): fix or remove that line "
            "(JSON Lines: one object per line; or one JSON array of objects)"
        ) from None
    if not records:
        raise ConfigError(f"{path} holds no records (expected one JSON object per line, or a JSON array of objects)")
    return records


def has_format(record: Any, fmt: str, query_key: str = "query", response_key: str = "response") -> bool:
    """Whether a record has the fields of format ``fmt``."""
    if not isinstance(record, dict):
        return False
    return {
        "messages": lambda: isinstance(record.get("messages"), list),
        "sharegpt": lambda: isinstance(record.get("conversations"), list),
        "alpaca": lambda: "instruction" in record and "output" in record,
        "metamath": lambda: query_key in record and response_key in record,
    }[fmt]()


def detect_format(record: Any, query_key: str = "query", response_key: str = "response") -> str | None:
    """The format a record is in (the first of FORMATS' order, most specific first), None if none."""
    for fmt in ("messages", "sharegpt", "alpaca", "metamath"):
        if has_format(record, fmt, query_key, response_key):
            return fmt
    return None


def _unknown(where: str, record: Any, query_key: str, response_key: str, wanted: str | None) -> ConfigError:
    found = f"keys [{', '.join(map(str, record))}]" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
    if wanted is not None:
        return ConfigError(
            f"{where}: a record with {found} is not in the {FORMATS[wanted]} format that data.format "
            f"(or the file's first record) chose: every record of a file must have the same format"
        )
    return ConfigError(
        f"{where}: a record with {found} matches none of the data formats: {'; '.join(FORMATS.values())}. "
        f"Set data.query_key and data.response_key to this file's question and answer fields "
        f"(now {query_key!r}, {response_key!r}), or convert the file"
    )


def _text(where: str, value: Any, what: str) -> str:
    """A field's text: a string or number as it reads, OpenAI content parts (``[{"type": "text", "text": ...}]``)
    joined by newlines; anything else (null, an image part, an object) refused by name."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list) and value:
        kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in value]
        if all(k == "text" and isinstance(p.get("text"), str) for k, p in zip(kinds, value)):
            return "\n".join(p["text"] for p in value)
        raise ConfigError(
            f"{where}: {what} holds content parts of types {sorted(set(map(str, kinds)))}; only text parts "
            "({\"type\": \"text\", \"text\": ...}) are read: drop the other parts or the record"
        )
    shown = "null" if value is None else f"a JSON {type(value).__name__}"
    raise ConfigError(f"{where}: {what} is {shown}, not text: give it a string or drop the record")


def _turns(where: str, turns: list[Any], role_key: str, content_key: str) -> Conversation:
    out: Conversation = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            found = f" (it has keys [{', '.join(map(str, turn))}])" if isinstance(turn, dict) else ""
            raise ConfigError(f"{where}: turn {i} is not an object with '{role_key}' and '{content_key}'{found}")
        role = ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise ConfigError(
                f"{where}: turn {i} has {role_key}={turn[role_key]!r}; the roles understood are "
                f"{', '.join(sorted(ROLES))} (other roles, e.g. tool calls, are not supported: drop those turns)"
            )
        out.append({"role": role, "content": _text(where, turn[content_key], f"turn {i}'s {content_key!r}")})
    return out


def to_conversation(record: Any, fmt: str, where: str, query_key: str = "query", response_key: str = "response") -> Conversation:
    """One record (in format ``fmt``) as a conversation; ``where`` (``file:line``) names it in errors."""
    if not has_format(record, fmt, query_key, response_key):
        raise _unknown(where, record, query_key, response_key, fmt)
    if fmt == "metamath":
        conv = [{"role": "user", "content": _text(where, record[query_key], repr(query_key))},
                {"role": "assistant", "content": _text(where, record[response_key], repr(response_key))}]
    elif fmt == "alpaca":
        extra = _text(where, record.get("input") or "", "'input'")
        prompt = _text(where, record["instruction"], "'instruction'") + (f"\n\n{extra}" if extra.strip() else "")
        conv = [{"role": "user", "content": prompt},
                {"role": "assistant", "content": _text(where, record["output"], "'output'")}]
        if record.get("system"):
            conv.insert(0, {"role": "system", "content": _text(where, record["system"], "'system'")})
    elif fmt == "messages":
        conv = _turns(where, record["messages"], "role", "content")
    else:
        conv = _turns(where, record["conversations"], "from", "value")
    if not any(m["role"] == "assistant" for m in conv):
        raise ConfigError(f"{where}: the conversation has no assistant turn, so nothing to learn: drop the record")
    return conv


def load_conversations(path: str, fmt: str = "auto", query_key: str = "query",
                       response_key: str = "response") -> list[tuple[str, Conversation]]:
    """Every record of ``path`` as (``file:line``, conversation), in format ``fmt`` (``auto``: by the first
    record's keys)."""
    if fmt != "auto" and fmt not in FORMATS:
        raise ConfigError(f"data.format={fmt}: expected auto or one of {', '.join(FORMATS)}")
    records = read_records(path)
    if fmt == "auto":
        line, first = records[0]
        fmt = detect_format(first, query_key, response_key) or ""
        if not fmt:
            raise _unknown(f"{path}:{line}", first, query_key, response_key, None)
    convs = [(f"{path}:{line}", to_conversation(r, fmt, f"{path}:{line}", query_key, response_key)) for line, r in records]
    empty = [where for where, conv in convs
             if not any(m["content"].strip() for m in conv if m["role"] == "assistant")]
    if empty:
        log.warning("%d of %d records have only empty answers (first: %s): they teach the model to stop at once; "
                    "drop them if that is not meant", len(empty), len(convs), empty[0])
    return convs
