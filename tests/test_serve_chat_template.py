"""Chat templates render as transformers' apply_chat_template renders them: the same text and,
tokenized without added special tokens, the same ids."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jinja2")

from fuselab.engine.tokenizer import HFTokenizer  # noqa: E402
from fuselab.serve.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402
from serve_fixtures import CHAT_TEMPLATE, hf_tokenizer  # noqa: E402

# What chat templates on the Hub lean on: namespace, loop controls, trim_blocks/lstrip_blocks
# whitespace, tojson without HTML escapes, strftime_now, raise_exception, the special tokens,
# add_generation_prompt and the {% generation %} tag.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') %}
{%- for m in messages if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% endfor %}
{% if ns.system %}
<|system|> {{ ns.system | trim }} ({{ strftime_now('%Y') }}) {{ eos_token }}
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Conversation roles must be system, user or assistant, not ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% if message['role'] == 'assistant' %}
<|assistant|> {% generation %}{{ message['content'] }}{% endgeneration %} {{ eos_token }}
    {% else %}
<|user|> {{ message['content'] }}
{%- if message['meta'] is defined %} {{ message['meta'] | tojson }}{% endif %} {{ eos_token }}
    {% endif %}
    {% if loop.index >= 6 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "w1 w2"}],
    [{"role": "system", "content": "  w3  "}, {"role": "user", "content": "w4"},
     {"role": "assistant", "content": "w5 w6"}, {"role": "user", "content": "w7", "meta": {"k": "é<b>&"}}],
    [{"role": "user", "content": f"w{i}"} for i in range(9)],
]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE], ids=["simple", "rich"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(tmp_path, template, add_generation_prompt):
    hf = hf_tokenizer(template)
    hf.save_pretrained(tmp_path)
    ours = ChatTemplate.from_dir(tmp_path)
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        rendered = ours.render(messages, add_generation_prompt=add_generation_prompt)
        assert rendered == expected
        ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)["input_ids"]
        assert tokenizer.encode(rendered, add_special_tokens=False) == ids


def test_raise_exception_refuses_as_transformers_does(tmp_path):
    hf = hf_tokenizer(RICH_TEMPLATE)
    hf.save_pretrained(tmp_path)
    messages = [{"role": "tool", "content": "w1"}]
    with pytest.raises(Exception, match="not tool"):
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError, match="not tool"):
        ChatTemplate.from_dir(tmp_path).render(messages)


def test_template_sources_in_transformers_order(tmp_path):
    assert ChatTemplate.from_dir(None) is None and ChatTemplate.from_dir(tmp_path) is None
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]
    config = {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>", "chat_template": templates}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_dir(tmp_path)
    assert template.render([]) == "<s>D" and template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")  # a separate file wins, as in transformers
    assert ChatTemplate.from_dir(tmp_path).render([]) == "J</s>"
    assert ChatTemplate.from_dir(tmp_path, "S{{ bos_token }}").render([]) == "S<s>"  # --chat-template


def test_the_sandbox_holds(tmp_path):
    for source in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace() %}{% set ns._x = 1 %}"):
        with pytest.raises(ChatTemplateError):
            ChatTemplate(source).render([])
