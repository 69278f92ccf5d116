"""The vendored chat templates (tests/data/templates, see PROVENANCE.md) on a tiny tokenizer.

Each template is served in process: a real mlx-lm tokenizer carrying the template (so tool
format and think tags are detected as on a real model), the real ``ChatService`` and app,
a scripted engine in place of the model.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import cache
from pathlib import Path

from tiny_model import SPECIALS, build_tiny_model, build_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"

# Harmony (gpt-oss) control tokens: single tokens in the real vocabulary.
HARMONY_SPECIALS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
    "<|startoftext|>",
]
CORPUS_SPECIALS = [*SPECIALS, *HARMONY_SPECIALS, "<s>", "</s>"]

# Special tokens the templates read, by file-name prefix (as in the models' tokenizer
# configs); others get <s> and </s>.
SPECIAL_TOKENS = {
    "openai-gpt-oss": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"},
    "Qwen": {"bos_token": None, "eos_token": "<|im_end|>"},
}


def template_files() -> list[Path]:
    return sorted(TEMPLATES.glob("*.jinja"))


def raise_messages(source: str) -> list[str]:
    """The literal text of each ``raise_exception(...)`` call's message in a template."""
    found = re.findall(r"raise_exception\(\s*(\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*')", source)
    return [m[1:-1] for m in found]


@cache
def _base_tokenizer(root: Path) -> Path:
    base = root / "_base"
    base.mkdir(parents=True, exist_ok=True)
    build_tokenizer(base, specials=CORPUS_SPECIALS)
    return base


def tokenizer_dir(root: Path, template: Path) -> Path:
    """A tokenizer directory that carries ``template``."""
    out = root / template.stem
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(_base_tokenizer(root) / "tokenizer.json", out / "tokenizer.json")
    _write_config(out, template)
    return out


def model_dir(root: Path, template: Path) -> Path:
    """A tiny random-weight model whose tokenizer carries ``template``."""
    out = build_tiny_model(
        root / f"model-{template.stem}",
        template=template.read_text(encoding="utf-8"),
        specials=CORPUS_SPECIALS,
    )
    _write_config(out, template)
    return out


def _write_config(out: Path, template: Path) -> None:
    special = next(
        (v for k, v in SPECIAL_TOKENS.items() if template.name.startswith(k)),
        {"bos_token": "<s>", "eos_token": "</s>"},
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": template.read_text(encoding="utf-8"),
        "model_max_length": 4096,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def load_tokenizer(path: Path):
    from mlx_lm.tokenizer_utils import load

    return load(path)
