"""Grammar constraints and the budget guard's shortest completion."""

import json

import pytest

from grooves.policy.models import byte_tokenizer
from grooves.serve.grammar import GrammarError, Grammars, shortest_completion

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "score": {"type": "integer"},
                                           "unit": {"enum": ["c", "f"]}}, "required": ["title", "score", "unit"]}


@pytest.fixture(scope="module")
def grammars():
    tokenizer = byte_tokenizer()
    return Grammars(tokenizer, len(tokenizer))


@pytest.mark.parametrize("prefix", ['{"abc', '{"abc": "xyz', '{"abc": {"k": [1, "q', '{"a": [tr', "{"])
def test_completion_closes_open_json(grammars, prefix):
    matcher = grammars.json_object().matcher
    assert matcher.accept_string(prefix)
    completion = shortest_completion(matcher)
    assert isinstance(json.loads(prefix + completion), dict)


@pytest.mark.parametrize("prefix", ['{"title": "ab', '{"title": "ab", "score": 12', '{"title": "x", "score": 3, "unit": "'])
def test_completion_fills_required_keys_in_order(grammars, prefix):
    matcher = grammars.for_schema(SCHEMA).matcher
    assert matcher.accept_string(prefix)
    data = json.loads(prefix + shortest_completion(matcher))
    assert set(data) == {"title", "score", "unit"} and data["unit"] in ("c", "f")


def test_completion_does_not_touch_the_rows_matcher(grammars):
    matcher = grammars.json_object().matcher
    matcher.accept_string('{"k": "v')
    shortest_completion(matcher)
    assert matcher.accept_string('w"}')  # still where it was


def test_schema_key_order_is_kept_and_bad_schemas_are_errors(grammars):
    constraint = grammars.tool_call([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}])
    matcher = constraint.matcher
    assert matcher.accept_string('{"name": "f", "arguments": {"x": 1}}') and matcher.is_completed()
    with pytest.raises(GrammarError, match="not among the request's tools"):
        grammars.tool_call([{"type": "function", "function": {"name": "f"}}], "g")
    with pytest.raises(GrammarError, match="cannot use this JSON schema"):
        grammars.for_schema({"type": "object", "properties": {"x": {"type": "no-such-type"}}})
