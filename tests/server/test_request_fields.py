"""OpenAI's request parameters walked one by one (the names vendored from its OpenAPI
document in specs/openai-request-fields.json): each is either implemented, with a test file
that exercises it, or not applicable here, with the reason. A field OpenAI adds fails this
test until it is placed; an implemented field must be one our schema declares (so it is
never reported as ignored), a not-applicable one is either declared (accepted, no effect)
or ignored and then named in ``x-mlx-server-ignored-fields``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_server.protocols.openai.chat.schemas import ChatCompletionRequest
from mlx_server.protocols.openai.completions.schemas import CompletionRequest
from mlx_server.server.ignored_fields import known_fields

TESTS = Path(__file__).parents[1]
FIELDS = json.loads((TESTS / "specs" / "openai-request-fields.json").read_text())

# field → the test file that exercises it
CHAT_IMPLEMENTED = {
    "frequency_penalty": "test_logit_bias.py",
    "presence_penalty": "test_logit_bias.py",
    "logit_bias": "test_logit_bias.py",
    "logprobs": "test_batching.py",
    "top_logprobs": "test_batching.py",
    "max_completion_tokens": "test_openai_scripted.py",
    "max_tokens": "test_openai_scripted.py",
    "messages": "test_openai_scripted.py",
    "model": "test_openai_scripted.py",
    "n": "test_n_choices.py",
    "parallel_tool_calls": "test_tools_reasoning_e2e.py",
    "reasoning_effort": "test_template_caps.py",
    "response_format": "test_structured_demo.py",
    "seed": "test_engine_faults.py",
    "stop": "test_openai_scripted.py",
    "stream": "test_openai_scripted.py",
    "stream_options": "test_openai_scripted.py",
    "temperature": "test_openai_scripted.py",
    "top_p": "test_openai_scripted.py",
    "tool_choice": "test_structured_demo.py",
    "tools": "test_tools_reasoning_e2e.py",
}
CHAT_NOT_APPLICABLE = {
    "audio": "audio output: the served models write text",
    "modalities": "output modalities: text is the only one",
    "function_call": "the deprecated functions API; tools and tool_choice replace it",
    "functions": "the deprecated functions API; tools and tool_choice replace it",
    "metadata": "tags for completions stored on OpenAI's platform; nothing is stored here",
    "store": "storing completions on OpenAI's platform; nothing is stored here",
    "moderation": "OpenAI's moderation service; there is none locally",
    "prediction": "predicted outputs only speed OpenAI's decoding; the answer is the same",
    "prompt_cache_key": "the prefix cache is automatic (longest shared prefix), no key",
    "prompt_cache_options": "the prefix cache is automatic and sized by flags",
    "prompt_cache_retention": "the prefix cache is automatic and sized by flags",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "user": "an end-user id for OpenAI's abuse monitoring (accepted, no effect)",
    "service_tier": "one local tier; there is no latency tier to choose",
    "verbosity": "a hint to OpenAI's GPT-5 models; no open model is trained on it",
    "web_search_options": "web search is a hosted tool; this server reaches no network",
}
COMPLETIONS_IMPLEMENTED = {
    "echo": "test_completions_scripted.py",
    "frequency_penalty": "test_logit_bias.py",
    "presence_penalty": "test_logit_bias.py",
    "logit_bias": "test_logit_bias.py",
    "logprobs": "test_completions_scripted.py",
    "max_tokens": "test_completions_scripted.py",
    "model": "test_completions_scripted.py",
    "n": "test_n_choices.py",
    "prompt": "test_completions_scripted.py",
    "seed": "test_completions_scripted.py",
    "stop": "test_completions_scripted.py",
    "stream": "test_completions_scripted.py",
    "stream_options": "test_completions_scripted.py",
    "suffix": "test_completions_scripted.py",
    "temperature": "test_completions_process.py",
    "top_p": "test_fuzz.py",
}
COMPLETIONS_NOT_APPLICABLE = {
    "best_of": "ranking whole sequences by likelihood is not implemented; 1 is accepted, "
    "more is a 400",
    "user": "an end-user id for OpenAI's abuse monitoring (accepted, no effect)",
}

CASES = [
    ("CreateChatCompletionRequest", ChatCompletionRequest, CHAT_IMPLEMENTED, CHAT_NOT_APPLICABLE),
    (
        "CreateCompletionRequest",
        CompletionRequest,
        COMPLETIONS_IMPLEMENTED,
        COMPLETIONS_NOT_APPLICABLE,
    ),
]


@pytest.mark.parametrize(("spec", "schema", "implemented", "not_applicable"), CASES)
def test_every_field_is_placed(spec, schema, implemented, not_applicable):
    names = set(FIELDS[spec])
    assert not set(implemented) & set(not_applicable)
    assert names == set(implemented) | set(not_applicable), (
        "unplaced:",
        names - set(implemented) - set(not_applicable),
        "not in the spec:",
        (set(implemented) | set(not_applicable)) - names,
    )


@pytest.mark.parametrize(("spec", "schema", "implemented", "not_applicable"), CASES)
def test_implemented_fields_are_declared_and_tested(spec, schema, implemented, not_applicable):
    known = known_fields(schema)
    for name, test_file in implemented.items():
        assert name in known, f"{name} is implemented but {schema.__name__} ignores it"
        (path,) = TESTS.glob(f"*/{test_file}")  # the file in whichever tier holds it
        text = path.read_text()
        assert f'"{name}"' in text or f"{name}=" in text, f"{test_file} never sends {name}"


@pytest.mark.parametrize(("spec", "schema", "implemented", "not_applicable"), CASES)
def test_not_applicable_fields_have_a_reason(spec, schema, implemented, not_applicable):
    for name, reason in not_applicable.items():
        assert len(reason) > 20, name
