"""Embedding test helpers: the embedding demo model's location, a tiny random-weight BERT
cross-encoder, and sentence-transformers references (CPU torch)."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from support import REPO

EMBEDDING_DEMO_DIR = REPO / "models" / "all-minilm-l6-v2"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def embedding_demo_dir() -> Path:
    """The embedding demo model (``mlx-server-demo --embedding`` puts it in models/); tests
    that need it fail loudly when it is missing."""
    d = EMBEDDING_DEMO_DIR
    assert (d / "model.safetensors").is_file(), (
        "embedding demo model missing: run `mlx-server-demo --embedding`"
    )
    return d


def build_tiny_cross_encoder(dest: Path, seed: int = 0) -> Path:
    """A ``BertForSequenceClassification`` reranker with random weights and one label, of
    real shape but tiny (2 layers, width 64), on the demo model's WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=1,
        architectures=["BertForSequenceClassification"],
    )
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():  # spread the scores: random init gives nearly equal logits
        model.classifier.weight.mul_(100.0)
    model.save_pretrained(dest, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        shutil.copy(embedding_demo_dir() / name, dest / name)
    config_path = dest / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["architectures"] = ["BertForSequenceClassification"]
    config_path.write_text(json.dumps(cfg, indent=2))
    return dest


# Corpus for the tiny tokenizers: the rerank tests' queries and documents tokenize into
# real pieces rather than unknown tokens.
_CORPUS = [
    "how do cats purr",
    "Cats purr by vibrating the muscles of the larynx.",
    "The stock market closed higher today.",
    "Purring happens when a cat breathes in and out.",
    "A recipe for lemon cake. Dogs bark; cats purr.",
    "The quick brown fox jumps over the lazy dog. Hello world!",
    "Given a web search query, retrieve relevant passages that answer the query",
]


def _unigram_pieces(corpus: list[str]) -> list[tuple[str, float]]:
    """A fixed unigram vocabulary for ``corpus``: every word as Metaspace splits it (with its
    "▁"), every word without its trailing punctuation, and every character, scored by log
    frequency. Written out rather than trained: the unigram trainer iterates hash maps and
    gives a different vocabulary on every run."""
    words = Counter(f"▁{w}" for line in corpus for w in line.split())
    words.update(Counter(w.rstrip(".,;!?") for w in list(words.elements())))
    chars = Counter(c for w in words.elements() for c in w)
    total = sum(words.values()) + sum(chars.values())
    # Characters score lower than any word, so a known word stays one piece.
    scored = {p: math.log(n / total) for p, n in words.items()}
    scored.update({c: math.log(n / total) - 10.0 for c, n in chars.items() if c not in scored})
    return sorted(scored.items(), key=lambda item: (-item[1], item[0]))


def build_tiny_xlmr_cross_encoder(dest: Path, seed: int = 0) -> Path:
    """An ``XLMRobertaForSequenceClassification`` reranker (bge-reranker-base's architecture)
    with random weights and one label, tiny (2 layers, width 64), on a small SentencePiece-style
    unigram tokenizer with XLM-R's special tokens and pair layout (``<s> A </s></s> B </s>``)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    dest.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-R's ids 0 to 3
    vocab = [(s, 0.0) for s in specials] + _unigram_pieces(_CORPUS)
    tok = Tokenizer(models.Unigram(vocab, unk_id=specials.index("<unk>"), byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(str(dest / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "sep_token": "</s>",
        "cls_token": "<s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 128,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config))
    torch.manual_seed(seed)
    config = XLMRobertaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=130,  # 128 tokens after the padding index
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        num_labels=1,
        architectures=["XLMRobertaForSequenceClassification"],
    )
    model = XLMRobertaForSequenceClassification(config).eval()
    with torch.no_grad():  # spread the scores around 0.5: random init gives nearly equal logits
        model.classifier.out_proj.weight.mul_(300.0)
        pair = tok.encode(_CORPUS[0], _CORPUS[1]).ids
        model.classifier.out_proj.bias.sub_(model(torch.tensor([pair])).logits[0])
    model.save_pretrained(dest, safe_serialization=True)
    return dest


# The Qwen3-Reranker prompt (its model card and tokenizer_config.json's chat template): a
# system turn asking for "yes" or "no", the instruction (a system message, default web
# search), the query and the document in the user turn, an empty thinking block to answer
# after. Written here as a template over sentence-transformers' query/document roles.
# A query and documents to rank, the relevant ones among them.
RERANK_QUERY = "how do cats purr"
RERANK_DOCS = [
    "Cats purr by vibrating the muscles of the larynx.",
    "The stock market closed higher today.",
    "Purring happens when a cat breathes in and out.",
    "A recipe for lemon cake.",
    "Dogs bark; cats purr.",
]

QWEN3_RERANKER_TEMPLATE = (
    "{%- set ns = namespace(task='Given a web search query, retrieve relevant passages that "
    "answer the query', query='', document='') -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' %}{% set ns.task = m.content %}"
    "{%- elif m.role == 'query' %}{% set ns.query = m.content %}"
    "{%- elif m.role == 'document' %}{% set ns.document = m.content %}{% endif -%}"
    "{%- endfor -%}"
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {{ ns.task }}\n<Query>: {{ ns.query }}\n"
    "<Document>: {{ ns.document }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n\n"
)  # Jinja drops the last newline


def _qwen_tokenizer(dest: Path, template: str, eos_after: bool) -> Any:
    """The tiny BPE tokenizer (tests/helpers/tiny_model.py) with "yes" and "no" as tokens; with
    ``eos_after``, every encoding ends in ``<|endoftext|>`` as Qwen3-Embedding's does."""
    from tiny_model import build_tokenizer
    from tokenizers import Tokenizer, processors

    build_tokenizer(dest, template)
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tok.add_tokens(["yes", "no"])
    if eos_after:
        eos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>",
            pair="$A $B <|endoftext|>",
            special_tokens=[("<|endoftext|>", eos)],
        )
    tok.save(str(dest / "tokenizer.json"))
    return tok


def _qwen3_config(vocab_size: int, architecture: str) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        architectures=[architecture],
    )


def build_tiny_qwen3_embedder(dest: Path, seed: int = 0) -> Path:
    """A Qwen3-Embedding-style model with random weights, tiny (2 layers, width 64), in the
    sentence-transformers layout: last-token pooling, Normalize, a ``query`` prompt."""
    import torch
    from transformers import Qwen3Model

    dest.mkdir(parents=True, exist_ok=True)
    tok = _qwen_tokenizer(dest, "", eos_after=True)
    torch.manual_seed(seed)
    model = Qwen3Model(_qwen3_config(tok.get_vocab_size(), "Qwen3ForCausalLM")).eval()
    model.save_pretrained(dest, safe_serialization=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": 64,
        "pooling_mode_lasttoken": True,
        "include_prompt": True,
    }
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (dest / "2_Normalize").mkdir(exist_ok=True)
    (dest / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    st = {
        "prompts": {"query": QWEN3_QUERY_PROMPT, "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    (dest / "config_sentence_transformers.json").write_text(json.dumps(st))
    return dest


# Qwen3-Embedding's query prompt (its config_sentence_transformers.json).
QWEN3_QUERY_PROMPT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)


def build_tiny_qwen3_reranker(dest: Path, seed: int = 0) -> Path:
    """A Qwen3-Reranker-style model with random weights, tiny (2 layers, width 64): a
    ``Qwen3ForCausalLM`` saved by sentence-transformers as a CrossEncoder of a Transformer
    (text generation, chat messages) and a ``LogitScore`` of the "yes" and "no" tokens."""
    import torch
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules.logit_score import LogitScore
    from transformers import Qwen3ForCausalLM

    raw = dest.parent / f"{dest.name}-raw"
    raw.mkdir(parents=True, exist_ok=True)
    tok = _qwen_tokenizer(raw, QWEN3_RERANKER_TEMPLATE, eos_after=False)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(_qwen3_config(tok.get_vocab_size(), "Qwen3ForCausalLM")).eval()
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    with torch.no_grad():  # spread the scores around 0.5: opposite yes and no directions
        direction = torch.nn.functional.normalize(torch.randn(64), dim=0)
        model.model.embed_tokens.weight[yes] = direction
        model.model.embed_tokens.weight[no] = -direction
    model.save_pretrained(raw, safe_serialization=True)
    modality = {
        "text": {"method": "forward", "method_output_name": "logits"},
        "message": {"method": "forward", "method_output_name": "logits", "format": "flat"},
    }
    transformer = Transformer(
        str(raw),
        transformer_task="text-generation",
        modality_config=modality,
        module_output_name="causal_logits",
        max_seq_length=256,
    )
    score = LogitScore(true_token_id=yes, false_token_id=no)
    CrossEncoder(modules=[transformer, score]).save(str(dest))
    shutil.rmtree(raw)
    return dest


def build_tiny_bert_embedder(dest: Path, seed: int = 0) -> Path:
    """The embedding demo model's layout (BERT, mean pooling, Normalize, 256 tokens) and
    tokenizer with a random-weight encoder of 2 layers of width 64."""
    import torch
    from transformers import BertConfig, BertModel

    dest.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    BertModel(config).eval().save_pretrained(dest, safe_serialization=True)
    demo = embedding_demo_dir()
    for name in (*_TOKENIZER_FILES, "modules.json", "sentence_bert_config.json"):
        shutil.copy(demo / name, dest / name)
    (dest / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (dest / "2_Normalize").mkdir(exist_ok=True)
    return dest
