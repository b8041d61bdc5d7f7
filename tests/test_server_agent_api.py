"""The agent-facing API on a real uvicorn server with a tiny engine, through the official
``openai`` and ``anthropic`` SDKs: n completions, tools offered, Anthropic Messages (and
count_tokens), OpenAI Responses. References come from the engine alone, before serving, or
from the same conversation sent through another protocol."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

from mtplx.server.app import create_app
from tests.test_server_harness import running_server, tiny_text_engine

MODEL = "tiny"
KEY = "sk-agent-test"
CHAT = [{"role": "user", "content": "Tell me a story"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def engine():
    return tiny_text_engine(head="repeat", context=4096)


PREFILL = CHAT + [{"role": "assistant", "content": "Once"}]


@pytest.fixture(scope="module")
def refs(engine):
    prefilled = engine.tokenizer.apply_chat_template(PREFILL, add_generation_prompt=False, continue_final_message=True)
    return {"chat": engine.generate(CHAT, chat=True, max_tokens=16, temperature=0.0),
            "prefill": (len(prefilled), engine.generate(prefilled, max_tokens=8, temperature=0.0).text),
            "sampled": [engine.generate(CHAT, chat=True, max_tokens=12, temperature=1.0, seed=s) for s in (7, 8, 9)]}


@pytest.fixture(scope="module")
def url(engine, refs):
    with running_server(create_app(engine, model_id=MODEL, api_key=KEY)) as base:
        yield base


@pytest.fixture
def oai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


def sse_events(response: httpx.Response) -> list[tuple[str | None, dict | str]]:
    out, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            out.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return out


# -- n ----------------------------------------------------------------------------------------
def test_n_completions_each_with_its_own_seed_stream(oai, refs):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, n=3, seed=7, max_tokens=12, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [ref.text for ref in refs["sampled"]]  # seeds 7, 8, 9
    assert r.usage.completion_tokens == sum(len(ref.token_ids) for ref in refs["sampled"])
    assert r.usage.prompt_tokens == refs["sampled"][0].prompt_tokens
    later = r.model_extra["mtplx_choice_stats"][1:]
    assert all(s["cached_prompt_tokens"] > 0 for s in later)  # the prompt's KV came from the prefix cache


def test_n_completions_stream_with_their_indices(oai, refs):
    texts = ["", "", ""]
    finished = set()
    for chunk in oai.chat.completions.create(model=MODEL, messages=CHAT, n=3, seed=7, max_tokens=12,
                                             temperature=1.0, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
        if chunk.usage:
            usage = chunk.usage
    assert texts == [ref.text for ref in refs["sampled"]] and finished == {0, 1, 2}
    assert usage.completion_tokens == sum(len(ref.token_ids) for ref in refs["sampled"])


def test_n_text_completions(oai, engine):
    r = oai.completions.create(model=MODEL, prompt="The sea", n=2, seed=3, max_tokens=8, temperature=1.0)
    assert [c.text for c in r.choices] == [engine.generate("The sea", max_tokens=8, temperature=1.0, seed=s).text
                                           for s in (3, 4)]


# -- tools offered ------------------------------------------------------------------------------
def test_offered_tools_reach_the_prompt_and_plain_output_stays_content(oai, refs, engine):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], max_tokens=16, temperature=0)
    plain = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    # the Hermes fallback adds a system turn listing the tool
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + len(json.dumps(WEATHER))
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length"
    # tool_choice "none": the tools are not shown
    none = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice="none",
                                       max_tokens=16, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == refs["chat"].text


def test_a_conversation_with_tool_calls_and_results_is_accepted(oai):
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    r = oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


CITY = {"type": "function", "function": {"name": "get_city", "description": "A city's facts", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"], "additionalProperties": False}}}
ZONE = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_city"}}])
def test_a_forced_tool_call_has_arguments_valid_for_its_schema(oai, choice):
    """Even a random tiny model calls the tool: the grammar forces the markup and the arguments."""
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=[ZONE, CITY], tool_choice=choice,
                                    max_tokens=120, temperature=0.8, seed=1)
    [call] = r.choices[0].message.tool_calls
    assert choice == "required" or call.function.name == "get_city"
    schema = {"get_city": CITY, "get_time": ZONE}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert r.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_") and call.type == "function"
    assert r.model_extra["mtplx_stats"]["drafted_tokens"] > 0  # a constrained request still drafts (MTP)


def test_a_forced_tool_call_streams_as_delta_tool_calls(oai):
    kwargs = dict(model=MODEL, messages=CHAT, tools=[CITY], tool_choice="required", max_tokens=120, seed=5,
                  temperature=0.8)
    whole = oai.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    name, fragments, ids, reasons = "", [], set(), []
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                assert d.index == 0
                ids.add(d.id) if d.id else None
                name += d.function.name or ""
                fragments += [d.function.arguments] if d.function.arguments else []
            reasons.append(c.finish_reason)
    assert (name, "".join(fragments)) == (whole.function.name, whole.function.arguments) and len(ids) == 1
    assert len(fragments) > 1  # the arguments stream as they are decoded
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


@pytest.mark.parametrize("max_tokens", [2, 20, 55])
def test_a_forced_tool_call_cut_by_max_tokens_is_the_call_so_far(oai, claude, url, max_tokens):
    """max_tokens may cut a forced call before its markup closes (before its name shows at 2
    tokens): the reply is the call so far, finish_reason "length", never the dialect's markup as
    content; streamed and whole replies agree. Anthropic's tool_use input is then {} (its stream
    sent the partial JSON); a Responses item the end cut is "incomplete"."""
    kwargs = dict(model=MODEL, messages=CHAT, tools=[CITY], tool_choice={"type": "function", "function": {
        "name": "get_city"}}, max_tokens=max_tokens, seed=5, temperature=0.8)
    full = oai.chat.completions.create(**{**kwargs, "max_tokens": 120}).choices[0].message.tool_calls[0]
    r = oai.chat.completions.create(**kwargs)
    message, [call] = r.choices[0].message, r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length" and message.content is None and r.usage.completion_tokens == max_tokens
    assert call.function.name == "get_city" and full.function.arguments.startswith(call.function.arguments)
    assert len(call.function.arguments) < len(full.function.arguments)
    name, arguments, reasons, content = "", "", [], ""
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                name += d.function.name or ""
                arguments += d.function.arguments or ""
            reasons.append(c.finish_reason)
    assert (content, name, arguments, reasons[-1]) == ("", "get_city", call.function.arguments, "length")

    tool = {"name": "get_city", "input_schema": CITY["function"]["parameters"]}
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": CHAT, "tools": [tool], "temperature": 0.8,
            "tool_choice": {"type": "tool", "name": "get_city"}}
    m = claude.messages.create(**{k: v for k, v in body.items() if k != "temperature"},
                               extra_body={"temperature": 0.8})
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "get_city")] and m.stop_reason == "max_tokens"
    with httpx.stream("POST", f"{url}/v1/messages", headers={"x-api-key": KEY}, json={**body, "stream": True}) as s:
        events = sse_events(s)
    assert [e["content_block"]["type"] for n, e in events if n == "content_block_start"] == ["tool_use"]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"

    fn = {"type": "function", "name": "get_city", "parameters": CITY["function"]["parameters"]}
    reply = oai.responses.create(model=MODEL, input=CHAT, tools=[fn], tool_choice="required", temperature=0.8,
                                 max_output_tokens=max_tokens)
    assert reply.status == "incomplete" and [(i.type, i.name, i.status) for i in reply.output] == [
        ("function_call", "get_city", "incomplete")]
    done = [e for e in oai.responses.create(model=MODEL, input=CHAT, tools=[fn], tool_choice="required",
                                            temperature=0.8, max_output_tokens=max_tokens, stream=True)][-1]
    assert done.type == "response.incomplete" and done.response.output[0].status == "incomplete"


def test_response_format_json_schema_output_validates(oai):
    schema = CITY["function"]["parameters"]
    for n, temperature in ((1, 0.0), (2, 1.0)):
        r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=temperature, n=n,
                                        response_format={"type": "json_schema", "json_schema": {
                                            "name": "city", "schema": schema, "strict": True}})
        for choice in r.choices:
            jsonschema.validate(json.loads(choice.message.content), schema)
            assert choice.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"


# -- Anthropic Messages ---------------------------------------------------------------------------
# (the anthropic SDK 2.x has no temperature argument; the API still takes it, so it goes in extra_body)
def test_anthropic_message_matches_the_engine(claude, refs):
    ref = refs["chat"]
    m = claude.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=CHAT)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.input_tokens == ref.prompt_tokens and m.usage.output_tokens == len(ref.token_ids)


def test_anthropic_stream_events_in_order_and_the_sdk_assembles_the_same_message(claude, url, refs):
    with claude.messages.stream(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                                messages=CHAT) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == refs["chat"].text and final.stop_reason == "max_tokens"
    with httpx.stream("POST", f"{url}/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      json={"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": CHAT,
                            "stream": True}) as r:
        events = sse_events(r)
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas >= 1
    assert events[0][1]["message"]["usage"]["input_tokens"] == refs["chat"].prompt_tokens
    assert events[-2][1]["usage"]["output_tokens"] == len(refs["chat"].token_ids)


def test_anthropic_system_and_stop_sequences(claude, engine, refs):
    stop = refs["chat"].text[6:8]
    m = claude.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=CHAT,
                               stop_sequences=[stop, "@@"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == refs["chat"].text[:refs["chat"].text.index(stop)]
    sys_ref = engine.generate([{"role": "system", "content": "Be brief."}, *CHAT], chat=True, max_tokens=6,
                              temperature=0.0)
    m = claude.messages.create(model=MODEL, max_tokens=6, extra_body={"temperature": 0}, system="Be brief.",
                               messages=CHAT)
    assert m.content[0].text == sys_ref.text and m.usage.input_tokens == sys_ref.prompt_tokens


def test_anthropic_tool_use_history_renders_as_the_openai_one(claude, oai):
    """count_tokens of an Anthropic conversation with tool_use / tool_result blocks equals the
    prompt of the same conversation sent as OpenAI messages."""
    tool = {"name": "get_weather", "description": "Weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    turns = [*CHAT, {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
        "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C"},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    counted = claude.messages.count_tokens(model=MODEL, messages=turns, tools=[tool], system="Be brief.")
    same = [{"role": "system", "content": "Be brief."}, *CHAT,
            {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "-3 C"},
            {"role": "user", "content": "And tomorrow?"}]
    r = oai.chat.completions.create(model=MODEL, messages=same, tools=[WEATHER], max_tokens=1, temperature=0)
    assert counted.input_tokens == r.usage.prompt_tokens
    m = claude.messages.create(model=MODEL, max_tokens=3, extra_body={"temperature": 0}, messages=turns,
                               tools=[tool], system="Be brief.")
    assert m.usage.input_tokens == counted.input_tokens


def test_chat_refuses_tool_turns_openai_refuses(oai):
    """A tool message that answers no tool call of the assistant message before it, and tool
    calls that the next messages leave unanswered, are 400s naming where (as OpenAI's API); a
    last assistant message's calls and a whole exchange pass."""
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    answer = lambda i: {"role": "tool", "tool_call_id": i, "content": "-3 C"}  # noqa: E731
    for messages, param in (([*CHAT, answer("call_1")], "messages.1.tool_call_id"),
                            ([*CHAT, call, answer("call_9")], "messages.2.tool_call_id"),
                            ([*CHAT, call, *CHAT], "messages.2")):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=1)
        assert err.value.body["param"] == param
    for messages in ([*CHAT, call], [*CHAT, call, answer("call_1"), *CHAT]):
        assert oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=1)


def test_anthropic_refuses_histories_its_api_refuses(claude):
    """A tool_result for a tool_use the turn before did not make, a tool_use left unanswered by
    the next turn, an empty text block or an empty turn are 400s naming where (Anthropic's API
    refuses each; rendered, they made a prompt of calls and results that do not pair). A last
    assistant turn that calls a tool, and an empty last assistant turn, stay allowed."""
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                              "input": {"city": "Oslo"}}]}
    result = lambda i: {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "-3 C"}]}  # noqa: E731
    both = {"role": "user", "content": result("toolu_1")["content"] + result("toolu_9")["content"]}
    late = {"role": "user", "content": [{"type": "text", "text": "so?"}, *result("toolu_1")["content"]]}
    for messages, param in (([*CHAT, call, result("toolu_9")], "messages.2.content.0.tool_use_id"),  # a typo
                            ([*CHAT, call, both], "messages.2.content.1.tool_use_id"),
                            ([*CHAT, call, late], "messages.2.content.1"),  # results come first
                            ([*CHAT, call, {"role": "user", "content": "and?"}], "messages.2.content"),
                            ([{"role": "user", "content": [{"type": "text", "text": "  "}]}], "messages.0.content.0.text"),
                            ([*CHAT, call, *CHAT], "messages.2.content"),
                            ([{"role": "user", "content": [{"type": "text", "text": ""}]}], "messages.0.content.0.text"),
                            ([{"role": "user", "content": ""}, *CHAT], "messages.0.content"),
                            ([result("toolu_1")], "messages.0.content.0.tool_use_id")):
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(model=MODEL, max_tokens=2, messages=messages, tools=[tool])
        assert err.value.body["error"]["message"].startswith(param + ":"), (param, err.value.body)
    for messages in ([*CHAT, call, result("toolu_1")], [*CHAT, {"role": "assistant", "content": ""}]):
        assert claude.messages.count_tokens(model=MODEL, messages=messages, tools=[tool]).input_tokens > 0


def test_anthropic_forced_tool_use_streams_in_order(claude, url):
    tool = {"name": "get_city", "input_schema": CITY["function"]["parameters"]}
    m = claude.messages.create(model=MODEL, max_tokens=120, messages=CHAT, tools=[tool],
                               tool_choice={"type": "tool", "name": "get_city"}, extra_body={"temperature": 0.5})
    [use] = [b for b in m.content if b.type == "tool_use"]
    jsonschema.validate(use.input, tool["input_schema"])
    assert m.stop_reason == "tool_use" and use.id.startswith("toolu_")
    with httpx.stream("POST", f"{url}/v1/messages", headers={"x-api-key": KEY}, json={
            "model": MODEL, "max_tokens": 120, "messages": CHAT, "tools": [tool], "stream": True,
            "tool_choice": {"type": "any"}, "temperature": 0.5}) as r:
        events = sse_events(r)
    names = [n for n, _ in events]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas > 1  # the input streams
    assert events[2][1]["content_block"]["type"] == "tool_use"
    streamed = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    jsonschema.validate(json.loads(streamed), tool["input_schema"])
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_errors_in_anthropic_shape(claude, url):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-opus", max_tokens=4, messages=CHAT)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=0, messages=CHAT)
    error = err.value.body["error"]
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]
    with pytest.raises(anthropic.BadRequestError, match="tool_choice.name"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=CHAT, tool_choice={"type": "tool", "name": "g"},
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=CHAT)
    r = httpx.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, json={"model": MODEL, "messages": CHAT})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"  # max_tokens is required
    with pytest.raises(anthropic.BadRequestError, match="temperature"):  # Anthropic's range is [0, 1]
        claude.messages.create(model=MODEL, max_tokens=4, messages=CHAT, extra_body={"temperature": 1.5})


# -- Responses --------------------------------------------------------------------------------
def test_responses_text_output_matches_the_engine(oai, refs):
    ref = refs["chat"]
    r = oai.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=16, temperature=0)
    assert r.output_text == ref.text and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == ref.prompt_tokens and r.usage.output_tokens == len(ref.token_ids)
    items = oai.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Tell me a story"}]}], max_output_tokens=16, temperature=0)
    assert items.output_text == ref.text


def test_responses_stream_events(oai, refs):
    kinds, text = [], ""
    for event in oai.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=16, temperature=0,
                                      stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        final = event
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert text == refs["chat"].text == final.response.output_text


def test_responses_function_call_items_render_as_chat_tool_calls(oai):
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city",
            "parameters": WEATHER["function"]["parameters"]}
    items = [{"role": "user", "content": "Tell me a story"},
             {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_9", "output": "-3 C"}]
    r = oai.responses.create(model=MODEL, input=items, tools=[tool], instructions="Be brief.",
                             max_output_tokens=1, temperature=0)
    same = [{"role": "system", "content": "Be brief."}, *CHAT,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "-3 C"}]
    chat = oai.chat.completions.create(model=MODEL, messages=same, tools=[WEATHER], max_tokens=1, temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_forced_function_call_and_json_schema(oai):
    tool = {"type": "function", "name": "get_city", "parameters": CITY["function"]["parameters"]}
    r = oai.responses.create(model=MODEL, input="Tell me a story", tools=[tool], tool_choice="required",
                             max_output_tokens=120, temperature=0.5)
    [call] = [item for item in r.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    assert call.name == "get_city" and r.status == "completed"
    r = oai.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=60, temperature=0, text={
        "format": {"type": "json_schema", "name": "city", "schema": tool["parameters"], "strict": True}})
    jsonschema.validate(json.loads(r.output_text), tool["parameters"])


def test_responses_stream_a_forced_function_call(oai):
    tool = {"type": "function", "name": "get_city", "parameters": CITY["function"]["parameters"]}
    kinds, deltas = [], ""
    for event in oai.responses.create(model=MODEL, input="Tell me a story", tools=[tool], tool_choice="required",
                                      max_output_tokens=120, temperature=0.5, stream=True):
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            deltas += event.delta
        final = event
    n = kinds.count("response.function_call_arguments.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * n, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"] and n > 1
    [call] = final.response.output
    assert call.type == "function_call" and call.arguments == deltas
    jsonschema.validate(json.loads(deltas), tool["parameters"])


def test_an_anthropic_prefill_is_continued(claude, refs):
    """A last assistant message is the start of the reply (Anthropic's prefill): its turn stays
    open, and the reply is what follows it; it was closed, and a new turn started over."""
    tokens, text = refs["prefill"]
    reply = claude.messages.create(model=MODEL, max_tokens=8, messages=PREFILL, extra_body={"temperature": 0})
    assert reply.usage.input_tokens == tokens and reply.content[0].text == text
    assert claude.messages.count_tokens(model=MODEL, messages=PREFILL).input_tokens == tokens
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=PREFILL, extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == text
    with pytest.raises(anthropic.BadRequestError, match="cannot end with whitespace"):
        claude.messages.create(model=MODEL, max_tokens=8, messages=CHAT + [{"role": "assistant", "content": "Once "}])


def test_a_response_echoes_the_temperature_it_sampled_at(oai):
    """Sent none, the Responses object echoes the server's default (OpenAI's 1.0 here); it was null."""
    assert oai.responses.create(model=MODEL, input="hi", max_output_tokens=2).temperature == 1.0
    assert oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0.3).temperature == 0.3


def test_responses_is_stateless(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_123", max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id" and "stateless" in err.value.body["message"]


@pytest.mark.parametrize("field, value", [("prompt", {"id": "pmpt_1"}), ("top_logprobs", 3), ("max_tool_calls", 1),
                                          ("truncation", "auto")])
def test_responses_refuse_fields_that_would_change_the_output(oai, field, value):
    """Fields this server does not implement are 400s naming them, not silently dropped;
    their neutral values pass."""
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body={field: value})
    assert err.value.body["param"] == field and err.value.body["code"] == "unsupported_value"
    neutral = {"top_logprobs": 0, "truncation": "disabled"}
    for bad in ({"top_logprobs": 21}, {"truncation": "bogus"}):  # out of range: invalid, not unsupported
        with pytest.raises(openai.BadRequestError) as err:
            oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body=bad)
        assert err.value.body["code"] == "invalid_value" and err.value.body["param"] in bad
    if field in neutral:
        assert oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body={field: neutral[field]})


def test_responses_completed_at_and_json_schema_errors_name_the_requests_own_paths(oai):
    """completed_at (Unix seconds) once completed, null while incomplete; a bad schema or
    name in text.format is reported where the request holds it (text.format.schema, not the
    chat route's json_schema.schema)."""
    done = oai.responses.create(model=MODEL, input="hi", max_output_tokens=200, temperature=0)
    cut = oai.responses.create(model=MODEL, input="hi", max_output_tokens=1, temperature=0)
    assert done.status == "completed" and abs(done.completed_at - time.time()) < 60
    assert cut.status == "incomplete" and cut.completed_at is None
    for fmt, param in (({"name": "x", "schema": {"type": "objekt"}}, "text.format.schema"),
                       ({"name": "no spaces", "schema": {"type": "object"}}, "text.format.name"),
                       ({"schema": {"type": "object"}}, "text.format.name")):
        with pytest.raises(openai.BadRequestError) as err:
            oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, text={
                "format": {"type": "json_schema", **fmt}})
        assert err.value.body["param"] == param
    for spec, param in (({"name": "a" * 65}, "name"), ({"name": "a", "strict": "yes"}, "strict")):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, response_format={
                "type": "json_schema", "json_schema": {**spec, "schema": {"type": "object"}}})
        assert err.value.body["param"] == f"response_format.json_schema.{param}"


def test_anthropic_names_its_own_fields_honours_seed_and_joins_text_blocks(claude, url):
    with pytest.raises(anthropic.BadRequestError, match="tools.0.input_schema"):
        claude.messages.create(model=MODEL, max_tokens=2, messages=CHAT,
                               tools=[{"name": "f", "input_schema": {"type": "objekt"}}])
    with pytest.raises(anthropic.BadRequestError, match="tools.0.input_schema: a custom tool needs an input_schema"):
        claude.messages.create(model=MODEL, max_tokens=2, messages=CHAT, tools=[{"name": "f"}])
    with pytest.raises(anthropic.BadRequestError, match="not supported in a user message"):  # was "an user"
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences: each stop sequence"):
        claude.messages.create(model=MODEL, max_tokens=2, messages=CHAT, stop_sequences=[""])
    texts = [claude.messages.create(model=MODEL, max_tokens=8, messages=CHAT,
                                    extra_body={"temperature": 1.0, "seed": 11}).content[0].text for _ in range(2)]
    assert texts[0] == texts[1]
    count = lambda system: claude.messages.count_tokens(model=MODEL, messages=CHAT, system=system).input_tokens  # noqa: E731
    assert count([{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]) == count("A\nB") != count("AB")


def test_responses_refuse_an_output_for_no_call_and_a_format_that_is_no_object(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, max_output_tokens=2, input=[
            {"type": "function_call_output", "call_id": "nope", "output": "x"}])
    assert err.value.body["param"] == "input.0.call_id"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, response_format="json")
    assert err.value.body["param"] == "response_format" and "must be an object" in err.value.body["message"]


def test_responses_refuse_a_temperature_past_2(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="hi", temperature=2.5, max_output_tokens=2)
    assert err.value.body["param"] == "temperature"


def test_responses_refuse_an_empty_conversation(oai):
    """input [] with no instructions leaves nothing to answer: a 400 naming input (a chat
    template refuses an empty conversation; this was a 500, found by the fuzz test)."""
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input=[], max_output_tokens=2)
    assert err.value.body["param"] == "input"
    reply = oai.responses.create(model=MODEL, input=[], instructions="Say hi.", max_output_tokens=2)
    assert reply.status in ("completed", "incomplete") and reply.output  # (2 tokens: cut by max_output_tokens)


# -- logprobs ---------------------------------------------------------------------------------
def test_chat_logprobs_whole_streamed_and_across_generation_modes(oai):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    whole = oai.chat.completions.create(**kwargs)
    entries = whole.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == whole.choices[0].message.content  # one character per token
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    streamed = [e for chunk in oai.chat.completions.create(stream=True, **kwargs) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    ar = oai.chat.completions.create(extra_body={"generation_mode": "ar"}, **kwargs).choices[0].logprobs.content
    for other in (streamed, ar):
        assert [e.token for e in other] == [e.token for e in entries]
        assert [e.logprob for e in other] == pytest.approx([e.logprob for e in entries], abs=1e-4)


def test_completion_logprobs_in_the_legacy_shape(oai):
    """The legacy shape: each position's top_logprobs holds the chosen token's too, so up to
    logprobs + 1 entries (OpenAI's reference; a sampled token outside the top was missing)."""
    r = oai.completions.create(model=MODEL, prompt="The sea", max_tokens=12, temperature=2.0, seed=5, logprobs=1)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset == list(range(len(lp.tokens)))
    assert all(top[token] == value and len(top) in (1, 2) and max(top.values()) >= value - 1e-6
               for top, token, value in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs)  # at T 2 some sampled token is not the top one
    none = oai.completions.create(model=MODEL, prompt="The sea", max_tokens=3, temperature=0, logprobs=0)
    assert [list(top) for top in none.choices[0].logprobs.top_logprobs] == [[t] for t in none.choices[0].logprobs.tokens]


def test_echo_scores_the_prompt_as_decoding_scored_the_same_tokens(oai):
    first = oai.completions.create(model=MODEL, prompt="The sea", max_tokens=5, temperature=0, logprobs=1)
    text, decoded = first.choices[0].text, first.choices[0].logprobs
    echoed = oai.completions.create(model=MODEL, prompt="The sea" + text, max_tokens=1, temperature=0, logprobs=1,
                                    echo=True)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith("The sea" + text) and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == echoed.choices[0].text  # one character per token
    scored = lp.token_logprobs[len("The sea"): len("The sea") + len(text)]  # the prefill's view of the same tokens
    assert scored == pytest.approx(decoded.token_logprobs, abs=1e-4)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="The sea", max_tokens=5, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == "The sea" + text


def test_echo_offsets_count_control_tokens_that_the_echoed_text_holds(oai, engine):
    """A token-id prompt echoes its control tokens as their text, and they take their place in
    text_offset; a BOS the tokenizer added to a text prompt is not in its text and takes none."""
    ids = engine.tokenizer.encode("<s>ab")
    assert engine.tokenizer.is_special(ids[0])
    r = oai.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=0, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("<s>ab") and lp.text_offset[:3] == [0, 3, 4]

    from mtplx.server.protocol import ResponseShape

    added = ResponseShape(False, MODEL, False, tokenizer=engine.tokenizer, echo=("<s>ab", [ids[0], *ids], 1))
    offsets = added.logprobs(0, [ids[0], *ids], [(None, None)] * 4, echoed=True)["text_offset"]
    assert offsets == [0, 0, 3, 4]  # the added BOS, then the typed one at the text's start


@pytest.mark.parametrize("kwargs, param", [(dict(top_logprobs=2), "top_logprobs"),
                                           (dict(logprobs=True, top_logprobs=21), "top_logprobs")])
def test_bad_logprobs_requests_are_400(oai, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **kwargs)
    assert err.value.body["param"] == param


# -- every scheduler mode -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["serial", "ar_batch", "mtp_batch", "hyper", "solo_mtp"])
def test_constrained_and_logprob_requests_run_in_every_scheduler_mode(engine, mode):
    """Two concurrent requests (a forced call with logprobs, a json_schema one) and a plain one."""
    from concurrent.futures import ThreadPoolExecutor

    from mtplx.batching.state import SchedulerSettings

    with running_server(create_app(engine, SchedulerSettings.resolve(mode), model_id=MODEL)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        common = dict(model=MODEL, messages=CHAT, max_tokens=80, temperature=0.7, seed=4)
        schema = CITY["function"]["parameters"]
        calls = [dict(tools=[CITY], tool_choice="required", logprobs=True, top_logprobs=2),
                 dict(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}),
                 dict(max_tokens=8)]
        with ThreadPoolExecutor(3) as pool:
            forced, structured, plain = pool.map(lambda extra: client.chat.completions.create(**{**common, **extra}),
                                                 calls)
    [call] = forced.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert len(forced.choices[0].logprobs.content) == forced.usage.completion_tokens
    jsonschema.validate(json.loads(structured.choices[0].message.content), schema)
    assert plain.usage.completion_tokens == 8
