"""Build a tiny random-weight mlx-lm model with a real BPE tokenizer and a ChatML template."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}"
    "{{ '<tool_call>\n' + (tc.function | tojson) + '\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]

# A variant's extra special tokens: Qwen2.5-Coder's fill-in-the-middle spelling.
FIM_SPECIALS = [
    *SPECIALS,
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
    "<|fim_pad|>",
    "<|file_sep|>",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! What is the capital of France? Paris is the capital.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols {}[]():;,.'\"<>/\\|!@#$%^&*-_=+",
    "system user assistant tool function arguments name content",
]


def build_tokenizer(
    path: Path, template: str = CHATML, specials: list[str] = SPECIALS, *, spm: bool = False
) -> None:
    """A byte-level BPE tokenizer (GPT-2's, SmolLM2's, Qwen's kind); ``spm``: one of
    sentencepiece's kind instead (Llama 2's, Mistral's: spaces as ``▁``, the decoder drops
    the text's leading space), which mlx-lm streams with its SPM detokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=spm))
    alphabet = []
    if spm:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        # Words start with their "▁", as sentencepiece trains them.
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": template,
        "model_max_length": 4096,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


# The tiny Llama's shape (two layers, grouped-query attention), for the models built here and
# the language half of the tiny vision models.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}


def build_tiny_model(
    path: Path, *, template: str = CHATML, seed: int = 0, specials: list[str] = SPECIALS
) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into ``path``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, template, specials)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    vocab_size = max(len(vocab) + len(specials), 64)
    config = {
        **TINY_LLAMA,
        "vocab_size": vocab_size,
        "tie_word_embeddings": True,
        "eos_token_id": vocab["<|im_end|>"] if "<|im_end|>" in vocab else 2,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path
