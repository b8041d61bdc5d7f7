"""Grammars for requests whose output must follow a shape: ``response_format`` (json_object,
json_schema) and forced tool calls (``tool_choice`` "required" or a named function). The
grammars are xgrammar's (engine/constraints.py), compiled per request against the server's
tokenizer; the engine masks every decoded position with them, MTP drafts included."""

from __future__ import annotations

import functools
import re

from mtplx.engine.constraints import Grammar, GrammarCompiler
from mtplx.server.errors import APIError, bad_param
from mtplx.server.tools import HermesParser, Llama3JsonParser, Tool, ToolChoice, check_schema


SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a json_schema response format's name (OpenAI's pattern)


@functools.lru_cache(maxsize=4)
def compiler_for(engine) -> GrammarCompiler:
    """The engine's grammar compiler (its tokenizer's token table, built on first use: ~0.2 s
    for a 49k vocabulary)."""
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer files, so output cannot be constrained to a grammar",
                       code="unsupported_value")
    return GrammarCompiler(engine.tokenizer.hf, engine.config.vocab_size, sorted(engine.generator.eos_token_ids))


def response_format_grammar(engine, raw, param: str = "response_format", spec_at: str | None = None) -> Grammar | None:
    """None for text; the grammar of a JSON object (``json_object``) or of JSON valid against
    the schema (``json_schema``; ``strict`` or not, the output follows the schema). spec_at:
    where the request holds the json_schema spec, for errors (default ``param``.json_schema;
    Responses' ``text.format`` holds it flat). The spec's ``name`` is required, as OpenAI's
    pattern has it: 1-64 letters, digits, _ or -."""
    spec_at = f"{param}.json_schema" if spec_at is None else spec_at
    if raw is None or raw == {"type": "text"}:
        return None
    if not isinstance(raw, dict):
        raise bad_param(param, f"must be an object such as {{\"type\": \"json_object\"}}, got {raw!r}")
    kind = raw.get("type")
    if kind == "json_object":
        return compiler_for(engine).json_schema({"type": "object"}, param)
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_param(spec_at, "expected {'name': ..., 'schema': {...}, 'strict': ...}")
        name = spec.get("name")
        if not (isinstance(name, str) and SCHEMA_NAME.fullmatch(name)):
            raise bad_param(f"{spec_at}.name",
                            f"required, 1 to 64 letters, digits, underscores or dashes, got {name!r}")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise bad_param(f"{spec_at}.strict", f"expected a boolean, got {spec['strict']!r}")
        schema = check_schema(spec["schema"], f"{spec_at}.schema")
        return compiler_for(engine).json_schema(schema, f"{spec_at}.schema")
    raise bad_param(f"{param}.type", f"must be text, json_object or json_schema, got {kind!r}")


def tool_call_grammar(engine, tools: list[Tool], choice: ToolChoice, parser, param: str = "tool_choice",
                      schema_field: str = "parameters") -> Grammar | None:
    """For a forced choice, the grammar of one call in the parser's dialect to the named tool
    (or, for "required", to any offered tool) with arguments valid against its schema
    (``schema_field``: what the protocol calls it, for the errors)."""
    if not choice.forced:
        return None
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    if isinstance(parser, HermesParser) and type(parser) is HermesParser:
        options = [("<tool_call>\n", _call_schema(t, "arguments"), "\n</tool_call>") for t in chosen]
    elif isinstance(parser, Llama3JsonParser):
        options = [("", _call_schema(t, "parameters"), "") for t in chosen]
    else:
        raise APIError(400, f"{param}: forcing a call is supported in the hermes and llama3_json dialects, not in "
                            f"this model's {type(parser).__name__}", param=param, code="unsupported_value")
    return compiler_for(engine).tagged_json(options, f"tools ({', '.join(t.name for t in chosen)}) {schema_field}")


def _call_schema(tool: Tool, arguments_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters},
            "required": ["name", arguments_key], "additionalProperties": False}
