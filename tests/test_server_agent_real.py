"""Agents against the real ``mtplx serve`` (the default SmolLM2-135M-Instruct, which has no
tools section in its chat template and never calls tools unprompted), through the official
``openai`` and ``anthropic`` SDKs and LangChain, in serial and mtp_batch modes: forced tool
calls and json_schema outputs validate against their schemas (jsonschema) and keep MTP."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest

from tests.serve_process import MODEL, ServeProcess

pytestmark = pytest.mark.slow

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_ARGS}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
CAPITAL = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 24},
                                            "capital": {"type": "string", "maxLength": 24},
                                            "population_millions": {"type": "integer", "minimum": 0,
                                                                    "maximum": 2000}},
           "required": ["country", "capital", "population_millions"], "additionalProperties": False}


MODES = ["serial", "mtp_batch"]
# Two servers cost ~40 s of start-up on a 2-core CPU, so each mode runs the checks that matter
# for it: everything in serial, the batched paths (forced calls, concurrent constrained rows) in mtp_batch.


@pytest.fixture(scope="module", params=MODES)
def server(request, tmp_path_factory, default_gguf):
    served = ServeProcess(tmp_path_factory.mktemp("agent"), "--scheduler-mode", request.param,
                          "--log-level", "warning").wait_ready()
    served.mode = request.param
    yield served
    served.kill()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def serial_only(server) -> None:
    if server.mode != "serial":
        pytest.skip("run in serial mode only (start-up budget)")


def test_forced_tool_calls_validate_and_keep_mtp(oai, server):
    choice = {"type": "function", "function": {"name": "get_weather"}} if server.mode == "serial" else "required"
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                    max_tokens=80, temperature=0)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)
    stats = r.model_extra["mtplx_stats"]
    assert stats["generation_mode"] == "mtp" and stats["accepted_tokens"] > 0


def test_a_streamed_forced_tool_call_validates(oai, server):
    serial_only(server)
    arguments, names, ids, reason = "", "", set(), None
    for chunk in oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                             max_tokens=80, temperature=0.7, seed=3, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                ids.add(d.id) if d.id else None
                names += d.function.name or ""
                arguments += d.function.arguments or ""
            reason = c.finish_reason or reason
    assert (names, reason, len(ids)) == ("get_weather", "tool_calls", 1)
    jsonschema.validate(json.loads(arguments), WEATHER_ARGS)


def test_json_schema_outputs_validate_concurrently_and_report_accepted_drafts(oai, server):
    def ask(country: str):
        return oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Give the capital of {country} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL,
                                                                    "strict": True}},
            max_tokens=80, temperature=0)

    countries = ["France", "Japan", "Peru"] if server.mode == "mtp_batch" else ["France"]
    with ThreadPoolExecutor(3) as pool:  # in mtp_batch these share verify forwards
        results = list(pool.map(ask, countries))
    for r in results:
        jsonschema.validate(json.loads(r.choices[0].message.content), CAPITAL)
        assert r.choices[0].finish_reason == "stop"
    assert sum(r.model_extra["mtplx_stats"]["accepted_tokens"] for r in results) > 0


def test_anthropic_forced_tool_use_through_the_sdk(server):
    serial_only(server)
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_ARGS}
    with client.messages.stream(model=MODEL, max_tokens=80, messages=ASK, tools=[tool],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    [use] = final.content
    assert use.type == "tool_use" and final.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER_ARGS)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds


def test_langchain_bind_tools_and_with_structured_output(server):
    serial_only(server)
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        """The capital of a country."""

        country: str = Field(max_length=24)
        capital: str = Field(max_length=24)

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=80,
                     max_retries=0, timeout=120)
    answer = llm.with_structured_output(Capital).invoke("What is the capital of France?")
    assert isinstance(answer, Capital) and answer.capital
    by_tool = llm.with_structured_output(Capital, method="function_calling").invoke("What is the capital of Peru?")
    assert isinstance(by_tool, Capital)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_ARGS)


def test_logprob_bytes_rebuild_the_text_where_tokens_split_characters(oai, server):
    """Byte-level tokens that hold part of a UTF-8 character (an emoji, an accented letter): each
    entry's bytes are the token's own, so their concatenation is the text's UTF-8; such a token
    reads as \\xNN escapes of its bytes (OpenAI's spelling), not as U+FFFD."""
    serial_only(server)
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Repeat exactly: 🐉 café ça"}],
                                    max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    entries = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert bytes(b for e in entries for b in e.bytes) == text.encode("utf-8")
    assert not text.isascii()  # characters of several bytes, some split over tokens
    for e in entries + [t for e in entries for t in e.top_logprobs]:
        assert e.token == bytes(e.bytes).decode("utf-8", errors="backslashreplace") and "\ufffd" not in e.token
    assert any("\\x" in e.token for e in entries)
    completion = oai.completions.create(model=MODEL, prompt="Dragon emoji: 🐉 and café:", max_tokens=8,
                                        temperature=0, logprobs=3)
    lp = completion.choices[0].logprobs
    text = completion.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for token, at in zip(lp.tokens, lp.text_offset):  # a whole token's text stands at its offset
        if "\\x" not in token:
            assert text[at:at + len(token)] == token, (token, at, text)
    echoed = oai.completions.create(model=MODEL, prompt="<|im_start|>user\nHi 🐉<|im_end|>\n", max_tokens=4,
                                    temperature=0, logprobs=1, echo=True)
    lp, text = echoed.choices[0].logprobs, echoed.choices[0].text
    assert lp.tokens[0] == "<|im_start|>" and lp.text_offset[-1] <= len(text)
    for token, at in list(zip(lp.tokens, lp.text_offset))[:echoed.usage.prompt_tokens]:  # the echoed prompt
        if "\\x" not in token:  # holds its control tokens' literal text: they take their place in it
            assert text[at:at + len(token)] == token, (token, at, text)


def test_streamed_chunks_carry_the_logprobs_of_their_own_text_under_a_stop_string(oai, server):
    """A stop string holds back text that may be its start; the tokens of that text (and their
    logprobs) wait with it, so each chunk's logprob tokens spell that chunk's content, and
    nothing past the stop is sent (MTP at depth 3 commits several tokens a cycle)."""
    serial_only(server)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 20 separated by commas."}],
                  max_tokens=40, temperature=0, logprobs=True, stop=["9,"])
    whole = oai.chat.completions.create(extra_body={"generation_mode": "ar"}, **kwargs)
    chunks = list(oai.chat.completions.create(stream=True, extra_body={"generation_mode": "mtp", "depth": 3}, **kwargs))
    pairs = [(c.choices[0].delta.content or "", bytes(b for e in c.choices[0].logprobs.content for b in e.bytes).decode())
             for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert len(pairs) > 3 and all(text == spelled for text, spelled in pairs[:-1]), pairs
    assert "".join(t for t, _ in pairs) == whole.choices[0].message.content
    assert "".join(s for _, s in pairs).startswith(whole.choices[0].message.content)  # the last: through the stop
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) \
        == len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens


def test_logprobs_agree_between_ar_and_mtp(oai, server):
    serial_only(server)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=16,
                  temperature=0, logprobs=True, top_logprobs=3)
    mtp = oai.chat.completions.create(extra_body={"generation_mode": "mtp"}, **kwargs)
    ar = oai.chat.completions.create(extra_body={"generation_mode": "ar"}, **kwargs)
    assert mtp.model_extra["mtplx_stats"]["accepted_tokens"] > 0  # some entries came from accepted drafts
    a, m = ar.choices[0].logprobs.content, mtp.choices[0].logprobs.content
    assert [e.token for e in a] == [e.token for e in m] and len(a) == mtp.usage.completion_tokens
    # Alone, the two decodes' logprobs are equal; after the earlier tests' requests (a warm prefix
    # cache) they differ: 9.6e-4 at most with int16 activations on a scale per 32 inputs, 3.2e-3
    # with AVX2's scale per row (session 35), and on AVX2 7.1e-3 at the first token with session
    # 44's attention by spans of keys (3.1e-3 at most after it). The cause is not pinned down.
    # The prompt's uncached tail is prefilled in calls of other sizes, whose paths (the one-call C++
    # layer up to 16 rows, the layers' own forward beyond) differ in the last bits, and the
    # products' rounding turns that into up to one rounding step. Sending each mode's request once
    # before did not make them equal (AVX2: every position still differed, by up to 3.1e-3 before
    # the spans and 7.1e-3 after, session 44), likely because the blocks both then find cached
    # were themselves written by calls of different sizes (the system prompt's MTP blocks by the
    # earlier tests' requests, AR's by a whole-prompt forward), and every later token reads them.
    assert [e.logprob for e in m] == pytest.approx([e.logprob for e in a], abs=1e-2)
    assert [[t.token for t in e.top_logprobs] for e in m] == [[t.token for t in e.top_logprobs] for e in a]
