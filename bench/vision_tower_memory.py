"""The vision tower's peak memory against the admission estimate (runners/vision_memory.py).

Builds random-weight SigLIP towers (Gemma 3's, as mlx-vlm builds them) of a real width,
encodes one image, and prints MLX's peak memory over the call next to ``tower_bytes``.

    PYTHONPATH=src .venv/bin/python bench/vision_tower_memory.py [--layers 2 4] [--side 224 448]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import mlx.core as mx
from mlx_vlm.models.gemma3 import VisionConfig
from mlx_vlm.models.gemma3.vision import VisionModel

from mlx_server.engine.runners.vision_memory import tower_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--side", type=int, nargs="+", default=[224, 448])
    ap.add_argument("--hidden", type=int, default=1152)
    ap.add_argument("--intermediate", type=int, default=4304)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    print("layers side patches measured_MiB estimate_MiB ratio")
    for layers in args.layers:
        for side in args.side:
            cfg = VisionConfig(
                model_type="siglip_vision_model",
                num_hidden_layers=layers,
                hidden_size=args.hidden,
                intermediate_size=args.intermediate,
                num_attention_heads=args.heads,
                patch_size=14,
                image_size=side,
            )
            tower = VisionModel(cfg)
            mx.eval(tower.parameters())
            pixels = mx.random.normal((1, 3, side, side))
            mx.eval(pixels)
            mx.clear_cache()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            out = tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
            mx.eval(out[0])
            measured = mx.get_peak_memory() - base
            del out
            vlm = SimpleNamespace(config=SimpleNamespace(vision_config=cfg))
            estimate = tower_bytes(vlm, {"pixel_values": pixels})
            patches = (side // 14) ** 2
            print(
                f"{layers} {side} {patches} {measured / 2**20:.1f} {estimate / 2**20:.1f} "
                f"{estimate / max(1, measured):.2f}"
            )


if __name__ == "__main__":
    main()
