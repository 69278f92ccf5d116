"""Grammar-constrained decoding on a tiny random-weight model.

Random weights make the model a random walk over the allowed tokens, so every schema-valid
output here comes from the constraint, not from the model knowing JSON.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools
from payloads import closed_object
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mlx_server.engine.grammar.constraints import (
    ConstraintCompiler,
    ConstraintError,
    ConstraintSpec,
    build_grammar,
    validate_schema,
    validate_spec,
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "<tool_call>\n</tool_call>\n",
    'true false null 0123456789 -1.5e3 "type": "object", "items": [1, 2, 3]',
    "The quick brown fox jumps over the lazy dog.",
]


def make_hf_tokenizer(extra_special: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: every byte is a token, plus a few hundred merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>"
    )


def make_model(vocab_size: int) -> llama.Model:
    mx.random.seed(1)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def tokenizer() -> TokenizerWrapper:
    return TokenizerWrapper(make_hf_tokenizer())


@pytest.fixture(scope="module")
def model(tokenizer: TokenizerWrapper) -> llama.Model:
    return make_model(len(tokenizer))


@pytest.fixture(scope="module")
def compiler(tokenizer: TokenizerWrapper) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer)


def generate(model, tokenizer, processors, *, max_tokens=300, seed=0):
    """Run one BatchGenerator over ``processors`` (one list per sequence)."""
    mx.random.seed(seed)
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        sampler=make_sampler(temp=1.0),
    )
    prompt = tokenizer.encode("Answer in JSON:")
    uids = gen.insert(
        [prompt] * len(processors),
        max_tokens=[max_tokens] * len(processors),
        logits_processors=processors,
    )
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    finish: dict[int, str] = {}
    deadline = time.monotonic() + 120
    while len(finish) < len(uids):
        assert time.monotonic() < deadline, f"unfinished after 120 s: {finish}"
        for r in gen.next_generated():
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                finish[r.uid] = r.finish_reason
    gen.close()
    results = []
    for u in uids:
        ids = [t for t in tokens[u] if t not in tokenizer.eos_token_ids]
        results.append((tokenizer.decode(ids), finish[u], tokens[u]))
    return results


SCHEMAS = [
    closed_object(
        {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "ok": {"type": "boolean"},
            "kind": {"const": "reading"},
        }
    ),
    closed_object(
        {
            "tags": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                "minItems": 1,
                "maxItems": 3,
            },
            "inner": closed_object({"x": {"type": "number", "minimum": -5, "maximum": 5}}),
        }
    ),
    closed_object(
        {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "string", "maxLength": 3},
                    {"type": "null"},
                ]
            },
            "day": {"type": "string", "format": "date"},
        }
    ),
    {
        "$defs": {
            "point": closed_object(
                {"x": {"$ref": "#/$defs/coord"}, "y": {"$ref": "#/$defs/coord"}}
            ),
            "coord": {"type": "integer", "minimum": -9, "maximum": 9},
        },
        "type": "object",
        "properties": {
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2}
        },
        "required": ["points"],
        "additionalProperties": False,
    },
]


def test_batch_of_schemas_and_an_unconstrained_sequence(model, tokenizer, compiler):
    processors = [compiler.processor(ConstraintSpec.json_schema(s)) for s in SCHEMAS]
    results = generate(model, tokenizer, [[p] for p in processors] + [[]], max_tokens=200)
    for schema, (text, finish, _), processor in zip(SCHEMAS, results[:-1], processors, strict=True):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
        assert processor.error is None and processor.accepting
    text, finish, tokens = results[-1]
    # The unconstrained walk over random weights is not JSON and runs to the limit.
    assert finish == "length" and len(tokens) == 200
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_object_yields_an_object(model, tokenizer, compiler):
    ((text, finish, _),) = generate(
        model, tokenizer, [[compiler.processor(ConstraintSpec.json_object())]], max_tokens=2000
    )
    assert finish == "stop"
    assert isinstance(json.loads(text), dict)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "unit": {"$ref": "#/$defs/unit"},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
            "$defs": {"unit": {"enum": ["C", "F"]}},
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": closed_object(
            {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            }
        ),
    },
}
TOOL_CALL = re.compile(r"^<tool_call>\n?(.*?)\n?</tool_call>$", re.DOTALL)


def parse_calls(text: str) -> list[dict]:
    match = TOOL_CALL.match(text)
    assert match, text
    return [json_tools.parse_tool_call(match.group(1))]


def test_tool_call_picks_one_of_the_tools(model, tokenizer, compiler):
    tools = [WEATHER, ADD]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    spec = ConstraintSpec.tool_call(tools)
    results = generate(model, tokenizer, [[compiler.processor(spec)] for _ in range(4)], seed=3)
    names = set()
    for text, finish, _ in results:
        assert finish == "stop"
        (call,) = parse_calls(text)
        assert set(call) == {"name", "arguments"}
        jsonschema.validate(call["arguments"], params[call["name"]])
        names.add(call["name"])
    assert names <= {"get_weather", "add"}


def test_named_tool_is_the_one_called(model, tokenizer, compiler):
    spec = ConstraintSpec.tool_call([WEATHER, ADD], required_name="add")
    results = generate(model, tokenizer, [[compiler.processor(spec)] for _ in range(3)], seed=4)
    for text, finish, _ in results:
        assert finish == "stop"
        (call,) = parse_calls(text)
        assert call["name"] == "add"
        jsonschema.validate(call["arguments"], ADD["function"]["parameters"])


def test_parallel_tool_calls_are_each_well_formed(model, tokenizer, compiler):
    spec = ConstraintSpec.tool_call([ADD], parallel=True)
    ((text, _, _),) = generate(
        model, tokenizer, [[compiler.processor(spec)]], max_tokens=800, seed=5
    )
    # A random walk keeps calling; every completed call must be well formed.
    calls = re.findall(r"<tool_call>\n?(.*?)\n?</tool_call>", text, re.DOTALL)
    assert len(calls) >= 2, text
    for body in calls:
        call = json_tools.parse_tool_call(body)
        assert call["name"] == "add"
        jsonschema.validate(call["arguments"], ADD["function"]["parameters"])
    between = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL)
    assert set(between.split("<tool_call>")[0]) <= {"\n"}


def test_special_token_markers_are_emitted_as_tokens():
    hf = make_hf_tokenizer(extra_special=("<tool_call>", "</tool_call>"))
    tokenizer = TokenizerWrapper(hf)
    compiler = ConstraintCompiler(tokenizer)
    spec = ConstraintSpec.tool_call([ADD])
    assert "<[" in build_grammar(spec, compiler._marker)
    ((_, finish, tokens),) = generate(
        make_model(len(hf)), tokenizer, [[compiler.processor(spec)]], seed=6
    )
    assert finish == "stop"
    start, end = hf.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert tokens[0] == start and tokens[-2] == end
    text = hf.decode(tokens[:-1], skip_special_tokens=False)
    (call,) = parse_calls(text)
    assert call["name"] == "add"


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "properties": {"a": {"type": "strng"}}}, "properties/a/type"),
        ({"type": "object", "required": "a"}, "required"),
        ({"type": "array", "minItems": -1}, "minItems"),
        ({"type": "object", "additionalProperties": "no"}, "additionalProperties"),
        (["not", "an", "object"], "must be an object"),
        ({"$ref": "#/$defs/missing"}, "missing"),
    ],
)
def test_invalid_schema_is_named(schema, named):
    with pytest.raises(ConstraintError, match=re.escape(named)):
        validate_schema(schema)


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "integer"}}, "not"),
        ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "if"),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
        ({"type": "string", "format": "credit-card"}, "credit-card"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        ({"oneOf": [{"type": "object"}, {"type": "object"}]}, "oneOf"),
        ({"$ref": "https://example.com/s.json"}, "https://example.com/s.json"),
    ],
)
def test_unsupported_feature_is_named(schema, feature, compiler):
    with pytest.raises(ConstraintError, match=re.escape(feature)):
        validate_schema(schema)
    with pytest.raises(ConstraintError, match=re.escape(feature)):
        compiler.processor(ConstraintSpec.json_schema(schema))


@pytest.mark.parametrize("schema", SCHEMAS)
def test_supported_schemas_validate(schema):
    validate_schema(schema)


def test_tool_errors_name_the_tool():
    bad = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}},
    }
    with pytest.raises(ConstraintError, match="tool 'f'.*uniqueItems"):
        validate_spec(ConstraintSpec.tool_call([bad]))
    with pytest.raises(ConstraintError, match="'nope' is not among"):
        validate_spec(ConstraintSpec.tool_call([ADD], required_name="nope"))
    with pytest.raises(ConstraintError, match="unique"):
        validate_spec(ConstraintSpec.tool_call([ADD, ADD]))
    with pytest.raises(ConstraintError, match="needs a schema"):
        ConstraintSpec("json_schema")
    with pytest.raises(ConstraintError, match="unknown constraint kind"):
        ConstraintSpec("regex")


def token_id(tokenizer, text: str) -> int:
    (tid,) = tokenizer.encode(text, add_special_tokens=False)
    return tid


def test_activate_after_passes_logits_through_until_the_trigger(tokenizer, compiler):
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    brace, letter = token_id(tokenizer, "{"), token_id(tokenizer, "a")
    processor = compiler.processor(ConstraintSpec.json_object(), activate_after=[think_end])
    logits = mx.zeros((1, len(tokenizer)))
    context = tokenizer.encode("<think>hmm")
    for extra in ([], [letter], [letter, brace]):
        out = processor(mx.array(context + extra), logits)
        assert not processor.active and mx.array_equal(out, logits)
    context += [letter, brace, think_end]
    out = processor(mx.array(context), logits)
    assert processor.active and processor.consumed == 0  # the trigger is not JSON
    assert out[0, brace].item() == 0 and out[0, letter].item() == float("-inf")
    out = processor(mx.array(context + [brace]), logits)
    assert processor.consumed == 1 and out[0, brace].item() == float("-inf")


def test_multi_token_trigger_and_trigger_at_the_end_of_the_prompt(tokenizer, compiler):
    trigger = tokenizer.encode("Answer:", add_special_tokens=False)
    assert len(trigger) > 1
    brace, letter = token_id(tokenizer, "{"), token_id(tokenizer, "a")
    logits = mx.zeros((1, len(tokenizer)))
    processor = compiler.processor(ConstraintSpec.json_object(), activate_after=trigger)
    out = processor(mx.array(trigger[1:]), logits)
    assert not processor.active and mx.array_equal(out, logits)
    out = processor(mx.array(tokenizer.encode("x") + trigger), logits)
    assert processor.active and out[0, letter].item() == float("-inf")
    assert out[0, brace].item() == 0


def test_complete_grammar_allows_only_end_of_sequence(tokenizer, compiler):
    processor = compiler.processor(ConstraintSpec.json_schema(SCHEMAS[0]))
    answer = tokenizer.encode(
        '{"age": 7, "unit": "celsius", "ok": true, "kind": "reading"}', add_special_tokens=False
    )
    context = tokenizer.encode("prompt")
    logits = mx.zeros((1, len(tokenizer)))
    processor(mx.array(context), logits)
    for i in range(len(answer)):
        out = processor(mx.array(context + answer[: i + 1]), logits)
    assert processor.error is None and processor.accepting
    allowed = {i for i, v in enumerate(out[0].tolist()) if v == 0}
    assert allowed == set(tokenizer.eos_token_ids)


def test_mask_fits_a_model_vocabulary_of_another_size(tokenizer, compiler):
    brace = token_id(tokenizer, "{")
    for vocab in (len(tokenizer) + 64, brace + 1):
        processor = compiler.processor(ConstraintSpec.json_object())
        out = processor(mx.array([1, 2]), mx.zeros((1, vocab)))
        assert out.shape == (1, vocab)
        assert out[0, brace].item() == 0
        assert out[0, 0].item() == float("-inf")
        # Ids past the tokenizer's vocabulary are never allowed.
        assert mx.all(out[0, len(tokenizer) :] == float("-inf")).item()
    assert vocab <= len(tokenizer)


def test_a_token_outside_the_grammar_ends_the_sequence(tokenizer, compiler):
    processor = compiler.processor(ConstraintSpec.json_object())
    logits = mx.zeros((1, len(tokenizer)))
    processor(mx.array([1]), logits)
    out = processor(mx.array([1, token_id(tokenizer, "a")]), logits)
    assert processor.error
    allowed = [i for i, v in enumerate(out[0].tolist()) if v == 0]
    assert allowed == sorted(tokenizer.eos_token_ids)


def test_grammar_cache_hits_and_evicts(tokenizer):
    compiler = ConstraintCompiler(tokenizer, cache_size=2)
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    reordered = {
        "type": "object",
        "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}},
    }
    first = compiler.processor(ConstraintSpec.json_schema(a))
    second = compiler.processor(ConstraintSpec.json_schema(json.loads(json.dumps(a))))
    assert (compiler.hits, compiler.misses) == (1, 1)
    assert first is not second  # each sequence gets its own state
    compiler.processor(ConstraintSpec.json_schema(reordered))  # property order matters
    assert (compiler.hits, compiler.misses) == (1, 2)
    compiler.processor(ConstraintSpec.json_object())  # evicts `a`
    compiler.processor(ConstraintSpec.json_schema(a))
    assert (compiler.hits, compiler.misses) == (1, 4)
    with pytest.raises(ConstraintError):
        compiler.processor(ConstraintSpec.json_schema({"not": {}}))
    assert compiler.misses == 5


def test_spec_equality_follows_the_canonical_key():
    a = ConstraintSpec.json_schema({"type": "object", "properties": {"x": {}}})
    b = ConstraintSpec.json_schema({"type": "object", "properties": {"x": {}}})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != ConstraintSpec.json_object()
    assert ConstraintSpec.tool_call([ADD]).tools == (ADD,)


def test_a_valid_spec_is_checked_once(monkeypatch):
    """A burst of requests with one schema validates it once; an invalid one every time."""
    from mlx_server.engine.grammar import spec as grammar_spec

    spec = ConstraintSpec.json_schema({"type": "object", "properties": {"once": {}}})
    validate_spec(spec)
    calls = []
    monkeypatch.setattr(grammar_spec, "_validate", lambda s: calls.append(s.key()))
    validate_spec(ConstraintSpec.json_schema({"type": "object", "properties": {"once": {}}}))
    assert calls == []
    other = ConstraintSpec.json_schema({"type": "object", "properties": {"twice": {}}})
    validate_spec(other)
    assert calls == [other.key()]
    monkeypatch.undo()
    bad = ConstraintSpec.json_schema({"not": {}})
    for _ in range(2):
        with pytest.raises(ConstraintError):
            validate_spec(bad)
