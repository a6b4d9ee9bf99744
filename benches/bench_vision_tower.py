"""Vision tower benchmark: ferrox's CLIP tower (models/vision) vs transformers' CLIPVisionModel at llava-1.5's
shape (CLIP ViT-L/14 at 336 px: 577 tokens, 24 layers of width 1024; random weights), one image, float32, on
this machine's CPU (or --device cuda), in one process, interleaved runs.

    .venv/bin/python benches/bench_vision_tower.py [--repeat 3] [--device cpu]

ferrox builds only the layers up to LLaVA's vision_feature_layer (-2: 23 of 24) as vLLM does; transformers runs
all 24 and returns every hidden state. Both produce the same feature (checked). Prints the best of --repeat for
each, then last `vision_tower_speedup: <transformers / ferrox>`.
"""

from __future__ import annotations

import argparse
import time

import torch

CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from ferrox.models.vision import build_vision_tower
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    reference = CLIPVisionModel(CLIPVisionConfig(**CLIP_L_336)).eval().to(args.device)
    tower = build_vision_tower({"model_type": "clip_vision_model", **CLIP_L_336}, dtype=torch.float32,
                               device=args.device, feature_layer=-2)
    tower.load_weights(reference.state_dict().items())
    pixels = torch.randn(1, 3, 336, 336, device=args.device)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    timings: dict[str, list[float]] = {"transformers": [], "ferrox": []}
    with torch.inference_mode():
        want = reference(pixels, output_hidden_states=True).hidden_states[-2]
        got = tower(pixels)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for _ in range(args.repeat):
            for name, run in (("transformers", lambda: reference(pixels, output_hidden_states=True)),
                              ("ferrox", lambda: tower(pixels))):
                sync()
                start = time.perf_counter()
                run()
                sync()
                timings[name].append(time.perf_counter() - start)
    best = {name: min(t) for name, t in timings.items()}
    print(f"| tower (CLIP ViT-L/14-336, 1 image, float32, {args.device}) | seconds |")
    print("| --- | --- |")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.3f} |")
    print(f"vision_tower_speedup: {best['transformers'] / best['ferrox']:.2f}")


if __name__ == "__main__":
    main()
