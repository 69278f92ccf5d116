"""Server processes the tests launch run as a user's install does: without torch. Only the
test tools need it (sentence-transformers, the reference for embeddings), and transformers
imports it whenever it is installed, which costs seconds on every server start. With
``sys.modules["torch"]`` set to None, ``importlib.util.find_spec("torch")`` answers None and
``import torch`` fails, as where torch is not installed."""

import sys

sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
