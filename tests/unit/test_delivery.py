"""Token ids to text as the engine delivers them: a chat answer starts a text of its own,
a raw completion continues its prompt's text (its first token keeps a leading space)."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tiny_model import build_tokenizer

from mlx_server.engine.core.delivery import Seq, deliver_token
from mlx_server.engine.core.handle import TokenPiece
from mlx_server.engine.runners.base import Response
from mlx_server.types import GenerationRequest


class Pieces:
    """Collects what the engine pushes (the handle's side the engine sees)."""

    def __init__(self) -> None:
        self.pieces: list[TokenPiece] = []

    def push(self, event: TokenPiece) -> None:
        self.pieces.append(event)


@pytest.fixture(scope="module", params=["bpe", "spm"])
def tokenizer(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tokenizer(path, spm=request.param == "spm")
    tok = load_tokenizer(path)
    kind = SPMStreamingDetokenizer if request.param == "spm" else BPEStreamingDetokenizer
    assert isinstance(tok.detokenizer, kind)
    return tok


def delivered(tokenizer, prompt: list[int], generated: list[int], continues: bool) -> str:
    req = GenerationRequest("r", prompt, len(generated), continues_text=continues)
    sink = Pieces()
    seq = Seq(req, sink)  # type: ignore[arg-type]
    seq.begin_output(tokenizer)
    for i, token in enumerate(generated):
        last = i == len(generated) - 1
        deliver_token(tokenizer, seq, Response(0, token, None, "length" if last else None))
    return "".join(p.text for p in sink.pieces)


@pytest.mark.parametrize(
    "prompt,answer",
    [
        ("The capital of France is", " Paris is the capital."),
        ("Numbers 0 1 2", " 3 4"),
        ("def add(a, b):\n   ", " return a + b"),
        ("Hello world!", "\nWhat is"),
        ("The quick brown", " fox jumps"),
    ],
)
def test_a_completion_continues_its_prompt_text(tokenizer, prompt, answer):
    ids = tokenizer.encode(prompt + answer, add_special_tokens=False)
    n = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert tokenizer.decode(ids[:n]) == prompt  # the prompt's tokens end where it ends
    text = delivered(tokenizer, ids[:n], ids[n:], continues=True)
    # Prefix-preserving: prompt + text is the whole decode, leading space included.
    assert text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:n])) :] == answer


def test_a_chat_answer_starts_a_text_of_its_own(tokenizer):
    ids = tokenizer.encode("Hi Paris", add_special_tokens=False)
    n = len(tokenizer.encode("Hi", add_special_tokens=False))
    assert delivered(tokenizer, ids[:n], ids[n:], continues=False) == "Paris"


@pytest.mark.parametrize("wait,shown", [(0.1, False), (45.0, True)])
def test_a_long_wait_to_start_shows_in_the_generation_line(tokenizer, monkeypatch, wait, shown):
    from mlx_server.engine.core import delivery

    lines: list[str] = []
    monkeypatch.setattr(delivery, "log", lines.append)
    req = GenerationRequest("r", [1, 2, 3], 2)
    seq = Seq(req, Pieces())  # type: ignore[arg-type]
    seq.begin_output(tokenizer)
    seq.t_submit = seq.t_start - wait
    seq.t_first, seq.n_generated = seq.t_start + 0.2, 2
    delivery.deliver_finish(seq, "length")
    (line,) = lines
    assert line.startswith("Generation: 3 prompt tokens")
    assert (f"waited {wait:.1f}s to start" in line) is shown
