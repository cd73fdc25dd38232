"""Chat templates: the real templates (Qwen2.5, Qwen3, Llama 3.1, Mistral Nemo, Phi-3.5, Phi-4, Gemma 3) rendered to exact text, errors, sandbox, fallback, messages files."""

from __future__ import annotations

import json
from datetime import datetime
from types import SimpleNamespace

import pytest

from k4.runtime.chat_template import FALLBACK_TEMPLATE, ChatTemplate, load_messages
from k4.runtime.errors import TemplateError, UsageError
from k4.runtime.model import open_model
from k4.runtime.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
]

# template file -> (bos_text, eos_text of the model, expected text with add_generation_prompt, without)
EXPECTED = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": (
        "", "<|im_end|>",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi! How can I help?<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi! How can I help?<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n",
    ),
    # No date_string is passed (as in transformers), so the template's default date shows.
    "meta-llama-Llama-3.1-8B-Instruct.jinja": (
        "<|begin_of_text|>", "<|eot_id|>",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi! How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi! How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|>",
    ),
    # Mistral puts the system message into the last user turn and has no generation prompt.
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": (
        "<s>", "</s>",
        "<s>[INST]Hello![/INST]Hi! How can I help?</s>[INST]You are a helpful assistant.\n\nTell me a joke.[/INST]",
        "<s>[INST]Hello![/INST]Hi! How can I help?</s>[INST]You are a helpful assistant.\n\nTell me a joke.[/INST]",
    ),
    # Phi-3.5 ends a finished conversation with the EOS text.
    "microsoft-Phi-3.5-mini-instruct.jinja": (
        "<s>", "<|endoftext|>",
        "<|system|>\nYou are a helpful assistant.<|end|>\n<|user|>\nHello!<|end|>\n"
        "<|assistant|>\nHi! How can I help?<|end|>\n<|user|>\nTell me a joke.<|end|>\n<|assistant|>\n",
        "<|system|>\nYou are a helpful assistant.<|end|>\n<|user|>\nHello!<|end|>\n"
        "<|assistant|>\nHi! How can I help?<|end|>\n<|user|>\nTell me a joke.<|end|>\n<|endoftext|>",
    ),
}

# Gemma 3, Phi-4 and Qwen3: the expected strings are what transformers 5.23.0 renders
# (PreTrainedTokenizerFast(tokenizer_object=<a WordLevel tokenizer holding bos/eos>,
# bos_token=..., eos_token=..., chat_template=<the file>).apply_chat_template(CONVERSATION,
# tokenize=False, add_generation_prompt=...)), run outside this repository; the bos/eos texts are
# those of the models' tokenizer_config.json. test_transformers_agrees re-checks them where
# transformers is installed.
EXPECTED.update({
    # Gemma 3 has no system role: the system text opens the first user turn; "assistant" is "model".
    "google-gemma-3-4b-it.jinja": (
        "<bos>", "<eos>",
        "<bos><start_of_turn>user\nYou are a helpful assistant.\n\nHello!<end_of_turn>\n"
        "<start_of_turn>model\nHi! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nTell me a joke.<end_of_turn>\n<start_of_turn>model\n",
        "<bos><start_of_turn>user\nYou are a helpful assistant.\n\nHello!<end_of_turn>\n"
        "<start_of_turn>model\nHi! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nTell me a joke.<end_of_turn>\n",
    ),
    "microsoft-phi-4.jinja": (
        "<|endoftext|>", "<|im_end|>",
        "<|im_start|>system<|im_sep|>You are a helpful assistant.<|im_end|><|im_start|>user<|im_sep|>Hello!<|im_end|>"
        "<|im_start|>assistant<|im_sep|>Hi! How can I help?<|im_end|><|im_start|>user<|im_sep|>Tell me a joke.<|im_end|>"
        "<|im_start|>assistant<|im_sep|>",
        "<|im_start|>system<|im_sep|>You are a helpful assistant.<|im_end|><|im_start|>user<|im_sep|>Hello!<|im_end|>"
        "<|im_start|>assistant<|im_sep|>Hi! How can I help?<|im_end|><|im_start|>user<|im_sep|>Tell me a joke.<|im_end|>",
    ),
    "Qwen-Qwen3-0.6B.jinja": (
        "", "<|im_end|>",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi! How can I help?<|im_end|>\n<|im_start|>user\nTell me a joke.<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi! How can I help?<|im_end|>\n<|im_start|>user\nTell me a joke.<|im_end|>\n",
    ),
})

THINK_CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
]
# Qwen3 with enable_thinking=False, and with thinking in the history (transformers 5.23.0 as above):
# the template drops the thinking of assistant turns before the last user message, and keeps it
# in an assistant turn after it.
QWEN3_NO_THINKING = EXPECTED["Qwen-Qwen3-0.6B.jinja"][2] + "<think>\n\n</think>\n\n"
QWEN3_THINK_HISTORY = ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                       "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")
QWEN3_THINK_LAST = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>\n"


def specials(bos: str = "<s>", eos: str = "</s>") -> SimpleNamespace:
    """What ChatTemplate reads from a Tokenizer: bos_text and eos_text."""
    return SimpleNamespace(bos_text=bos, eos_text=eos)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_templates_render_exactly(data, name):
    bos, eos, with_prompt, without_prompt = EXPECTED[name]
    template = ChatTemplate.from_file(data / "templates" / name, specials(bos, eos))
    assert not template.is_fallback
    assert template.render(CONVERSATION) == with_prompt
    assert template.render(CONVERSATION, add_generation_prompt=False) == without_prompt


def test_qwen3_thinking_switch_and_history(data):
    template = ChatTemplate.from_file(data / "templates" / "Qwen-Qwen3-0.6B.jinja", specials("", "<|im_end|>"))
    assert template.has_thinking_switch
    assert template.render(CONVERSATION, variables={"enable_thinking": False}) == QWEN3_NO_THINKING
    assert template.render(CONVERSATION, variables={"enable_thinking": True}) == EXPECTED["Qwen-Qwen3-0.6B.jinja"][2]
    assert template.render(THINK_CONVERSATION) == QWEN3_THINK_HISTORY
    assert template.render(THINK_CONVERSATION[:2], add_generation_prompt=False) == QWEN3_THINK_LAST
    # Extra variables cannot replace the ones k4 sets.
    assert template.render(CONVERSATION, variables={"messages": [], "add_generation_prompt": False}) == EXPECTED["Qwen-Qwen3-0.6B.jinja"][2]


def test_templates_without_a_thinking_switch(data):
    for name in ("google-gemma-3-4b-it.jinja", "microsoft-phi-4.jinja", "Qwen-Qwen2.5-7B-Instruct.jinja"):
        assert not ChatTemplate.from_file(data / "templates" / name, specials()).has_thinking_switch


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_transformers_agrees(data, name):
    """Where transformers is installed, its apply_chat_template renders each file as EXPECTED says."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    bos, eos, with_prompt, without_prompt = EXPECTED[name]
    vocab = {"[UNK]": 0, **{t: i + 1 for i, t in enumerate(t for t in (bos, eos) if t)}}
    kw = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]")),
        chat_template=(data / "templates" / name).read_text(encoding="utf-8"), **kw)
    assert tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == with_prompt
    assert tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=False) == without_prompt
    if name == "Qwen-Qwen3-0.6B.jinja":
        assert tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True, enable_thinking=False) == QWEN3_NO_THINKING
        assert tok.apply_chat_template(THINK_CONVERSATION, tokenize=False, add_generation_prompt=True) == QWEN3_THINK_HISTORY


def test_template_raise_exception_is_template_error(data):
    template = ChatTemplate.from_file(data / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja", specials())
    with pytest.raises(TemplateError, match="conversation roles must alternate user/assistant"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_raise_exception_message_is_one_line():
    template = ChatTemplate("{{ raise_exception('first\nsecond') }}", "t.jinja")
    with pytest.raises(TemplateError) as err:
        template.render(CONVERSATION)
    assert str(err.value) == "t.jinja: chat template error: first second"


def test_syntax_error_is_template_error():
    with pytest.raises(TemplateError, match=r"t\.jinja: chat template syntax error at line 2"):
        ChatTemplate("ok\n{% if %}", "t.jinja")


def test_failure_inside_template_is_template_error():
    template = ChatTemplate("{{ messages[0]['content'] + none }}", "t.jinja")
    with pytest.raises(TemplateError, match="TypeError"):
        template.render(CONVERSATION)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ cycler.__init__.__globals__.os.environ }}",
        "{{ lipsum.__globals__['os'].popen('id').read() }}",
        "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{% include '/etc/passwd' %}",
    ],
)
def test_sandbox_refuses_escapes(source):
    messages = [dict(m) for m in CONVERSATION]
    with pytest.raises(TemplateError):
        ChatTemplate(source, "hostile.jinja").render(messages)
    assert messages == CONVERSATION


def test_sandbox_unsafe_attribute_renders_nothing():
    assert ChatTemplate("[{{ ''|attr('__class__') }}]", "t.jinja").render(CONVERSATION) == "[]"


def test_tojson_keeps_unicode_and_takes_indent():
    template = ChatTemplate("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=1) }}", "t.jinja")
    out = template.render([{"role": "user", "content": "héllo ☃"}])
    assert out == '{"role": "user", "content": "héllo ☃"}|{\n "role": "user",\n "content": "héllo ☃"\n}'


def test_strftime_now_uses_the_given_time():
    template = ChatTemplate("{{ strftime_now('%d %b %Y') }}", "t.jinja")
    assert template.render(CONVERSATION, now=datetime(2025, 3, 9, 12, 0)) == "09 Mar 2025"


def test_variables_and_loopcontrols():
    source = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m.role }};{% endfor %}{{ tools is none }}{{ documents is none }}{{ eos_token }}"
    )
    assert ChatTemplate(source, "t.jinja", "<B>", "<E>").render(CONVERSATION) == "<B>system;user;TrueTrue<E>"


def test_fallback_is_chatml_for_a_model_without_template(data):
    mf = open_model(data / "models" / "stories260K.gguf", require_weights=False)
    template = ChatTemplate.from_model(mf, Tokenizer.from_model(mf))
    assert template.is_fallback and template.source == FALLBACK_TEMPLATE
    assert template.render(CONVERSATION[1:2]) == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    assert template.render(CONVERSATION[1:2], add_generation_prompt=False) == "<|im_start|>user\nHello!<|im_end|>\n"


def test_from_model_reads_the_gguf_template(tmp_path):
    meta = {"tokenizer.chat_template": "{{ bos_token }}{{ messages[-1]['content'] }}"}
    mf = SimpleNamespace(path=tmp_path / "m.gguf", meta=lambda key, default=None: meta.get(key, default))
    template = ChatTemplate.from_model(mf, specials("<s>"))
    assert not template.is_fallback
    assert template.render(CONVERSATION) == "<s>Tell me a joke."


def test_from_file_unreadable(tmp_path):
    with pytest.raises(TemplateError, match="missing.jinja: cannot read the chat template"):
        ChatTemplate.from_file(tmp_path / "missing.jinja", specials())


def test_load_messages(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    assert load_messages(path) == CONVERSATION


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[{", "not valid JSON"),
        ("{}", "non-empty JSON list"),
        ("[]", "non-empty JSON list"),
        ('[{"role": "user"}]', "message 0 is not an object"),
        ('[{"role": "user", "content": "a"}, "b"]', "message 1 is not an object"),
    ],
)
def test_load_messages_malformed(tmp_path, text, message):
    path = tmp_path / "chat.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UsageError, match=message):
        load_messages(path)


def test_load_messages_missing_file(tmp_path):
    with pytest.raises(UsageError, match="cannot read the messages file"):
        load_messages(tmp_path / "nope.json")
