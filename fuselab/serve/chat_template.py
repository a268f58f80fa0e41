"""A checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it.

The template comes from chat_template.jinja or tokenizer_config.json's chat_template (the one
named "default" where there are several). It runs in the same sandboxed jinja2 environment
transformers builds (trim_blocks, lstrip_blocks, loop controls, the {% generation %} tag), with
the same globals (raise_exception, strftime_now, dict, namespace) and tojson filter, and sees
the same variables: messages, tools, documents, add_generation_prompt and the special tokens
(bos_token, eos_token, ...) as strings. The rendered text already holds the special tokens it
needs, so it is tokenized without adding more.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (raise_exception) or failed on them."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)

    @classmethod
    def from_dir(cls, model_dir: Path | None, source: str | None = None) -> "ChatTemplate | None":
        """The checkpoint's template (or `source`, with the checkpoint's special tokens), or None
        when there is none (or only named ones, none "default")."""
        if model_dir is None:
            return None if source is None else cls(source)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        jinja_path = model_dir / "chat_template.jinja"
        if source is None:
            source = jinja_path.read_text() if jinja_path.is_file() else config.get("chat_template")
        if isinstance(source, list):
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str):
            return None
        return cls(source, _special_tokens(model_dir, config))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
        except (TypeError, KeyError, AttributeError, ValueError) as err:
            raise ChatTemplateError(f"the chat template failed on the messages: {type(err).__name__}: {err}") from None


def _special_tokens(model_dir: Path, config: dict) -> dict[str, str]:
    """Named special tokens as strings; tokenizer_config.json first, then special_tokens_map.json."""
    legacy_path = model_dir / "special_tokens_map.json"
    legacy = json.loads(legacy_path.read_text()) if legacy_path.is_file() else {}
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name, legacy.get(name))
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's tokens with it;
    rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateDict:
    """`dict` for templates, without the attributes of the type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names (no reaching into interpreter internals)."""

    def __init__(*args, **kwargs) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes HTML characters, which a prompt must keep as they are.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    # Templates come with downloaded checkpoints: untrusted code, hence the sandbox.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env
