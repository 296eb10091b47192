"""Rendering chat messages into a prompt with the model's own chat template.

The template comes from the model directory as Hugging Face stores it: the
``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of
``{"name", "template"}`` of which ``default`` is used), else a ``chat_template.jinja``
file beside it. It is rendered the way ``transformers``' ``apply_chat_template`` does:
Jinja2 in an immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the loop-controls
extension, the variables ``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token`` (and the tokenizer config's other special tokens), a ``raise_exception``
function and a ``strftime_now`` function.

A model without a template (the built-in tiny model included) gets `DEFAULT_CHAT_TEMPLATE`:
each message as ``<|ROLE|>`` on its own line followed by its content and a newline, then
``<|assistant|>`` and a newline when a generation prompt is asked for.

The router and every worker call `ChatTemplate.for_model` on the same model directory,
so a chat request renders to the same prompt whichever process serves it.

The rendered text already holds any BOS the template writes, so it is tokenized without
adding special tokens again (`ChatTemplate.encode`).
"""
from __future__ import annotations

import json
import os
from datetime import datetime

#: Template for models that ship none (documented in the README's HTTP section).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool", "developer")


#: Fields a chat message may carry (OpenAI's chat message params and what its responses'
#: messages carry, so a previous answer can be sent back as it came, plus
#: ``reasoning_content`` / ``reasoning`` that reasoning models' templates read); all reach
#: the template as they are.
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio",
                  "annotations", "reasoning_content", "reasoning")


class ChatTemplateError(ValueError):
    """The messages are malformed or the template refused them (an HTTP 400)."""


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _read_template(model_dir: str | None) -> tuple[str | None, dict]:
    if not model_dir:
        return None, {}
    cfg: dict = {}
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not template:
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as fh:
                template = fh.read()
    return template or None, cfg


def normalize_messages(messages) -> list[dict]:
    """Check OpenAI chat messages and flatten content parts to text.

    Each message needs a ``role`` in `ROLES` and a ``content`` that is a string, a list of
    ``{"type": "text", "text": ...}`` parts (joined), or, for an assistant turn only (one
    with tool calls), null or absent; its other fields must be in `MESSAGE_FIELDS` (a typo
    such as ``contnet`` in an assistant turn would otherwise drop the turn's text unnoticed).

    Raises:
        ChatTemplateError: anything else (the message says which message and field).
    """
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty array of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with role and content")
        unknown = [k for k in m if k not in MESSAGE_FIELDS]
        if unknown:  # names come from the caller: the first few, each cut short
            names = ", ".join(repr(k[:60] if isinstance(k, str) else k) for k in unknown[:3])
            raise ChatTemplateError(f"messages[{i}] has unknown field{'s' if len(unknown) > 1 else ''} {names}"
                                    f"{' and more' if len(unknown) > 3 else ''}: a message takes "
                                    f"{', '.join(MESSAGE_FIELDS)}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {role!r})")
        for key in ("name", "tool_call_id"):  # strings a template pastes into the prompt
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ChatTemplateError(f"messages[{i}].{key} must be a string (got {type(m[key]).__name__})")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(f"messages[{i}].content[{j}]: only text parts "
                                            f"({{\"type\": \"text\", \"text\": ...}}) are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            if role != "assistant":  # only an assistant turn (with tool calls) may go without content
                raise ChatTemplateError(f"messages[{i}] ({role}) needs a content: a string or an array of text parts")
            content = ""
        elif not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or an array of text parts")
        msg = dict(m)
        msg["content"] = content
        out.append(msg)
    return out


class ChatTemplate:
    """A compiled chat template and the special tokens it may reference.

    Raises:
        ValueError: from `for_model`, when ``tokenizer_config.json`` cannot be parsed or the
            template does not compile.
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, is_default: bool = False):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(str(message))

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.is_default = is_default

    @classmethod
    def for_model(cls, model_dir: str | None) -> "ChatTemplate":
        """The template of the model at ``model_dir`` (None: the built-in model), else the default."""
        try:
            source, cfg = _read_template(model_dir)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{model_dir}/tokenizer_config.json: cannot read it ({exc})") from None
        special = {k: _token_text(v) for k, v in cfg.items()
                   if k.endswith("_token") and isinstance(v, (str, dict))}
        if source is None:
            return cls(DEFAULT_CHAT_TEMPLATE, special, is_default=True)
        return cls(source, special)

    def render(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for OpenAI-style ``messages``.

        Raises:
            ChatTemplateError: malformed messages, or the template raised for them.
        """
        import jinja2

        msgs = normalize_messages(messages)
        ctx = {"bos_token": "", "eos_token": "", **self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt, **ctx)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from None

    @staticmethod
    def encode(tokenizer, text: str) -> list[int]:
        """Token ids of rendered chat text, without adding special tokens a second time."""
        try:
            return tokenizer.encode(text, add_special_tokens=False)
        except TypeError:  # a tokenizer that never adds special tokens
            return tokenizer.encode(text)
