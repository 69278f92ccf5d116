"""What we rely on in mlx-embeddings (pinned in pyproject.toml): its loader and its model
classes, including the private ``_get_classes`` the cross-encoder head is built on. A
failure here means the pin moved and models/embedding.py or models/cross_encoder.py must
follow."""

from __future__ import annotations

import inspect
from importlib.metadata import version

import mlx.core as mx
import pytest

TINY_BERT = {
    "model_type": "bert",
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "max_position_embeddings": 32,
    "vocab_size": 50,
}


def test_the_pinned_version():
    assert version("mlx-embeddings") == "0.1.0"


def test_get_classes_gives_the_bert_model_and_its_args():
    from mlx_embeddings.utils import _get_classes

    model_class, args_class, text, vision = _get_classes(TINY_BERT)
    assert (text, vision) == (None, None)
    args = args_class.from_dict({**TINY_BERT, "unknown_key": 1})  # unknown keys are ignored
    model = model_class(args)
    model.eval()  # dropout off, as load_model leaves it
    ids = mx.array([[1, 5, 7, 2], [1, 9, 2, 0]])
    mask = mx.array([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=mx.float32)
    out = model(ids, token_type_ids=mx.zeros_like(ids), attention_mask=mask)
    assert out.last_hidden_state.shape == (2, 4, 16)
    assert out.pooler_output.shape == (2, 16)  # the cross-encoder head reads this
    # Padding does not reach the other tokens: the padded row equals the unpadded one.
    alone = model(ids[1:, :3], attention_mask=mask[1:, :3]).last_hidden_state
    assert mx.allclose(alone, out.last_hidden_state[1:, :3], atol=1e-5)


@pytest.mark.parametrize("model_type", ["bert", "xlm_roberta", "modernbert", "qwen3"])
def test_encoder_models_take_an_attention_mask_by_keyword(model_type):
    import importlib

    module = importlib.import_module(f"mlx_embeddings.models.{model_type}")
    params = inspect.signature(module.Model.__call__).parameters
    assert "input_ids" in params and "attention_mask" in params


def test_load_model_reads_a_directory(tmp_path):
    import json

    from mlx.utils import tree_flatten
    from mlx_embeddings.utils import _get_classes, load_model

    model_class, args_class, _, _ = _get_classes(TINY_BERT)
    model = model_class(args_class.from_dict(TINY_BERT))
    model.eval()
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(TINY_BERT))
    loaded = load_model(tmp_path, path_to_repo=str(tmp_path))
    ids = mx.array([[1, 2, 3]])
    assert mx.allclose(loaded(ids).last_hidden_state, model(ids).last_hidden_state, atol=1e-6)


def test_xlm_roberta_builds_without_its_pooler():
    """The XLM-R cross-encoder's encoder: a sequence classifier's checkpoint has no pooler."""
    from mlx.utils import tree_flatten
    from mlx_embeddings.utils import _get_classes

    config = {**TINY_BERT, "model_type": "xlm_roberta", "add_pooling_layer": False}
    model_class, args_class, _, _ = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    assert not any(k.startswith("pooler.") for k, _ in tree_flatten(model.parameters()))
    ids = mx.array([[0, 5, 7, 2], [0, 9, 2, 1]])  # 1 is XLM-R's padding id
    mask = mx.array([[1, 1, 1, 1], [1, 1, 1, 0]])
    assert model(ids, attention_mask=mask).last_hidden_state.shape == (2, 4, 16)


def test_load_model_takes_config_overrides(tmp_path):
    """models/embedding.py passes the config with ``rope_theta`` lifted out of
    transformers 5's ``rope_parameters`` as ``model_config``."""
    import json

    from mlx.utils import tree_flatten
    from mlx_embeddings.utils import _get_classes, load_model

    config = {
        "model_type": "qwen3",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "vocab_size": 50,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    model_class, args_class, _, _ = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(config))
    plain = load_model(tmp_path, path_to_repo=str(tmp_path))
    assert plain.config.rope_theta == 1000000.0  # its own default: why the override exists
    fixed = load_model(tmp_path, model_config={"rope_theta": 10000.0}, path_to_repo=str(tmp_path))
    assert fixed.config.rope_theta == 10000.0
