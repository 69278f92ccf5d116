"""Tool-call parsing: every mlx-lm format, streamed arguments, fallbacks to text, parity."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools

from mlx_server.events import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from mlx_server.parsing.call_decoder import normalize_call
from mlx_server.parsing.pipeline import collect, merge_events
from mlx_server.parsing.tool_formats import available_tool_parsers, resolve_tool_parser, tool_format
from mlx_server.parsing.tool_schema import validate_tools
from mlx_server.parsing.tools import ToolCallParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer", "default": None},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]

PARIS = ("get_weather", {"city": "Paris", "days": 3})
TOKYO = ("get_time", {"tz": "Asia/Tokyo"})

# format name -> (model output, expected content, expected calls)
SAMPLES: dict[str, tuple[str, str | None, list[tuple[str, dict]]]] = {
    "json_tools": (
        "Let me look that up.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "qwen3_coder": (
        "Let me look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nAsia/Tokyo\n</parameter>\n"
        "</function>\n</tool_call>",
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "mistral": (
        'Let me look that up.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "Asia/Tokyo"}',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "pythonic": (
        "Let me look that up.<|tool_call_start|>"
        '[get_weather(city="Paris", days=3), get_time(tz="Asia/Tokyo")]<|tool_call_end|>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "gemma4": (
        'Let me look that up.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}'
        '<tool_call|><|tool_call>call:get_time{tz:<|"|>Asia/Tokyo<|"|>}<tool_call|>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "function_gemma": (
        "Let me look that up.<start_function_call>call:get_weather{city:<escape>Paris<escape>,"
        "days:3}<end_function_call><start_function_call>call:get_time{tz:<escape>Asia/Tokyo"
        "<escape>}<end_function_call>",
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "glm47": (
        "Let me look that up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "</tool_call><tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>Asia/Tokyo"
        "</arg_value>\n</tool_call>",
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "laguna": (
        "Let me look that up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "</tool_call>",
        "Let me look that up.",
        [PARIS],
    ),
    "kimi_k2": (
        "Let me look that up.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}'
        "<|tool_call_end|><|tool_call_begin|>functions.get_time:1"
        '<|tool_call_argument_begin|>{"tz": "Asia/Tokyo"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "kimi_k3": (
        "Let me look that up.<|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
        "<|close|>call<|sep|>"
        '<|open|>call tool="get_time" index="2"<|sep|>'
        '<|open|>json type="object"<|sep|>{"tz": "Asia/Tokyo"}<|close|>json<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>",
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "minimax_m2": (
        'Let me look that up.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n'
        '</invoke>\n<invoke name="get_time">\n<parameter name="tz">Asia/Tokyo</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "longcat": (
        "Let me look that up.\n<longcat_tool_call>get_weather\n"
        "<longcat_arg_key>city</longcat_arg_key>\n<longcat_arg_value>Paris"
        "</longcat_arg_value>\n<longcat_arg_key>days</longcat_arg_key>\n"
        "<longcat_arg_value>3</longcat_arg_value>\n</longcat_tool_call>",
        "Let me look that up.",
        [PARIS],
    ),
    "minicpm5": (
        'Let me look that up.\n<function name="get_weather"><param name="city">Paris</param>'
        '<param name="days">3</param></function>\n<function name="get_time">'
        '<param name="tz">Asia/Tokyo</param></function>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}',
        None,
        [PARIS, TOKYO],
    ),
    "muse_spark": (
        'Let me look that up.<atem:function_calls><atem:invoke name="get_weather">'
        '<atem:parameter name="city">Paris</atem:parameter>'
        '<atem:parameter name="days">3</atem:parameter></atem:invoke>'
        '<atem:invoke name="get_time"><atem:parameter name="tz">Asia/Tokyo'
        "</atem:parameter></atem:invoke></atem:function_calls>",
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    # Formats of this package (parsing/formats).
    "deepseek": (
        "Let me look that up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
        'get_time\n```json\n{"tz": "Asia/Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "granite": (
        'Let me look that up.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}, {"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "phi4_mini": (
        'Let me look that up.<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}<|/tool_call|><|tool_call|>{"name": "get_time", "arguments": {"tz": '
        '"Asia/Tokyo"}}<|/tool_call|>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "command_r7b": (
        'Let me look that up.<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
        '"parameters": {"city": "Paris", "days": 3}}, {"tool_call_id": "1", "tool_name": '
        '"get_time", "parameters": {"tz": "Asia/Tokyo"}}]<|END_ACTION|>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "nemotron_v2": (
        'Let me look that up.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}, {"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]</TOOLCALL>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "firefunction_v2": (
        'Let me look that up. functools[{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}, {"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "apertus": (
        'Let me look that up.<|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 3}}, '
        '{"get_time": {"tz": "Asia/Tokyo"}}]<|tools_suffix|>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "command_r_plus": (
        'Let me look that up.\nAction:\n```json\n[{"tool_name": "get_weather", "parameters": '
        '{"city": "Paris", "days": 3}}, {"tool_name": "get_time", "parameters": {"tz": '
        '"Asia/Tokyo"}}]\n```\n',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "functionary_v3_1": (
        'Let me look that up.<function=get_weather>{"city": "Paris", "days": 3}</function>'
        '<function=get_time>{"tz": "Asia/Tokyo"}</function>',
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
    "seed_oss": (
        "Let me look that up.<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris"
        "</parameter>\n<parameter=days>3</parameter>\n</function>\n</seed:tool_call>"
        "<seed:tool_call>\n<function=get_time>\n<parameter=tz>Asia/Tokyo</parameter>\n"
        "</function>\n</seed:tool_call>",
        "Let me look that up.",
        [PARIS, TOKYO],
    ),
}


def make_parser(name: str, tools=TOOLS, **kw) -> ToolCallParser:
    counter = itertools.count()
    return ToolCallParser(
        tool_format(name), tools, id_factory=lambda: f"call_{next(counter)}", **kw
    )


def run(parser: ToolCallParser, pieces) -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.flush()
    return merge_events(events)


def pieces_at(text: str, cuts) -> list[str]:
    points = sorted({0, len(text), *cuts})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def calls_of(events) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for c in collect(events)["tool_calls"]]


def content_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


# -- every format


def test_samples_cover_every_format():
    assert set(SAMPLES) == set(available_tool_parsers())


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_format_whole_and_char_by_char(name):
    text, content, calls = SAMPLES[name]
    for pieces in ([text], list(text)):
        events = run(make_parser(name), pieces)
        message = collect(events)
        assert message["content"] == content
        assert calls_of(events) == calls
        fmt = tool_format(name)
        assert fmt.start not in (message["content"] or "")
        assert [c["id"] for c in message["tool_calls"]] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_format_split_at_every_point_gives_same_events(name):
    text = SAMPLES[name][0]
    whole = run(make_parser(name), [text])
    assert run(make_parser(name), list(text)) == whole
    for i in range(len(text) + 1):
        assert run(make_parser(name), [text[:i], text[i:]]) == whole, i


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_format_random_splits_give_same_events(data):
    name = data.draw(st.sampled_from(sorted(SAMPLES)))
    text = SAMPLES[name][0]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    assert run(make_parser(name), pieces_at(text, cuts)) == run(make_parser(name), [text])


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_call_has_start_args_end_in_order(name):
    events = run(make_parser(name), list(SAMPLES[name][0]))
    calls = [e for e in events if not isinstance(e, TextDelta)]
    by_index: dict[int, list] = {}
    for e in calls:
        by_index.setdefault(e.index, []).append(e)
    assert sorted(by_index) == list(range(len(SAMPLES[name][2])))
    for seq in by_index.values():
        assert isinstance(seq[0], ToolCallStart) and isinstance(seq[-1], ToolCallEnd)
        args = "".join(e.text for e in seq if isinstance(e, ToolCallArgsDelta))
        assert args == seq[-1].arguments
        assert isinstance(json.loads(args), dict)


# -- streamed JSON arguments


def test_json_arguments_stream_before_the_call_ends():
    text = SAMPLES["json_tools"][0]
    parser = make_parser("json_tools")
    cut = text.index("Paris") + 2
    early = parser.feed(text[:cut])
    assert isinstance(early[-2], ToolCallStart) and early[-2].name == "get_weather"
    assert early[-1] == ToolCallArgsDelta(index=0, text='{"city": "Pa')
    rest = parser.feed(text[cut:]) + parser.flush()
    assert ToolCallEnd(index=0, arguments='{"city": "Paris", "days": 3}') in rest


def test_streamed_arguments_equal_the_whole_parse():
    body = '{"name": "get_weather", "arguments": {"city": "Paris \\"}{\\" </tool_call>", "n": [1, {"a": null}]}}'
    events = run(make_parser("json_tools"), list(f"<tool_call>{body}</tool_call>"))
    [call] = collect(events)["tool_calls"]
    assert json.loads(call["arguments"]) == json_tools.parse_tool_call(body)["arguments"]
    assert content_of(events) == ""


def test_several_objects_in_one_block_are_several_calls():
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>\nDone.'
    )
    for pieces in ([text], list(text)):
        events = run(make_parser("json_tools"), pieces)
        assert calls_of(events) == [PARIS, TOKYO]
        assert content_of(events) == "Done."


def test_junk_after_streamed_arguments_is_skipped():
    text = '<tool_call>{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}, "id": 7} x</tool_call>ok'
    for pieces in ([text], list(text)):
        events = run(make_parser("json_tools"), pieces)
        assert calls_of(events) == [TOKYO]
        assert content_of(events) == "ok"


def test_arguments_as_a_json_string_are_decoded():
    text = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    )
    events = run(make_parser("json_tools"), list(text))
    assert calls_of(events) == [("get_weather", {"city": "Paris"})]


def test_call_without_arguments_has_empty_object():
    events = run(make_parser("json_tools"), ['<tool_call>{"name": "get_time"}</tool_call>'])
    assert calls_of(events) == [("get_time", {})]


def test_truncated_streamed_call_ends_with_raw_arguments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    events = run(make_parser("json_tools"), list(text))
    assert events[0] == ToolCallStart(index=0, id="call_0", name="get_weather")
    assert events[-1] == ToolCallEnd(index=0, arguments='{"city": "Pa')
    assert content_of(events) == ""


def test_end_tag_inside_unclosed_arguments_ends_the_call():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": 1</tool_call> after'
    events = run(make_parser("json_tools"), list(text))
    assert ToolCallEnd(index=0, arguments='{"city": 1') in events
    assert content_of(events) == "after"


def test_mistral_streams_arguments_and_handles_list_form():
    text = SAMPLES["mistral"][0]
    parser = make_parser("mistral")
    early = parser.feed(text[: text.index("Paris")])
    assert any(isinstance(e, ToolCallArgsDelta) for e in early)
    legacy = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
    assert calls_of(run(make_parser("mistral"), list(legacy))) == [PARIS]


def test_mistral_text_after_a_call_is_content():
    text = '[TOOL_CALLS]get_time[ARGS]{"tz": "Asia/Tokyo"}\n\nDone.'
    events = run(make_parser("mistral"), list(text))
    assert calls_of(events) == [TOKYO]
    assert content_of(events) == "Done."
    text += ' And [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
    for pieces in ([text], list(text)):
        events = run(make_parser("mistral"), pieces)
        assert calls_of(events) == [TOKYO, PARIS]
        assert content_of(events) == "Done. And"


def test_llama3_bare_and_tagged_calls():
    tagged = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}'
    bare = '\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n'
    for text in (tagged, bare):
        events = run(make_parser("llama3_json"), list(text))
        assert calls_of(events) == [TOKYO] and content_of(events) == ""
    parser = make_parser("llama3_json")
    early = parser.feed('{"name": "get_time", "parameters": {"tz": "Asia')
    assert early[-1] == ToolCallArgsDelta(index=0, text='{"tz": "Asia')


def test_llama3_plain_answers_are_not_calls():
    parser = make_parser("llama3_json")
    assert parser.feed("The answer is {4}.") == [TextDelta("The answer is {4}.")]
    json_answer = '{"name": "Bob", "age": 4}'
    parser = make_parser("llama3_json")
    assert parser.feed(json_answer[:-3]) == [TextDelta(json_answer[:-3])]  # not held to the end
    assert run(make_parser("llama3_json"), list(json_answer)) == [TextDelta(json_answer)]
    unknown = '{"name": "format_disk", "parameters": {}}'
    assert run(make_parser("llama3_json"), [unknown]) == [TextDelta(unknown)]


# -- what is not a call stays text


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": "{oops"}</tool_call>',
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
        '<tool_call>{"name": "format_disk", "arguments": {}}</tool_call>',
    ],
)
def test_malformed_or_unknown_call_is_returned_as_text(block):
    text = f"Sure.\n{block}\nBye."
    for pieces in ([text], list(text)):
        events = run(make_parser("json_tools"), pieces)
        assert content_of(events) == text
        assert collect(events)["tool_calls"] == []


def test_unknown_name_in_a_streamable_header_is_text():
    text = '<tool_call>{"name": "format_disk", "arguments": {"all": true}}</tool_call>'
    events = run(make_parser("json_tools"), list(text))
    assert events == [TextDelta(text)]


def test_any_name_is_accepted_without_a_tool_list():
    text = '<tool_call>{"name": "anything", "arguments": {}}</tool_call>'
    assert calls_of(run(make_parser("json_tools", tools=None), [text])) == [("anything", {})]


@pytest.mark.parametrize(
    "name, text",
    [
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
        ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<para'),
        ("gemma4", "<|tool_call>call:get_weather{city:<|"),
        ("mistral", "[TOOL_CALLS]get_weather[AR"),
    ],
)
def test_truncated_unparseable_call_is_text(name, text):
    events = run(make_parser(name), list(text))
    assert content_of(events) == text
    assert collect(events)["tool_calls"] == []


def test_call_missing_its_end_marker_is_parsed_at_flush():
    text = (
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nAsia/Tokyo\n</parameter>\n</function>\n"
    )
    assert calls_of(run(make_parser("qwen3_coder"), list(text))) == [TOKYO]


def test_partial_start_marker_at_the_end_is_text():
    parser = make_parser("json_tools")
    assert parser.feed("Answer: 4 <tool_ca") == [TextDelta("Answer: 4")]
    assert parser.flush() == [TextDelta(" <tool_ca")]


def test_text_between_and_after_calls():
    text = (
        'A<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\n'
        'B<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
    )
    events = run(make_parser("json_tools"), list(text))
    assert [type(e).__name__ for e in events] == [
        "TextDelta", "ToolCallStart", "ToolCallArgsDelta", "ToolCallEnd",
        "TextDelta", "ToolCallStart", "ToolCallArgsDelta", "ToolCallEnd",
    ]  # fmt: skip
    assert content_of(events) == "AB"


def test_plain_text_passes_through_exactly():
    text = '  No tools needed < here > {"a": 1}\n\n'
    assert content_of(run(make_parser("json_tools"), list(text))) == text


# -- max_calls (parallel_tool_calls: false)


@pytest.mark.parametrize("name", ["json_tools", "qwen3_coder", "kimi_k2", "mistral"])
def test_max_calls_keeps_the_first_call_and_drops_the_rest(name):
    text = SAMPLES[name][0] + "\nDone."
    parser = make_parser(name, max_calls=1)
    events = run(parser, list(text))
    assert calls_of(events) == [PARIS]
    assert "get_time" not in content_of(events)
    assert parser.saw_tool_calls


# -- names, ids, resolution


def test_default_ids_are_openai_style_and_unique():
    parser = ToolCallParser(tool_format("json_tools"), TOOLS)
    message = collect(run(parser, [SAMPLES["json_tools"][0]]))
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == 2
    for call_id in ids:
        assert call_id.startswith("call_") and len(call_id) == 29
        int(call_id[5:], 16)


def test_unknown_parser_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        resolve_tool_parser("hermes2", None)
    for name in ("json_tools", "qwen3_coder", "mistral", "pythonic"):
        assert name in str(err.value)


def test_parser_override_and_none():
    fmt = resolve_tool_parser("qwen3_coder", None)
    assert (fmt.name, fmt.start, fmt.end) == ("qwen3_coder", "<tool_call>", "</tool_call>")
    assert not fmt.streams_arguments
    assert resolve_tool_parser("json_tools", None).streams_arguments
    assert resolve_tool_parser("none", None) is None
    assert resolve_tool_parser(None, None) is None


def test_normalize_call_shapes():
    assert normalize_call({"name": "f", "arguments": {"a": 1}}) == ("f", '{"a": 1}')
    assert normalize_call({"name": "f", "parameters": {"a": 1}}) == ("f", '{"a": 1}')
    assert normalize_call({"function": {"name": "f", "arguments": '{"a": 1}'}}) == ("f", '{"a": 1}')
    assert normalize_call({"name": "f", "arguments": [1]}) is None
    assert normalize_call({"name": "", "arguments": {}}) is None
    assert normalize_call("f()") is None


# -- tool definitions


def test_validate_tools_accepts_null_inside_schemas():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": ["string", "null"], "default": None}},
                },
            },
        },
        {"type": "function", "function": {"name": "g", "parameters": None}},
    ]
    assert validate_tools(tools) is tools
    assert validate_tools(None) == []


@pytest.mark.parametrize(
    "tools, message",
    [
        ({"type": "function"}, "tools must be a list, got object"),
        ([TOOLS[0], "get_time"], "tools[1]: must be an object, got string"),
        ([None], "tools[0]: must be an object, got null"),
        ([{"type": "function"}], "tools[0]: 'function' must be an object, got null"),
        ([{"type": "function", "function": {"description": "x"}}], "tools[0]: 'function.name'"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0]: unsupported type"),
        (
            [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": []}}],
            "tools[1]: 'function.parameters' must be an object, got array",
        ),
    ],
)
def test_validate_tools_names_the_bad_entry(tools, message):
    with pytest.raises(ValueError, match=None) as err:
        validate_tools(tools)
    assert message in str(err.value)
