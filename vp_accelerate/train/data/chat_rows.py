"""Chat rows as they come in data files, made into the messages a chat template renders.

Real chat sets carry more than `{"role", "content"}` strings: OpenAI-style content parts
(`[{"type": "text", "text": ...}]`), assistant `tool_calls` (with `content` null), tool results with a
`tool_call_id` or `name`, and keys of their own (`weight`, `reasoning_content`, ...). What is kept follows
the chat template: a key the template reads (as `message.key` or `message['key']`) goes to it; `tool_calls`
the template does not render make the row invalid (training on a conversation whose tool calls vanish
would teach answers to questions never asked); any other key the template ignores is dropped and reported
(`--check` lists them with their row counts, the launch logs them once).
"""

from __future__ import annotations

import re
from functools import lru_cache

import jinja2
from jinja2 import nodes

from .formats import ROLES, FormatError, short


class ChatRowError(FormatError):
    """One conversation cannot be rendered; the caller adds the file and line."""


@lru_cache(maxsize=8)
def template_keys(template: str) -> frozenset[str]:
    """Every attribute / item name the template reads (`m.tool_calls`, `message['name']`): the message keys it
    may render. A template jinja cannot parse here falls back to the names that appear in its text."""
    # HF's `{% generation %}` tag is an extension of transformers' environment; it reads no key
    text = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", template)
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateError:
        return frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", template))
    names = {n.attr for n in ast.find_all(nodes.Getattr)}
    names |= {
        n.arg.value
        for n in ast.find_all(nodes.Getitem)
        if isinstance(n.arg, nodes.Const) and isinstance(n.arg.value, str)
    }
    return frozenset(names)


def _content_text(content, k: int) -> str:
    """A turn's content as one string: a string as is, OpenAI-style text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatRowError(
                    f"turn {k} has a content part of type {kind!r}; only text parts "
                    f"({{'type': 'text', 'text': ...}}) can be trained on"
                )
        return "\n".join(texts)
    raise ChatRowError(f"turn {k} content must be a string or a list of text parts, got {short(content)}")


SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
}
"""ShareGPT's `from` values -> chat roles."""


def sharegpt_turn(m: dict, k: int) -> dict:
    """A ShareGPT turn ({from, value}) as a chat turn ({role, content}); other keys are kept."""
    role = SHAREGPT_ROLES.get(str(m["from"]).lower())
    if role is None:
        raise ChatRowError(
            f"turn {k} has unknown ShareGPT speaker {m['from']!r}; expected one of {', '.join(SHAREGPT_ROLES)}"
        )
    turn = {key: v for key, v in m.items() if key not in ("from", "value")}
    return {"role": role, "content": m.get("value"), **turn}


def normalize(messages, keys: frozenset[str], template_name: str = "the chat template") -> tuple[list[dict], list[str]]:
    """(messages for the template, the keys dropped because the template does not read them).

    `keys`: what the template reads (`template_keys`). Raises ChatRowError for a conversation that cannot be
    trained on: not a list of turns, a turn without a known role, content that is not text, no assistant
    turn, or tool calls the template would not render.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatRowError(f"'messages' must be a non-empty list of turns, got {short(messages)}")
    out, dropped = [], set()
    for k, m in enumerate(messages):
        if isinstance(m, dict) and "role" not in m and "from" in m:
            m = sharegpt_turn(m, k)
        if not isinstance(m, dict) or "role" not in m:
            raise ChatRowError(f"turn {k} must be a mapping with 'role' and 'content', got {short(m)}")
        if m["role"] not in ROLES:
            raise ChatRowError(f"turn {k} has unknown role {m['role']!r}; expected one of {', '.join(ROLES)}")
        calls = m.get("tool_calls")
        if calls:
            if "tool_calls" not in keys:
                raise ChatRowError(
                    f"turn {k} has tool_calls, which {template_name} does not render; use a "
                    f"tokenizer whose chat template renders tool calls, or leave such rows out"
                )
            if not isinstance(calls, list):
                raise ChatRowError(f"turn {k} tool_calls must be a list, got {short(calls)}")
        if m.get("content") is None and not calls:
            raise ChatRowError(f"turn {k} must be a mapping with 'role' and 'content', got {short(m)}")
        turn = {"role": m["role"], "content": "" if m.get("content") is None else _content_text(m["content"], k)}
        for key, value in m.items():
            if key in ("role", "content") or value is None:  # parquet / hub rows fill absent keys with None
                continue
            if key in keys:
                turn[key] = value
            else:
                dropped.add(key)
        out.append(turn)
    if not any(m["role"] == "assistant" for m in out):
        raise ChatRowError("the conversation has no assistant turn, so no token would carry loss")
    return out, sorted(dropped)
