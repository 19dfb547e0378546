"""jaxflow.data.chat_template: renders exactly as transformers' apply_chat_template (tokenize=False)
on a Qwen3-like and a Llama-3-like template written here; its errors are one line."""
import json
import os

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxflow.data.chat_template import ChatTemplate, ChatTemplateError
from jaxflow.errors import UserError

# The structure of Qwen3's template: namespace, a reversed loop, tools through tojson, reasoning
# content, enable_thinking, raise_exception on an unknown role.
QWEN3_LIKE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" %}{%- set ns.last_query_index = index %}{%- break %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') }}
            {{- '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role != "system" %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

# Llama-3's template, laid out on lines with indented block tags (trim_blocks / lstrip_blocks
# decide its whitespace).
LLAMA3_LIKE = """{% set loop_messages = messages %}
{% for message in loop_messages %}
    {% set header = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' %}
    {% set content = header + message['content'] | trim + '<|eot_id|>' %}
    {% if loop.index0 == 0 %}
        {% set content = bos_token + content %}
    {% endif %}
{{ content }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{% endif %}"""

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief & <exact>."}, {"role": "user", "content": " 3*4? "},
     {"role": "assistant", "content": "12", "reasoning_content": "3 fours"},
     {"role": "user", "content": "and \"5*5\"?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "thinking": "t"}],
]


def _write_checkpoint(path, *, config: dict, jinja: str | None = None):
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **config}, f)
    if jinja is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(jinja)
    return str(path)


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_render_equals_transformers(tmp_path, kind):
    if kind == "qwen3":
        path = _write_checkpoint(tmp_path, config={"chat_template": QWEN3_LIKE, "eos_token": "<|im_end|>",
                                                   "pad_token": "<|endoftext|>", "bos_token": None})
    else:  # chat_template.jinja wins over the config's template; tokens as serialized AddedTokens
        path = _write_checkpoint(tmp_path, jinja=LLAMA3_LIKE, config={
            "chat_template": "{{ 'not this one' }}",
            "bos_token": {"content": "<|begin_of_text|>", "special": True, "__type": "AddedToken"},
            "eos_token": {"content": "<|eot_id|>", "special": True, "__type": "AddedToken"}})
    ref = transformers.AutoTokenizer.from_pretrained(path)
    ours = ChatTemplate.from_pretrained(path)
    for messages in CHATS:
        for gen in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.render(messages, add_generation_prompt=gen) == expected
    expected = ref.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert ours.render(CHATS[0], enable_thinking=False) == expected
    assert ours.prompt("What is 2+2?") == ref.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    if kind == "qwen3":
        tools = [{"type": "function", "function": {"name": "add", "description": "a <b> & c"}}]
        expected = ref.apply_chat_template(CHATS[1], tools=tools, tokenize=False, add_generation_prompt=True)
        assert "<b> & c" in expected
        assert ours.render(CHATS[1], tools=tools) == expected
        assert ours.render(CHATS[0]).endswith("<|im_start|>assistant\n")
    else:
        assert ours.render(CHATS[0]).startswith("<|begin_of_text|><|start_header_id|>user")


def test_errors_are_one_line(tmp_path):
    qwen = ChatTemplate(QWEN3_LIKE, {"eos_token": "<|im_end|>"})
    assert hash(qwen) == hash(ChatTemplate(QWEN3_LIKE, {"eos_token": "<|im_end|>"}))  # usable in frozen configs
    with pytest.raises(ChatTemplateError, match="unknown role tool") as e:
        qwen.render([{"role": "tool", "content": "x"}])
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    with pytest.raises(ChatTemplateError, match="not a dict with a string 'role'"):
        qwen.render([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        qwen.render("just text")
    with pytest.raises(ChatTemplateError, match=r"line 2: .*'endfor'"):
        ChatTemplate("{% for m in messages %}\n{{ m }}{% endif %}")
    assert ChatTemplate.from_pretrained(_write_checkpoint(tmp_path / "none", config={})) is None
    several = _write_checkpoint(tmp_path / "several", config={"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "rag", "template": "y"}]})
    with pytest.raises(ChatTemplateError, match=r"\['rag', 'tool_use'\] and none named 'default'"):
        ChatTemplate.from_pretrained(several)
    with pytest.raises(UserError, match="does not exist"):
        ChatTemplate.from_pretrained(tmp_path / "missing")
