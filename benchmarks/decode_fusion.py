"""Would fusing a decoder layer's products speed up the CPU decode? An A/B on the packed path.

A decode step of a GRPO group multiplies 8 rows by every weight matrix. This times the 7 oneDNN
products of a SmolLM2-135M layer (q, k, v, o, gate, up, down; ``grooves.policy.packing.PackedLinear``)
against 4 (q/k/v as one matrix, o, gate/up as one, down), over 30 layers of distinct weights (so the
weights come from memory, as in the model), alternating rounds. It ends with one line:
``decode_fusion separate_ms=X fused_ms=Y ratio=X/Y threads=N``.

    python benchmarks/decode_fusion.py [--rounds 8] [--rows 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from grooves.policy.packing import PackedLinear

HIDDEN, KV, FFN, LAYERS = 576, 192, 1536, 30  # SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8, help="rows decoded together (a group)")
    args = parser.parse_args()
    torch.manual_seed(0)
    shapes = {"q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN),
              "gate": (FFN, HIDDEN), "up": (FFN, HIDDEN), "down": (HIDDEN, FFN)}
    separate, fused = [], []
    for _ in range(LAYERS):
        w = {name: torch.randn(*shape) * 0.02 for name, shape in shapes.items()}
        separate.append({name: PackedLinear(t, None) for name, t in w.items()})
        fused.append({"qkv": PackedLinear(torch.cat([w["q"], w["k"], w["v"]]), None), "o": PackedLinear(w["o"], None),
                      "gate_up": PackedLinear(torch.cat([w["gate"], w["up"]]), None),
                      "down": PackedLinear(w["down"], None)})
    x, h = torch.randn(args.rows, 1, HIDDEN), torch.randn(args.rows, 1, FFN)

    def run_separate():
        for layer in separate:
            for name in ("q", "k", "v", "o", "gate", "up"):
                layer[name](x)
            layer["down"](h)

    def run_fused():
        for layer in fused:
            layer["qkv"](x).split([HIDDEN, KV, KV], -1)
            layer["o"](x)
            layer["gate_up"](x).split([FFN, FFN], -1)
            layer["down"](h)

    sides = {"separate": run_separate, "fused": run_fused}
    for run in sides.values():
        for _ in range(20):
            run()
    times = {name: [] for name in sides}
    for round_ in range(args.rounds):
        for name in (("separate", "fused") if round_ % 2 == 0 else ("fused", "separate")):
            start = time.perf_counter()
            for _ in range(100):
                sides[name]()
            times[name].append((time.perf_counter() - start) / 100 * 1e3)
    for name, values in times.items():
        print(f"{name:>8}: {statistics.median(values):.2f} ms for {LAYERS} layers (median of {args.rounds}; "
              f"{min(values):.2f}-{max(values):.2f})")
    a, b = statistics.median(times["separate"]), statistics.median(times["fused"])
    print(f"decode_fusion separate_ms={a:.2f} fused_ms={b:.2f} ratio={a / b:.3f} threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
