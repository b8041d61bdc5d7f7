"""Tool calls without a server: each dialect's markup becomes the calls vLLM's parser of that
name reads from it; a stream split anywhere gives the same content and calls as the whole
text; malformed markup stays content; the prompt shows tools in the model's own template or in
the documented Hermes fallback, with past calls and results rendered back."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplx.server.tools import (HERMES_FALLBACK, PARSERS, HermesParser, Llama3JsonParser, Qwen3CoderParser, Tool,
                                ToolCall, ToolCallStream, ToolChoice, hermes_messages, parser_for, render_prompt,
                                split_tool_calls)
from tests.test_server_harness import char_tokenizer

WEATHER = Tool("get_weather", "Weather in a city", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}, "required": ["city"]})
TIME = Tool("get_time", "", {"type": "object", "properties": {"zone": {"type": "string"}}})
TOOLS = [WEATHER, TIME]


def calls(text: str, parser) -> tuple[str, list[tuple[str, dict]]]:
    content, found = split_tool_calls(parser, TOOLS, text)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


# -- the dialects (examples in each model family's documented format) -------------------------
def test_hermes_calls_with_content_before_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    assert calls(text, HermesParser()) == ("Let me check.", [("get_weather", {"city": "Paris", "days": 2}),
                                                             ("get_time", {"zone": "CET"})])


def test_a_forced_hermes_string_argument_may_hold_the_end_tag():
    """Under a forced call (its grammar makes the block valid JSON and lets a string hold any
    text) the block ends at the first ``</tool_call>`` outside a JSON string: the tag inside one
    ended the block there, and the call came back as content, streamed or whole. Unforced
    output may be malformed, so there the first tag still ends a block: an unclosed quote
    does not swallow the calls after it."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}\n</tool_call>'
    forced = ToolChoice("function", "get_weather")
    content, found = split_tool_calls(HermesParser(), TOOLS, text, forced)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in found] == [
        ("get_weather", {"city": "a</tool_call>b"})]
    for cut in range(1, len(text)):
        stream = ToolCallStream(HermesParser(), TOOLS, forced)
        events = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        assert not [v for k, v in events if k == "content" and v.strip()], cut
        assert [(c.name, json.loads(c.arguments), c.complete) for c in stream.calls] == [
            ("get_weather", {"city": "a</tool_call>b"}, True)], cut
    broken = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo}}</tool_call> then '
              '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done')
    assert calls(broken, HermesParser())[1] == [("get_time", {})]


def test_hermes_accepts_an_unclosed_last_call_and_parameters_as_the_arguments_key():
    assert calls('<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}', HermesParser()) == \
        ("", [("get_time", {"zone": "UTC"})])


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not an offered tool
    '<tool_call>["get_weather"]</tool_call>',
    "<tool_call",
])
def test_malformed_markup_degrades_to_content(text):
    assert calls("Hi " + text, HermesParser()) == ("Hi " + text, [])


def test_qwen3_coder_xml_converts_values_by_the_schema_type():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")
    assert calls(text, Qwen3CoderParser()) == ("", [("get_weather", {"city": "New York", "days": 3,
                                                                      "metric": True})])
    # a string parameter stays a string even when it looks like a number
    assert calls("<tool_call><function=get_weather><parameter=city>1984</parameter></function></tool_call>",
                 Qwen3CoderParser())[1] == [("get_weather", {"city": "1984"})]


def test_llama3_json_whole_reply_several_calls_and_the_python_tag():
    text = ' {"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}'
    assert calls(text, Llama3JsonParser()) == ("", [("get_weather", {"city": "a;b"}), ("get_time", {})])
    assert calls('<|python_tag|>{"name": "get_time", "parameters": {"zone": "X"}}', Llama3JsonParser())[1] == \
        [("get_time", {"zone": "X"})]
    # JSON later in a reply is text, as in vLLM's llama3_json
    assert calls('Use {"name": "get_time", "parameters": {}}', Llama3JsonParser())[1] == []


@pytest.mark.parametrize("template, name", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    ("{%- if tools %}<tools>{% endif %}<tool_call>{{ m }}", "hermes"),
    ("{% if tools %}{% endif %}<function=x><parameter=y>", "qwen3_coder"),
    ('{%- if tools %}{"name": fn, "parameters": args}<|python_tag|>{% endif %}', "llama3_json"),
])
def test_the_parser_follows_the_chat_template_unless_overridden(template, name):
    tokenizer = char_tokenizer()
    tokenizer.hf.chat_template = template
    assert type(parser_for(tokenizer)) is PARSERS[name]
    assert type(parser_for(tokenizer, "qwen3_coder")) is Qwen3CoderParser


def test_the_cli_offers_every_parser():
    from mtplx.commands.serve import TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


# -- streaming ------------------------------------------------------------------------------
SAMPLES = [
    'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> and '
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done',
    "Just text with a < and <tool and <tool_call>{broken</tool_call> end",
    '<tool_call>{"name": "get_time", "arguments": {"zone": "</tool_call"}}',
]


@settings(max_examples=60, deadline=None)
@given(sample=st.sampled_from(SAMPLES), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_split_anywhere_gives_the_whole_texts_content_and_calls(sample, cuts):
    stream = ToolCallStream(HermesParser(), TOOLS)
    points = sorted({0, len(sample), *[c % (len(sample) + 1) for c in cuts]})
    events = []
    for a, b in zip(points, points[1:]):
        events += stream.feed(sample[a:b])
    events += stream.finish()
    content, found = split_tool_calls(HermesParser(), TOOLS, sample)
    streamed = "".join(v for k, v in events if k == "content")
    assert (streamed.strip() if found else streamed) == content
    assert [(c.name, c.arguments) for c in stream.calls] == [(c.name, c.arguments) for c in found]


def test_hermes_arguments_stream_as_they_arrive():
    stream = ToolCallStream(HermesParser(), TOOLS)
    text = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo}", "days": 2}}\n</tool_call>'
    events = []
    for i in range(0, len(text), 4):
        events += stream.feed(text[i:i + 4])
    events += stream.finish()
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["content", "call_start"] and kinds[-1] == "call_end"
    fragments = [v[1] for k, v in events if k == "arguments"]
    assert len(fragments) > 3 and "".join(fragments) == '{"city": "Oslo}", "days": 2}'
    whole = split_tool_calls(HermesParser(), TOOLS, text)[1][0]
    assert stream.calls[0].arguments == "".join(fragments) == whole.arguments


def test_content_that_may_begin_markup_is_held_back_until_decided():
    stream = ToolCallStream(HermesParser(), TOOLS)
    assert stream.feed("Hi <tool") == [("content", "Hi ")]
    assert stream.feed("box>") == [("content", "<toolbox>")]


# -- rendering ------------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [ToolCall("get_weather", '{"city": "Paris"}', id="c1")]},
    {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
]


def test_the_hermes_fallback_puts_tools_in_the_system_turn_and_renders_calls_and_results():
    rendered = hermes_messages([{"role": "system", "content": "Be brief."}, *HISTORY], [WEATHER])
    tools_json = json.dumps({"type": "function", "function": {"name": "get_weather", "description":
                                                              "Weather in a city", "parameters": WEATHER.parameters}})
    assert rendered == [
        {"role": "system", "content": "Be brief.\n\n" + HERMES_FALLBACK.format(tools=tools_json)},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                         "</tool_call>"},
        {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n"
                                    "</tool_response>"},
    ]
    assert "<tool_call>" in HERMES_FALLBACK and '"arguments"' in HERMES_FALLBACK  # what HermesParser reads


def test_a_template_with_a_tools_section_renders_them_itself():
    tokenizer = char_tokenizer()
    tokenizer.hf.chat_template = (
        "{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}{% for m in messages %}"
        "[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %};{% endfor %}>> ")
    ids = render_prompt(tokenizer, HISTORY[:3], [WEATHER])
    assert tokenizer.decode(ids) == "TOOL get_weather;[user]Weather in Paris?;[assistant]CALL get_weather Paris;" \
                                    "[tool]18 C;>> "


# -- a forced call that ended before its markup closed ------------------------------------------
@pytest.mark.parametrize(("parser", "text", "name", "arguments"), [
    (HermesParser(), '<tool_cal', "", ""),  # cut inside the opening marker: the choice names no tool
    (HermesParser(), '<tool_call>\n{"name": "get_wea', "", ""),
    (HermesParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "get_weather",
     '{"city": "Par'),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Par', "get_weather", '{"city": "Par'),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_time", "parameters": {', "get_time", "{"),
])
def test_a_forced_call_cut_short_is_the_call_so_far_marked_incomplete(parser, text, name, arguments):
    from mtplx.server.tools import ToolChoice

    content, [call] = split_tool_calls(parser, TOOLS, text, ToolChoice("required"))
    assert (content, call.name, call.arguments, call.complete) == ("", name, arguments, False)
    _, [named] = split_tool_calls(parser, TOOLS, text, ToolChoice("function", "get_time"))
    assert named.name == (name or "get_time") and not named.complete  # a named choice names it
    assert split_tool_calls(parser, TOOLS, text)[1] == []  # not forced: the text stays content
    whole = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    assert split_tool_calls(HermesParser(), TOOLS, whole, ToolChoice("required"))[1][0].complete


@pytest.mark.parametrize("finish", ["length", "stop", "cancelled"])
def test_a_cut_forced_call_keeps_why_the_reply_ended_in_every_protocol(finish):
    """Only a complete call ends a reply as "tool_calls" / "tool_use" / a completed item: one
    that max_tokens, a stop string or a cancel cut keeps that reason."""
    from types import SimpleNamespace

    from mtplx.batching.job import JobResult
    from mtplx.server.anthropic import MessageShape
    from mtplx.server.protocol import ResponseShape
    from mtplx.server.responses import ResponseObject, ResponsesRequest
    from mtplx.server.tools import ToolChoice

    forced, text = ToolChoice("function", "get_weather"), '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    result = JobResult(text, [1, 2, 3], finish, 5, 3, {})
    chat = ResponseShape(True, "m", False, tools=TOOLS, parser=HermesParser(), choice=forced).whole([result])
    [call] = chat["choices"][0]["message"]["tool_calls"]
    assert chat["choices"][0]["finish_reason"] == finish and call["function"]["arguments"] == '{"ci'
    engine = SimpleNamespace(generator=SimpleNamespace(eos_token_ids={0}),
                             tokenizer=SimpleNamespace(decode=lambda ids: text + '"'))
    message = MessageShape("m", TOOLS, HermesParser(), ['"'], engine, 5, forced).whole([result])
    want = {"length": "max_tokens", "stop": "stop_sequence", "cancelled": "cancelled"}[finish]
    assert message["stop_reason"] == want and message["content"][0]["input"] == {}
    body = ResponsesRequest(model="m", input="hi")
    reply = ResponseObject(body, TOOLS, HermesParser(), forced).whole([result])
    assert reply["output"][0]["status"] == "incomplete"
    assert reply["status"] == ("completed" if finish == "stop" else "incomplete")
    if finish == "cancelled":
        assert reply["incomplete_details"] == {"reason": "cancelled"}


def test_a_streamed_call_whose_block_ends_unparsed_is_incomplete():
    """Arguments that streamed once the name showed: a block the end cut (or that turns out
    malformed) closes with what was sent, and the call says it is not whole."""
    for text, whole in (('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', True),
                        ('<tool_call>{"name": "get_time", "arguments": {"zone": "U', False)):
        stream = ToolCallStream(HermesParser(), TOOLS)
        for i in range(0, len(text), 7):
            stream.feed(text[i:i + 7])
        stream.finish()
        assert [(c.name, c.complete) for c in stream.calls] == [("get_time", whole)]


def test_an_auto_call_whose_block_closed_malformed_stays_the_models_call():
    """A block that closed (the model ended its call) but does not parse whole, e.g. one brace
    too many, ends with the arguments sent and stays complete: only an end inside the markup
    (max_tokens, a stop, a cancel) makes a call incomplete."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}}\n</tool_call>'
    stream = ToolCallStream(HermesParser(), TOOLS)
    for i in range(0, len(text), 5):
        stream.feed(text[i:i + 5])
    stream.finish()
    assert [(c.name, c.arguments, c.complete) for c in stream.calls] == [("get_time", '{"zone": "UTC"}', True)]


def test_a_forced_call_cut_after_its_name_keeps_the_name():
    from mtplx.server.tools import ToolChoice

    for parser, text in ((HermesParser(), '<tool_call>\n{"name": "get_weather", "arguments": '),
                         (Llama3JsonParser(), '{"name": "get_weather", "parameters":')):
        _, [call] = split_tool_calls(parser, TOOLS, text, ToolChoice("required"))
        assert (call.name, call.arguments, call.complete) == ("get_weather", "", False)


def test_a_grammar_engines_log_prefix_is_cut_from_its_message():
    from mtplx.engine.constraints import _LOG_PREFIX

    raw = "[10:24:48] /project/cpp/regex_converter.cc:94: Regex parsing error at position 3: Lookbehind"
    assert _LOG_PREFIX.sub("", raw) == "Regex parsing error at position 3: Lookbehind"
