"""GGUF import on tiny files written the way llama.cpp writes them: weights, tokenizer,
quantization, errors, the cache and the command line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from conftest_gguf import SPECIALS, TinyGGUF, write_tiny_gguf
from mlx_lm import load

from mlx_server.models.gguf import importer as gguf_import
from mlx_server.models.gguf.cli import main as cli_main
from mlx_server.models.gguf.importer import GGUFImportError, import_cached, import_gguf
from mlx_server.models.gguf.reader import read_gguf

Q = gguf.GGMLQuantizationType
PROMPT = mx.array([[5, 80, 17, 200, 33, 101, 7, 250, 64, 9]])


def logits(model) -> np.ndarray:
    return np.array(model(PROMPT).astype(mx.float32))


def imported(tiny: TinyGGUF, dest: Path, **options):
    import_gguf(tiny.path, dest, progress=False, **options)
    return load(str(dest))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [True, False])
def test_float_import_computes_what_the_original_model_computes(tmp_path, arch, tie):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", arch, tie=tie)
    model, _ = imported(tiny, tmp_path / "out", dtype="float32")
    np.testing.assert_allclose(logits(model), logits(tiny.model), atol=1e-4, rtol=1e-4)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] is tie
    assert "quantization" not in config


def test_llama_qk_rows_must_be_put_back_in_order(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama")
    model, _ = imported(tiny, tmp_path / "out", dtype="float32", _undo_qk_permutation=False)
    assert np.abs(logits(model) - logits(tiny.model)).max() > 1e-2


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,  # llama.cpp stores none; every Llama 3 has 8192
}


@pytest.mark.parametrize("scaling", [LLAMA3_SCALING, {"type": "linear", "factor": 4.0}])
def test_rope_scaling_is_recovered(tmp_path, scaling):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", rope_scaling=scaling)
    model, _ = imported(tiny, tmp_path / "out", dtype="float32")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] == scaling
    np.testing.assert_allclose(logits(model), logits(tiny.model), atol=1e-4, rtol=1e-4)


QUANTS = {"token_embd": Q.Q8_0, "blk.0": Q.Q4_0, "blk.1": Q.Q4_1, "output": Q.Q8_0}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_tensors_stay_packed_with_their_own_bits(tmp_path, arch):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", arch, quant=QUANTS, tie=False)
    model, _ = imported(tiny, tmp_path / "out")
    quantization = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert quantization["bits"] == 4 and quantization["group_size"] == 32
    assert quantization["model.embed_tokens"]["bits"] == 8
    assert quantization["lm_head"]["bits"] == 8
    layer = model.model.layers[1]
    assert (layer.self_attn.q_proj.bits, layer.mlp.down_proj.group_size) == (4, 32)
    assert model.model.embed_tokens.bits == 8
    np.testing.assert_allclose(logits(model), logits(tiny.model), atol=2e-3, rtol=2e-3)


def test_partly_quantized_files_mark_float_modules_unquantized(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", quant={"blk.1.ffn": Q.Q8_0})
    model, _ = imported(tiny, tmp_path / "out")
    quantization = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert quantization["bits"] == 8
    assert quantization["model.layers.0.mlp.up_proj"] is False
    assert quantization["model.embed_tokens"] is False
    assert model.model.layers[1].mlp.up_proj.bits == 8
    assert not hasattr(model.model.layers[1].self_attn.q_proj, "bits")
    np.testing.assert_allclose(logits(model), logits(tiny.model), atol=2e-3, rtol=2e-3)


def test_dequantized_import_matches_the_quantized_one(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", quant=QUANTS)
    packed, _ = imported(tiny, tmp_path / "packed")
    dense, _ = imported(tiny, tmp_path / "dense", dtype="float32")
    assert not hasattr(dense.model.layers[0].self_attn.q_proj, "bits")
    np.testing.assert_allclose(logits(dense), logits(packed), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_imports_store_that_dtype(tmp_path, dtype):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "qwen3", quant=QUANTS)
    model, _ = imported(tiny, tmp_path / "out", dtype=dtype)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == getattr(mx, dtype)
    assert model.model.norm.weight.dtype == getattr(mx, dtype)


def test_tokenizer_special_tokens_template_and_eos(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama")
    _, tokenizer = imported(tiny, tmp_path / "out", dtype="float32")
    for token in SPECIALS:
        assert tokenizer.encode(token, add_special_tokens=False) == [tiny.tokens.index(token)]
    ids = tokenizer.encode(" the the", add_special_tokens=False)
    assert [tiny.tokens[i] for i in ids] == ["Ġthe", "Ġthe"]
    assert tokenizer.encode("the", add_special_tokens=True)[0] != tiny.tokens.index("<|im_start|>")
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.tokens.index("<|im_end|>") in tokenizer.eos_token_ids
    assert tokenizer.eos_token == "<|im_end|>"


def test_pre_tokenizer_splits_digits_one_by_one_for_smollm(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", pre="smollm")
    _, tokenizer = imported(tiny, tmp_path / "out", dtype="float32")
    assert len(tokenizer.encode("2024", add_special_tokens=False)) == 4
    assert tokenizer.decode(tokenizer.encode(" 12 apples\n\n  ok", add_special_tokens=False)) == (
        " 12 apples\n\n  ok"
    )


def test_unknown_pre_tokenizer_is_refused_by_name(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", pre="no-such-pre")
    with pytest.raises(GGUFImportError, match="no-such-pre.*supported:.*smollm"):
        import_gguf(tiny.path, tmp_path / "out", progress=False)


SPM_CORPUS = [
    "The town library opened in 1923 in a small brick building next to the railway station.",
    "Volunteers carried the books over one box at a time, every Saturday morning.",
    "A retired teacher kept the keys and wrote every loan by hand in a notebook.",
    "Ünïcödé façade naïve café résumé",
]


@pytest.fixture(scope="module")
def sentencepiece_model():
    """A small SentencePiece BPE model trained like Llama's: no normalization, byte fallback."""
    import io

    import sentencepiece

    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS * 4),
        model_writer=proto,
        model_type="bpe",
        vocab_size=300,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        minloglevel=2,
    )
    return sentencepiece.SentencePieceProcessor(model_proto=proto.getvalue())


def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece_does(tmp_path, sentencepiece_model):
    sp = sentencepiece_model
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", spm=sp)
    _, tokenizer = imported(tiny, tmp_path / "out", dtype="float32")
    texts = SPM_CORPUS + ["  two  spaces", "tab\there\nnew line", "emoji 🙂 and 中文", "1923!"]
    for text in texts:
        assert tokenizer.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)]  # add_bos by default
        assert tokenizer.decode(sp.encode(text)) == text
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        for token in sp.encode(text):
            detokenizer.add_token(token)
        detokenizer.finalize()
        # mlx-lm's SentencePiece streaming detokenizer drops the text's leading spaces.
        assert detokenizer.text == text.lstrip(" ")


# ---------------------------------------------------------------- files that cannot be imported


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("g") / "good.gguf", "llama").path


def truncated(src: Path, dest: Path) -> Path:
    dest.write_bytes(src.read_bytes()[: src.stat().st_size * 2 // 3])
    return dest


def corrupted(src: Path, dest: Path) -> Path:
    data = bytearray(src.read_bytes())
    data[40:400] = b"\xff" * 360  # the metadata: string lengths become absurd
    dest.write_bytes(bytes(data))
    return dest


def not_gguf(src: Path, dest: Path) -> Path:
    dest.write_text("<html>404 Not Found</html>\n")
    return dest


def empty(src: Path, dest: Path) -> Path:
    dest.write_bytes(b"")
    return dest


BROKEN = {
    "truncated": (truncated, "truncated or corrupt.*past the end"),
    "corrupted": (corrupted, "truncated or corrupt"),
    "not-gguf": (not_gguf, "not a GGUF file"),
    "empty": (empty, "not a GGUF file"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_damaged_files_fail_clearly(tmp_path, good_gguf, kind):
    make, message = BROKEN[kind]
    bad = make(good_gguf, tmp_path / f"{kind}.gguf")
    with pytest.raises(GGUFImportError, match=message):
        import_gguf(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_import_command_exits_1_on_damaged_files(tmp_path, good_gguf, kind):
    bad = BROKEN[kind][0](good_gguf, tmp_path / f"{kind}.gguf")
    done = subprocess.run(
        [sys.executable, "-m", "mlx_server.models.gguf.cli", str(bad), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={
            "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
            "PATH": "/usr/bin:/bin",
        },
    )
    assert done.returncode == 1
    assert done.stderr.startswith("mlx-server-import: error: ") and "Traceback" not in done.stderr


def write_raw_tensor(path: Path, kind, raw: np.ndarray) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=kind)
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 256), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sane_blocks(kind, rows: int = 4, cols: int = 512) -> np.ndarray:
    """Random blocks of a GGML type, with its float16 super-block scales set to 0.01."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if kind in (Q.F16, Q.BF16):
        values = np.random.default_rng(0).normal(0, 1, (rows, cols)).astype(np.float32)
        return gguf.quants.quantize(values, kind)
    raw = np.random.default_rng(0).integers(0, 255, (rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    where = {Q.Q2_K: [-4, -2], Q.Q6_K: [-2], Q.Q4_K: [0, 2]}[kind]
    for at in where:
        raw[..., at : at + 2 if at != -2 else None] = scale
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", [Q.F16, Q.BF16, Q.Q2_K, Q.Q6_K])
def test_types_read_as_float_match_the_reference_dequantizer(tmp_path, kind):
    raw = sane_blocks(kind)
    path = write_raw_tensor(tmp_path / "f.gguf", kind, raw)
    got = read_gguf(path).tensors["blk.0.ffn_up.weight"].astype(mx.float32)
    expected = gguf.quants.dequantize(raw, kind)
    np.testing.assert_allclose(np.array(got), expected, rtol=2e-3, atol=1e-4)


def test_q4_k_is_refused_because_mlx_misreads_it(tmp_path):
    raw = sane_blocks(Q.Q4_K)
    path = write_raw_tensor(tmp_path / "k.gguf", Q.Q4_K, raw)
    misread = np.array(mx.load(str(path))["blk.0.ffn_up.weight"].astype(mx.float32))
    assert np.abs(misread - gguf.quants.dequantize(raw, Q.Q4_K)).max() > 0.1  # why it is refused
    with pytest.raises(GGUFImportError, match=r"Q4_K \(1 tensors\).*llama-quantize"):
        import_gguf(path, tmp_path / "out", progress=False)


def test_types_mlx_cannot_read_are_named(tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.zeros((4, 256 // block * size), dtype=np.uint8)
    path = write_raw_tensor(tmp_path / "iq.gguf", Q.IQ4_NL, raw)
    with pytest.raises(GGUFImportError, match=r"IQ4_NL \(1 tensors\).*Supported: Q4_0, Q4_1, Q8_0"):
        import_gguf(path, tmp_path / "out", progress=False)


def test_unsupported_architecture_is_named(tmp_path, good_gguf):
    data = good_gguf.read_bytes().replace(b"llama", b"gemma", 1)
    (tmp_path / "g.gguf").write_bytes(data)
    with pytest.raises(
        GGUFImportError, match="'gemma' is not supported; supported: llama, qwen2, qwen3"
    ):
        import_gguf(tmp_path / "g.gguf", tmp_path / "out", progress=False)


# ---------------------------------------------------------------- cache and command line


def test_import_cached_keys_by_content_and_imports_once(tmp_path, monkeypatch, good_gguf):
    monkeypatch.setenv("MLX_SERVER_CACHE", str(tmp_path / "cache"))
    first = import_cached(good_gguf, dtype="float32")
    digest = hashlib.sha256(good_gguf.read_bytes()).hexdigest()
    assert first.parent == tmp_path / "cache" / "gguf" / digest
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()

    def no_second_import(*args, **kwargs):
        raise AssertionError("imported again")

    monkeypatch.setattr(gguf_import, "import_gguf", no_second_import)
    assert import_cached(good_gguf, dtype="float32") == first
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(good_gguf.read_bytes())
    assert import_cached(copy, dtype="float32") == first
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging left behind


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_SERVER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gguf_import.cache_dir() == tmp_path / "mlx-server"
    monkeypatch.setenv("MLX_SERVER_CACHE", str(tmp_path / "x"))
    assert gguf_import.cache_dir() == tmp_path / "x"


def test_import_command_writes_a_loadable_model(tmp_path, good_gguf, capsys):
    assert cli_main([str(good_gguf), str(tmp_path / "out"), "--dtype", "float32", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    model, tokenizer = load(str(tmp_path / "out"))
    assert tokenizer.decode(tokenizer.encode("hello there")) == "hello there"
