"""Chat templates: the model's own, rendered as transformers renders it; the documented default."""
from __future__ import annotations

import json

import pytest

from kvmesh.services.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "Why "},
                                                                                      {"type": "text", "text": "sky?"}]}]

# A ChatML-style and a Llama-2-style template, with the whitespace control and
# raise_exception that real tokenizer_config.json files use.
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}\n"
          "{% for message in loop_messages %}\n"
          "    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\n"
          "    {% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}\n"
          "    {% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}\n"
          "{% endfor %}")


def _model_dir(tmp_path, template, as_list=False):
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}}
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}] \
        if as_list else template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def _transformers_render(template, messages):
    """The reference: transformers' apply_chat_template on a tokenizer with the same template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2},
                                                                       unk_token="<unk>")),
                                  bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = template
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("template", [CHATML, LLAMA2], ids=["chatml", "llama2"])
def test_renders_as_transformers_does(tmp_path, template):
    flat = [dict(m, content=m["content"] if isinstance(m["content"], str) else "Why sky?") for m in MESSAGES]
    ours = ChatTemplate.for_model(_model_dir(tmp_path, template)).render(MESSAGES)
    assert ours == _transformers_render(template, flat)


def test_named_template_list_uses_default(tmp_path):
    t = ChatTemplate.for_model(_model_dir(tmp_path, CHATML, as_list=True))
    assert not t.is_default
    assert t.render([{"role": "user", "content": "x"}]).startswith("<|im_start|>user\nx<|im_end|>")


def test_model_without_template_gets_the_documented_default(tmp_path):
    for model_dir in (None, str(tmp_path)):
        t = ChatTemplate.for_model(model_dir)
        assert t.is_default and t.source == DEFAULT_CHAT_TEMPLATE
        assert t.render(MESSAGES[:2]) == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
        assert t.render(MESSAGES[:2], add_generation_prompt=False) == "<|system|>\nBe brief.\n<|user|>\nHi there\n"


def test_template_errors_are_client_errors(tmp_path):
    t = ChatTemplate.for_model(_model_dir(tmp_path, LLAMA2))
    with pytest.raises(ChatTemplateError, match="alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="role"):
        t.render([{"role": "robot", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="non-empty"):
        t.render([])
    with pytest.raises(ChatTemplateError, match="text parts"):
        t.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] \(user\) needs a content"):
        t.render([{"role": "user"}])
    # an assistant turn with tool calls may have none
    assert "a" in t.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": None},
                            {"role": "user", "content": "b"}])


def test_broken_template_fails_at_start(tmp_path):
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.for_model(_model_dir(tmp_path, "{% for %}"))


def test_a_message_field_that_no_chat_api_defines_is_refused_by_name(tmp_path):
    """A typo inside a message (``contnet`` in an assistant turn, whose content may be absent)
    once rendered the turn empty without a word; the fields chat APIs define still pass."""
    t = ChatTemplate.for_model(None)
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] has unknown field 'contnet': a message takes role"):
        t.render([{"role": "user", "content": "a"}, {"role": "assistant", "contnet": "the answer"}])
    with pytest.raises(ChatTemplateError, match=r"unknown fields 'x', 'y', 'z' and more"):
        t.render([{"role": "user", "content": "a", "x": 1, "y": 2, "z": 3, "w": 4}])
    tool_turns = [{"role": "user", "content": "weather?", "name": "ann"},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                         "function": {"name": "w", "arguments": "{}"}}],
                   "reasoning_content": "look it up", "refusal": None, "audio": None, "annotations": []},
                  {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    assert t.render(tool_turns).endswith("<|tool|>\nsunny\n<|assistant|>\n")
