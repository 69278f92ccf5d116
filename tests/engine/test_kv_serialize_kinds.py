"""The disk tier's file contents hold every cache kind mlx-lm makes: a state written and read
back continues exactly as the state in memory would, on every architecture family."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from arch_models import FAMILIES, WINDOW, build
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlx_server.engine.cache import serialize as kv_serialize
from mlx_server.engine.cache.disk import DiskPromptCache

pytestmark = pytest.mark.tiny


def _through_file(cache: list, n_tokens: int, path: Path) -> list:
    """Serialize, write with MLX's safetensors writer, read back, deserialize."""
    packed = kv_serialize.serialize(cache, n_tokens)
    assert packed is not None
    arrays, metadata, _ = packed
    mx.save_safetensors(str(path), arrays, metadata)
    loaded, meta = mx.load(str(path), return_metadata=True)
    return kv_serialize.deserialize(loaded, meta)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("arch")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_state_read_back_continues_as_the_original(families: Path, name: str, tmp_path):
    from mlx_lm import load

    model, _ = load(str(build(name, families / name)))
    prompt = mx.array([(7 * i + 3) % 200 + 10 for i in range(3 * WINDOW)])
    cache = make_prompt_cache(model)
    model(prompt[None, :-1], cache=cache)
    mx.eval([c.state for c in cache])
    back = _through_file(cache, len(prompt) - 1, tmp_path / "state.safetensors")

    assert [type(c).__name__ for c in back] == [type(c).__name__ for c in cache]
    for _ in range(3):  # the last prompt token, then two generated ones
        want = model(prompt[None, -1:], cache=cache)
        got = model(prompt[None, -1:], cache=back)
        assert mx.array_equal(want, got).item(), name
        prompt = mx.concatenate([prompt, mx.argmax(want[0, -1:], axis=-1)])


def _kv(n: int) -> tuple[mx.array, mx.array]:
    k = mx.arange(2 * n * 8, dtype=mx.float32).reshape(1, 2, n, 8)
    return k, k + 1


def test_every_kind_round_trips(tmp_path):
    k, v = _kv(10)
    plain = KVCache()
    plain.update_and_fetch(k, v)
    quant = QuantizedKVCache(group_size=32, bits=8)
    quant.update_and_fetch(mx.tile(k, (1, 1, 1, 4)), mx.tile(v, (1, 1, 1, 4)))
    rotating = RotatingKVCache(max_size=4, keep=1)
    for i in range(10):
        rotating.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
    arrays = ArraysCache(2)
    arrays[0], arrays[1] = mx.ones((1, 3, 4)), None
    chunked = ChunkedKVCache(chunk_size=6)
    chunked.update_and_fetch(k, v)
    nested = CacheList(KVCache(), ArraysCache(1))
    nested[0].update_and_fetch(k, v)
    nested[1][0] = mx.zeros((1, 2))
    cache = [plain, quant, rotating, arrays, chunked, nested]

    back = _through_file(cache, 10, tmp_path / "kinds.safetensors")

    assert [type(c).__name__ for c in back] == [
        "KVCache", "BatchableQuantizedKVCache", "RotatingKVCache", "ArraysCache",
        "ChunkedKVCache", "CacheList",
    ]  # fmt: skip
    assert back[0].keys.shape[-2] == 10  # cut to its tokens, not its 256-token buffer
    for a, b in zip(cache, back, strict=True):
        sa, sb = tree_flatten(a.state), tree_flatten(b.state)
        assert len(sa) == len(sb)
        for (_, x), (_, y) in zip(sa, sb, strict=True):
            if isinstance(x, mx.array):
                assert mx.array_equal(x[..., : y.shape[-2], :] if x.ndim > 2 else x, y).item()
            else:
                assert x == y
    assert back[2].offset == 10 and not back[2].is_trimmable()


def test_a_layer_without_the_state_contract_is_refused(tmp_path):
    class Odd:
        offset = 3
        state = (mx.zeros(3),)

    with pytest.raises(kv_serialize.Unsupported):
        kv_serialize.serialize([Odd()], 3)


def test_files_of_the_first_format_are_not_read(tmp_path):
    """A manifest of another format version lists nothing: its files are deleted at start."""
    import json

    (tmp_path / "index.json").write_text(json.dumps({"version": 1, "entries": {"x": {}}}))
    (tmp_path / "x.safetensors").write_bytes(b"old")
    disk = DiskPromptCache(tmp_path, 1 << 30, min_tokens=1)
    try:
        assert disk.stats()["prompt_cache_disk_entries"] == 0
        assert not (tmp_path / "x.safetensors").exists()
    finally:
        disk.close(5)
