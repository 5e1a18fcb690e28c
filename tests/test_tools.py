"""Tool-call parsing and rendering (the project's one parser)."""

import json

import pytest

from grooves.policy import Policy
from grooves.policy.models import byte_tokenizer
from grooves.policy.tools import (
    TOOLS_PROMPT, fallback_messages, parse_tool_calls, template_supports_tools, tool_call_text,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_hermes_blocks_with_text_around_them():
    reply = parse_tool_calls('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                             '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert reply.content == "Let me check."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert reply.errors == [] and reply.tool_calls[0].id != reply.tool_calls[1].id


def test_hermes_unclosed_block_and_double_encoded_arguments():
    reply = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("f", {"x": 1})]


@pytest.mark.parametrize("body, message", [
    ('{"name": "f", "arguments": {"x": 1', "not valid JSON"),  # cut off: not repaired
    ('{"name": "f", "arguments": {...}}', "not valid JSON"),  # a template copied, not a call
    ('{"arguments": {}}', 'needs a "name"'),
    ('{"name": "f", "arguments": [1, 2]}', "must be a JSON object"),
    ('{"name": "f", "arguments": "not json"}', "a string that is not JSON"),
    ('["f"]', "must be a JSON object"),
])
def test_malformed_calls_become_errors_not_silence(body, message):
    reply = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert reply.tool_calls == [] and len(reply.errors) == 1 and message in reply.errors[0]


@pytest.mark.parametrize("body, arguments", [
    ('{"name": "f", "arguments": {"q": "the default?\'}}', {"q": "the default?'"}),  # closed with '
    ('{"name": "f", "arguments": {"text": "called "Replace" here"}}', {"text": 'called "Replace" here'}),
    ('{"name": "f", "arguments": {"x": 1}', {"x": 1}),  # the outer brace missing
    ('{"name": "f", "arguments": {"x": 1}}}', {"x": 1}),  # one brace too many
])
def test_near_miss_calls_are_repaired_and_counted(body, arguments):
    reply = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert reply.errors == [] and reply.repaired == 1
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("f", arguments)]
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>').repaired == 0


def test_bare_and_fenced_json_calls():
    bare = parse_tool_calls('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    fenced = parse_tool_calls('```json\n[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 2}}]\n```')
    assert [(c.name, c.arguments) for c in bare.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert [c.name for c in fenced.tool_calls] == ["a", "b"] and fenced.content == ""


@pytest.mark.parametrize("text", ['{"answer": 42}', "The answer is {not json}", "plain prose", "[1, 2, 3]"])
def test_json_answers_and_prose_are_content(text):
    reply = parse_tool_calls(text)
    assert reply.tool_calls == [] and reply.errors == [] and reply.content == text


def test_parser_choice():
    text = '{"name": "f", "arguments": {}}'
    assert parse_tool_calls(text, "hermes").tool_calls == []
    assert len(parse_tool_calls(text, "json").tool_calls) == 1
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parse_tool_calls(text, "xml")


def test_rendered_call_parses_back():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    parsed = parse_tool_calls(tool_call_text(call)).tool_calls[0]
    assert (parsed.name, parsed.arguments) == ("get_weather", {"city": "Rome"})
    assert json.loads(parsed.to_openai()["function"]["arguments"]) == {"city": "Rome"}


def test_templates_without_tool_support_are_detected():
    plain = byte_tokenizer()  # ChatML without tools, like the bundled SmolLM2 template
    assert not template_supports_tools(plain)
    aware = byte_tokenizer()
    aware.chat_template = ("{% if tools %}{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
                           "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert template_supports_tools(aware)


def test_fallback_rendering_puts_tools_in_the_system_prompt_and_calls_in_text():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out = fallback_messages(messages, [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and TOOLS_PROMPT.split("{tools}")[0] in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_policy_renders_tools_for_a_template_that_ignores_them():
    policy = Policy.load("tiny")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = policy.decode(policy.chat_ids(messages, tools=[WEATHER]))
    assert not policy.native_tools and "get_weather" in with_tools and "<tools>" in with_tools
    assert "get_weather" not in policy.decode(policy.chat_ids(messages))


@pytest.mark.slow
def test_bundled_model_conversation_with_tool_calls(bundled_policy):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = bundled_policy.tokenizer.decode(bundled_policy.chat_ids(messages, tools=[WEATHER]))
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in text
    assert "<tool_response>\nsunny" in text and text.endswith("<|im_start|>assistant\n")
