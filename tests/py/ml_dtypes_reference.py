#!/usr/bin/env python3
"""Writes ml_dtypes' answers for fp8moe's codec test (tests/unit/test_numerics_codecs.cpp).

ml_dtypes is an independent implementation of float8_e4m3fn, float8_e4m3fnuz, float8_e5m2,
float8_e8m0fnu and bfloat16. This script draws a seeded set of float32 inputs (uniform bit
patterns, values spread over the fp8 ranges, exact midpoints between neighbouring codes, every
bf16 value) and writes, next to the inputs, the code ml_dtypes gives for each format:

  inputs.f32             float32[N]
  <fmt>.nonsat.u8        uint8[N]   plain cast x.astype(fmt)
  <fmt>.sat.u8           uint8[N]   np.clip(x, -max, max).astype(fmt)   (vLLM quantiser semantics)
  e8m0.u8                uint8[N]   x.astype(float8_e8m0fnu)
  bf16.u16               uint16[N]  x.astype(bfloat16)
  decode.<fmt>.f32       float32[256] value of every code

Usage: ml_dtypes_reference.py OUT_DIR [N_RANDOM]
"""
import os
import sys

import ml_dtypes
import numpy as np

FORMATS = {
    "e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0),
    "e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, 240.0),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0),
}


def midpoints(dtype):
    """Exact midpoints (and their neighbours one float ulp away) between adjacent finite codes."""
    codes = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    vals = np.unique(codes[np.isfinite(codes)])
    mids = (vals[:-1] + vals[1:]) / 2.0
    mids32 = mids.astype(np.float32)
    up = np.nextafter(mids32, np.float32(np.inf))
    down = np.nextafter(mids32, np.float32(-np.inf))
    return np.concatenate([mids32, up, down, vals.astype(np.float32)])


def main():
    out = sys.argv[1]
    n_random = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 22
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20240531)
    parts = [
        rng.integers(0, 1 << 32, size=n_random // 2, dtype=np.uint64).astype(np.uint32).view(np.float32),
        (rng.uniform(1.0, 2.0, size=n_random // 2) * np.exp2(rng.integers(-28, 20, size=n_random // 2))
         * rng.choice([-1.0, 1.0], size=n_random // 2)).astype(np.float32),
        np.arange(1 << 16, dtype=np.uint32).astype(np.uint32).__lshift__(16).view(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448.0, 464.0, 480.0, 240.0, 248.0,
                  57344.0, 61440.0, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 2.0**-127, 2.0**-126,
                  2.0**127, 1e-45], dtype=np.float32),
    ]
    for dtype, _ in FORMATS.values():
        m = midpoints(dtype)
        parts += [m, -m]
    x = np.concatenate(parts).astype(np.float32)
    x.tofile(os.path.join(out, "inputs.f32"))
    with np.errstate(invalid="ignore", over="ignore"):
        for name, (dtype, fmax) in FORMATS.items():
            x.astype(dtype).view(np.uint8).tofile(os.path.join(out, f"{name}.nonsat.u8"))
            np.clip(x, -fmax, fmax).astype(dtype).view(np.uint8).tofile(
                os.path.join(out, f"{name}.sat.u8"))
            np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32).tofile(
                os.path.join(out, f"decode.{name}.f32"))
        x.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8).tofile(os.path.join(out, "e8m0.u8"))
        np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32).tofile(
            os.path.join(out, "decode.e8m0.f32"))
        x.astype(ml_dtypes.bfloat16).view(np.uint16).tofile(os.path.join(out, "bf16.u16"))
    print(f"wrote {x.size} inputs to {out}")


if __name__ == "__main__":
    main()
