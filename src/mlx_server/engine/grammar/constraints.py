"""Grammar-constrained decoding: JSON mode, JSON schemas and forced tool calls.

``ConstraintSpec`` says what the answer must be; ``ConstraintCompiler`` (one per model)
turns it into an llguidance matcher, cached by the spec's JSON, and hands out a fresh
``GrammarLogitsProcessor`` per sequence for mlx-lm's ``BatchGenerator``::

    compiler = ConstraintCompiler(tokenizer)              # mlx-lm TokenizerWrapper
    spec = ConstraintSpec.json_schema({"type": "object", ...})
    processor = compiler.processor(spec, activate_after=tokenizer.think_end_tokens)
    generator.insert([prompt], logits_processors=[[processor]])

The spec, its validation and its grammar are ``spec``. Tool calls are produced in the
model's own wire format (Hermes/Qwen ``<tool_call>`` +
``{"name": ..., "arguments": {...}}`` + ``</tool_call>`` by default), so the ordinary
tool-call parser reads them back.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
from transformers import PreTrainedTokenizerFast

from mlx_server.engine.grammar.processor import GrammarLogitsProcessor
from mlx_server.engine.grammar.spec import (
    JSON_WHITESPACE,
    KINDS,
    ConstraintError,
    ConstraintSpec,
    build_grammar,
    raise_for_grammar_error,
    validate_schema,
    validate_spec,
)

__all__ = [
    "JSON_WHITESPACE",
    "KINDS",
    "ConstraintCompiler",
    "ConstraintError",
    "ConstraintSpec",
    "build_grammar",
    "validate_schema",
    "validate_spec",
]


# the schema ``ConstraintCompiler.prepare`` builds: an object, a string, a number, an array
_PREPARE_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "number"}}},
    "required": ["a"],
}


class ConstraintCompiler:
    """Compiles specs for one tokenizer and hands out per-sequence processors.

    Build it once per model (wrapping the tokenizer costs up to a second on large
    vocabularies). Compiled grammars are kept in an LRU cache of ``cache_size`` entries
    keyed by ``ConstraintSpec.key()``; each processor gets its own copy of the matcher.
    Thread-safe.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        cache_size: int = 64,
        eos_token_ids: Sequence[int] | None = None,
        lazy: bool = False,
    ):
        """``lazy``: wrap the tokenizer in the first ``compile`` instead of here. Wrapping
        takes a second or more on a large vocabulary and holds the interpreter lock all
        along (tokenizers' and llguidance's native code), so it cannot overlap other start
        work; a server that starts lazily is ready that much sooner, and does it in its
        idle time (``prepare``) or in the first constrained request, whichever comes first.
        A slow tokenizer is refused here either way."""
        hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = eos_token_ids or getattr(tokenizer, "eos_token_ids", None)
        if not eos and hf_tokenizer.eos_token_id is not None:
            eos = [hf_tokenizer.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos or ()))
        if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
            raise ConstraintError(
                "constrained decoding needs a fast tokenizer: Only fast tokenizers are supported"
            )
        self._hf = hf_tokenizer
        self._wrapped: llguidance.LLTokenizer | None = None
        self._vocab: dict[str, int] = {}
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._wrap_lock = threading.Lock()
        self._building: dict[str, Future[llguidance.LLMatcher]] = {}  # keys being built
        self.hits = 0
        self.misses = 0
        if not lazy:
            _ = self._tokenizer

    @property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (made on first use), and with it the
        vocabulary by token text."""
        if self._wrapped is None:
            with self._wrap_lock:
                if self._wrapped is None:
                    try:
                        wrapped = llguidance.hf.from_tokenizer(
                            self._hf, eos_token=list(self.eos_token_ids) or None
                        )
                    except ValueError as e:
                        raise ConstraintError(
                            f"constrained decoding needs a fast tokenizer: {e}"
                        ) from e
                    self._vocab = {str(k): v for k, v in self._hf.get_vocab().items()}
                    self._wrapped = wrapped
        return self._wrapped

    def prepare(self) -> None:
        """What a first constrained request would otherwise wait for, done ahead (a lazy
        compiler, in the engine's idle time): llguidance's view of the tokenizer, and one
        small schema built and checked (the schema checker's and grammar builder's first
        use). The built matcher is not cached: the cache holds what requests asked for."""
        _ = self._tokenizer
        self._build(ConstraintSpec.json_schema(_PREPARE_SCHEMA))

    def processor(
        self, spec: ConstraintSpec, *, activate_after: Sequence[int] | None = None
    ) -> GrammarLogitsProcessor:
        """A fresh stateful logits processor for one sequence.

        ``activate_after``: token ids (such as ``</think>``) after which the constraint
        starts; until the context ends with them, logits pass through unchanged. A prompt
        that already ends with them activates the constraint at once.
        """
        return GrammarLogitsProcessor(
            self.compile(spec).deep_copy(),
            mask_vocab=self._tokenizer.vocab_size,
            eos_ids=self.eos_token_ids,
            activate_after=activate_after,
        )

    def compile(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        """The cached matcher for ``spec`` in its initial state (copy it before use). A
        spec is built once however many requests ask for it together: the others wait
        for that build (building holds the interpreter lock, so N builds of one schema
        for a burst of N would stall everything N times over)."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self.hits += 1
                self._cache.move_to_end(key)
                return self._cache[key]
            building = self._building.get(key)
            if building is None:
                self.misses += 1
                mine: Future[llguidance.LLMatcher] = Future()
                self._building[key] = mine
            else:
                self.hits += 1
        if building is not None:
            return building.result()  # the build's matcher, or its exception
        try:
            matcher = self._build(spec)
        except BaseException as e:
            with self._lock:
                del self._building[key]
            mine.set_exception(e)
            raise
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            del self._building[key]
        mine.set_result(matcher)
        return matcher

    def _build(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        validate_spec(spec)
        grammar = build_grammar(spec, self._marker)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise_for_grammar_error(matcher.get_error(), "constraint")
        if self._admits_nothing(matcher):
            raise ConstraintError(
                "constraint cannot be enforced: it admits no output (nothing can start it; "
                "a schema that only refers to itself, as {'$ref': '#'}, has no value)"
            )
        return matcher

    def _admits_nothing(self, matcher: llguidance.LLMatcher) -> bool:
        """Whether a fresh matcher allows no token but the end while not accepting: the
        grammar has no string at all (llguidance then offers the end, and the answer would
        be empty text where a value was promised)."""
        probe = matcher.deep_copy()
        if probe.is_accepting():
            return False
        words = np.frombuffer(probe.compute_bitmask(), dtype=np.uint32)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        return set(allowed.tolist()) <= set(self.eos_token_ids)

    def _marker(self, text: str) -> str:
        """A lark element for a tool-call marker: a special token by id, else a string."""
        tokenizer = self._tokenizer  # the vocabulary is read with it
        token_id = self._vocab.get(text)
        if token_id is not None and tokenizer.is_special_token(token_id):
            return f"<[{token_id}]>"
        return json.dumps(text)
