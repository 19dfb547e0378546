"""A checkpoint's chat template rendered with jinja2 the way transformers renders it.

Hugging Face checkpoints carry a jinja2 chat template (``chat_template.jinja``, or the
``chat_template`` field of ``tokenizer_config.json``). :class:`ChatTemplate` renders it in a
sandboxed jinja2 environment configured as transformers' ``utils/chat_template_utils.py``
(``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``, a
``tojson`` that does not escape HTML, ``strftime_now``) with the checkpoint's special tokens
(``bos_token``, ``eos_token``, ...) as variables, so :meth:`ChatTemplate.render` equals
``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)``. Only jinja2 is needed, not transformers.

Example::

    template = ChatTemplate.from_pretrained("Qwen3-0.6B/")
    text = template.prompt("What is 2+2?")   # "<|im_start|>user\\nWhat is 2+2?<|im_end|>\\n..."
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any, Mapping, Sequence

from jaxflow.data.sources import require_module
from jaxflow.errors import FileFormatError, UserError, read_text

#: The special-token variables transformers hands every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
#: Names a message's reasoning may come under (transformers aliases them to one another).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(UserError, ValueError):
    """A chat template that cannot be read or rendered, or messages it cannot take; the message
    names the file or message at fault."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """``source`` compiled in a sandboxed environment configured as transformers' (cached)."""
    jinja2 = require_module("jinja2", "rendering a chat template")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # As transformers: no HTML escaping, indent / separators exposed.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A jinja2 chat template and the special tokens it is rendered with.

    Attributes:
      source: the template text.
      special_tokens: ``{"bos_token": "<s>", "eos_token": ...}`` - the variables transformers
        passes (:data:`SPECIAL_TOKEN_NAMES`, those the checkpoint sets).
    """

    source: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.source, tuple(sorted(self.special_tokens.items()))))

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source.strip():
            raise ChatTemplateError(f"chat template {self.source!r} is empty; valid: jinja2 template text")
        jinja2 = require_module("jinja2", "rendering a chat template")
        try:
            _compile(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template line {e.lineno}: {e.message}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ChatTemplate | None":
        """The template of the checkpoint directory ``path``, or None when it has none.

        Reads ``chat_template.jinja`` (which wins, as in transformers) or
        ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates:
        the one named ``default``), and the special tokens of ``tokenizer_config.json`` (with
        ``special_tokens_map.json``'s values over them when the config has no
        ``added_tokens_decoder``, transformers' legacy rule).

        Raises:
          FileFormatError: ``path`` is not a directory or ``tokenizer_config.json`` is not JSON.
          ChatTemplateError: a template with a syntax error or no ``default`` among several.
        """
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileFormatError(f"checkpoint directory {path!r} does not exist; valid: a directory "
                                  "with tokenizer_config.json or chat_template.jinja")
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_NAMES}
        if "added_tokens_decoder" not in config:
            legacy = _read_json(os.path.join(path, "special_tokens_map.json"))
            tokens.update({k: _token_text(v) for k, v in legacy.items() if k in SPECIAL_TOKEN_NAMES})
        tokens = {k: v for k, v in tokens.items() if v is not None}
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            source = read_text(jinja_file, what="chat template")
        else:
            source = config.get("chat_template")
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                if "default" not in named:
                    raise ChatTemplateError(f"{path}/tokenizer_config.json has the chat templates "
                                            f"{sorted(map(str, named))} and none named 'default'")
                source = named["default"]
            if source is None:
                return None
        return cls(source, tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The conversation ``messages`` (dicts with ``role`` and ``content``) as the template
        writes it, ending with the assistant header when ``add_generation_prompt``; equal to
        transformers' ``apply_chat_template(messages, tokenize=False, ...)``. ``tools`` (JSON
        schemas) and ``documents`` are passed as transformers passes them; ``kwargs`` are
        extra template variables (e.g. ``enable_thinking=False``); they override the special
        tokens, as in transformers.

        Raises:
          ChatTemplateError: no messages, a message that is not a dict with a string ``role``,
            or the template's own ``raise_exception``.
        """
        jinja2 = require_module("jinja2", "rendering a chat template")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ChatTemplateError(f"chat messages {messages!r:.60} are not a non-empty list of "
                                    "{'role', 'content'} dicts")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ChatTemplateError(f"chat message {i} ({message!r:.60}) is not a dict with a "
                                        "string 'role' (and 'content')")
            # As transformers: keys whose value is None are dropped, and a message's reasoning is
            # also given as `reasoning_content` (what templates read) and `thinking` (gpt-oss).
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        variables = {**self.special_tokens, **kwargs}
        try:
            return _compile(self.source).render(messages=chat, tools=tools, documents=documents,
                                                add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template refused the messages: {e}") from None

    def prompt(self, text: str, *, system: str | None = None, **kwargs: Any) -> str:
        """One user turn ``text`` (after a ``system`` turn when given) rendered with the
        assistant header: the prompt a chat model continues."""
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        return self.render(messages + [{"role": "user", "content": text}], True, **kwargs)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        data = json.loads(read_text(path, what="tokenizer config"))
    except json.JSONDecodeError as e:
        raise FileFormatError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise FileFormatError(f"{path} holds a JSON {type(data).__name__}; valid: an object")
    return data
