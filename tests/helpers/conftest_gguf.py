"""GGUF test material: the demo model fixtures (import the `*_fixture` functions into a test
module to use them as `demo_gguf`, `demo_quantized_dir`, `demo_f32_dir`), and tiny GGUF files written the way llama.cpp's
converter writes them (tensor names from the `gguf` package, q/k rows permuted for llama,
Q8_0/Q4_0/Q4_1 blocks quantized by `gguf.quants`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers.pre_tokenizers import ByteLevel

from mlx_server.models.demo import DEMO_GGUF, demo_model_dir, ensure_demo_gguf, ensure_demo_model

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- the demo model


@pytest.fixture(scope="session", name="demo_gguf")
def demo_gguf_fixture() -> Path:
    """The demo GGUF file (SmolLM2-135M-Instruct Q4_1), fetched once into models/."""
    return ensure_demo_gguf(REPO / DEMO_GGUF)


@pytest.fixture(scope="session", name="demo_quantized_dir")
def demo_quantized_dir_fixture(demo_gguf: Path) -> Path:
    """The demo model imported as the file has it: 8-bit embedding, 4-bit layers."""
    return ensure_demo_model(REPO / demo_model_dir())


@pytest.fixture(scope="session", name="demo_f32_dir")
def demo_f32_dir_fixture(demo_gguf: Path) -> Path:
    """The demo model dequantized to float32: the fast one on a CPU."""
    return ensure_demo_model(REPO / demo_model_dir("float32"), dtype="float32")


# ---------------------------------------------------------------- tiny GGUF files

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}


@dataclass
class TinyGGUF:
    """A tiny GGUF file and the mlx-lm model it should import as."""

    path: Path
    model: Any  # mlx-lm model holding exactly the values the file stores
    tokens: list[str]


def byte_level_vocab() -> list[str]:
    """Specials, the 256 byte symbols of GPT-2's alphabet, and the tokens MERGES make."""
    merged = ["".join(m.split(" ")) for m in MERGES]
    return SPECIALS + sorted(ByteLevel.alphabet()) + merged


def tiny_config(arch: str, *, tie: bool = True, vocab_size: int | None = None) -> dict[str, Any]:
    config = {
        "model_type": arch,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": vocab_size or len(byte_level_vocab()),
        "tie_word_embeddings": tie,
    }
    return config


def build_reference(config: dict[str, Any], seed: int) -> Any:
    """An mlx-lm model with random weights, norms included (so a swapped norm shows)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {
        k: mx.array(rng.normal(1.0 if "norm" in k else 0.0, 0.2, v.shape).astype(np.float32))
        for k, v in tree_flatten(model.parameters())
    }
    model.update(tree_unflatten(list(weights.items())))
    return model


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    quant: dict[str, gguf.GGMLQuantizationType] | None = None,
    tie: bool = True,
    seed: int = 0,
    pre: str = "smollm",
    spm: Any = None,
    rope_scaling: dict[str, Any] | None = None,
) -> TinyGGUF:
    """Write a tiny random model as llama.cpp would, and return its reference model.

    `quant` maps a name fragment (e.g. "token_embd", "blk") to a GGML type for 2-D weights.
    The reference model gets the quantize-dequantize round trip of those weights, so the
    imported model must match it closely. `spm` (a SentencePieceProcessor) replaces the
    byte-level vocabulary with a SentencePiece one. `rope_scaling` (linear or llama3) is
    written as llama.cpp does: metadata for linear, a `rope_freqs` tensor for llama3.
    """
    tokens = byte_level_vocab() if spm is None else spm_vocab(spm)[0]
    config = tiny_config(arch, tie=tie, vocab_size=len(tokens))
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    model = build_reference(config, seed)
    names = gguf.get_tensor_name_map(ARCHS[arch], config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    _write_hparams(writer, arch, config)
    if spm is None:
        _write_byte_level_tokenizer(writer, tokens, pre)
    else:
        _write_sentencepiece_tokenizer(writer, spm)
    reference = {}
    for name, value in tree_flatten(model.parameters()):
        array = np.array(value)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            stored = _llama_cpp_permute(array, heads)
        else:
            stored = array
        kind = _quant_type(gguf_name, array, quant)
        if kind is None:
            writer.add_tensor(gguf_name, stored)
            reference[name] = value
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, kind), raw_dtype=kind)
            reference[name] = mx.array(
                gguf.quants.dequantize(gguf.quants.quantize(array, kind), kind)
            )
    if rope_scaling is not None:
        _write_rope_scaling(writer, config)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.update(tree_unflatten(list(reference.items())))
    return TinyGGUF(path=path, model=model, tokens=tokens)


def _quant_type(gguf_name: str, array: np.ndarray, quant: dict | None):
    if not quant or array.ndim != 2:
        return None
    return next((kind for key, kind in quant.items() if key in gguf_name), None)


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's two rotary halves (row order)."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _write_rope_scaling(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    scaling = config["rope_scaling"]
    kind = scaling.get("rope_type") or scaling["type"]
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
        return
    from mlx_lm.models.rope_utils import Llama3RoPE

    dims, base = config["head_dim"], config["rope_theta"]
    rope = Llama3RoPE(dims, config["max_position_embeddings"], base=base, scaling_config=scaling)
    # Llama3RoPE keeps base**(2i/d) times the factor; the file keeps the factor alone.
    factors = np.array(rope._freqs) / base ** (np.arange(0, dims, 2) / dims)
    writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))


def _write_hparams(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    if arch == "qwen3":
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])


def _write_byte_level_tokenizer(writer: gguf.GGUFWriter, tokens: list[str], pre: str) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def spm_vocab(spm: Any) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and llama.cpp token types of a SentencePiece model, as its converter does."""
    count = spm.get_piece_size()

    def kind(i: int) -> int:
        for test, token_type in (
            (spm.is_unknown, gguf.TokenType.UNKNOWN),
            (spm.is_control, gguf.TokenType.CONTROL),
            (spm.is_byte, gguf.TokenType.BYTE),
            (spm.is_unused, gguf.TokenType.UNUSED),
        ):
            if test(i):
                return int(token_type)
        return int(gguf.TokenType.NORMAL)

    pieces = [spm.id_to_piece(i) for i in range(count)]
    return pieces, [spm.get_score(i) for i in range(count)], [kind(i) for i in range(count)]


def _write_sentencepiece_tokenizer(writer: gguf.GGUFWriter, spm: Any) -> None:
    pieces, scores, types = spm_vocab(spm)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(spm.bos_id())
    writer.add_eos_token_id(spm.eos_id())
    writer.add_unk_token_id(spm.unk_id())
