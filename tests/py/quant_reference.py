#!/usr/bin/env python3
"""numpy + ml_dtypes versions of vLLM's FP8 quantisers, for tests/unit/test_numerics_quant.cpp.

Reads IN_DIR/x.f32 (float32, shape (R, C) with R, C given on the command line) and writes, for
each quantiser, the fp8 codes (uint8) and the scales (float32, or uint8 e8m0 codes for MX):

  group{32,64,128}[_ue8m0].{q,s}  per_token_group_quant_fp8 (fp32: amax floored at 1e-10,
                                  s = amax / 448, s rounded up to a power of two for UE8M0,
                                  q = fp8(clip(x / s, -448, 448)))
  token.{q,s}                     per-token dynamic: s = max(amax / 448, 1 / (448 * 512))
  tensor.{q,s}                    per-tensor dynamic: s = amax / 448, q = fp8(clip(x * (1/s)))
  mx.{q,s}                        MXFP8: s = 2^ceil(log2(max(amax, 2^-126) / 448)), e8m0 code
  block64.{q,s}                   per_block_cast_to_fp8 with [64, 64] blocks
  fnuz_group128.{q,s}             per-token-group with e4m3fnuz and max 224

Usage: quant_reference.py IN_DIR R C
"""
import os
import sys

import ml_dtypes
import numpy as np

F32 = np.float32


def ceil_pow2(s):
    """Smallest power of two >= s (s > 0, float32), exactly, via frexp."""
    m, e = np.frexp(s.astype(np.float64))
    e = np.where(m == 0.5, e - 1, e)
    return np.ldexp(np.float64(1.0), e).astype(F32)


def group_quant(x, g, fmax=448.0, dtype=ml_dtypes.float8_e4m3fn, ue8m0=False):
    r, c = x.shape
    xg = x.reshape(r, c // g, g)
    amax = np.maximum(np.abs(xg).max(axis=-1), F32(1e-10))
    s = (amax / F32(fmax)).astype(F32)
    if ue8m0:
        s = ceil_pow2(np.maximum(s, F32(1e-10)))
    q = np.clip(xg / s[..., None], F32(-fmax), F32(fmax)).astype(dtype)
    return q.reshape(r, c).view(np.uint8), s


def token_quant(x):
    amax = np.abs(x).max(axis=-1)
    s = np.maximum((amax / F32(448.0)).astype(F32), F32(1.0) / F32(448.0 * 512.0))
    q = np.clip(x / s[:, None], F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn)
    return q.view(np.uint8), s


def tensor_quant(x):
    s = F32(np.abs(x).max() / F32(448.0))
    inv = F32(1.0) / s
    q = np.clip(x * inv, F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn)
    return q.view(np.uint8), np.array([s], dtype=F32)


def mx_quant(x):
    r, c = x.shape
    xg = x.reshape(r, c // 32, 32)
    amax = np.maximum(np.abs(xg).max(axis=-1), F32(2.0**-126))
    v = (amax / F32(448.0)).astype(F32)
    m, e = np.frexp(v.astype(np.float64))
    e = np.where(m == 0.5, e - 1, e)  # ceil(log2(v))
    code = np.clip(e + 127, 0, 254).astype(np.uint8)
    scale = np.ldexp(np.float64(1.0), code.astype(np.int64) - 127).astype(F32)
    q = np.clip(xg / scale[..., None], F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(r, c).view(np.uint8), code


def block_cast(x, bn, bk):
    r, c = x.shape
    pr, pc = -(-r // bn) * bn, -(-c // bk) * bk
    xp = np.zeros((pr, pc), dtype=F32)
    xp[:r, :c] = x
    xv = xp.reshape(pr // bn, bn, pc // bk, bk)
    amax = np.maximum(np.abs(xv).max(axis=(1, 3)), F32(1e-4))
    sf = (amax / F32(448.0)).astype(F32)
    q = (xv * (F32(1.0) / sf)[:, None, :, None]).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(pr, pc)[:r, :c].view(np.uint8), sf


def main():
    d, r, c = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    x = np.fromfile(os.path.join(d, "x.f32"), dtype=F32).reshape(r, c)
    out = {}
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for g in (32, 64, 128):
            out[f"group{g}"] = group_quant(x, g)
            out[f"group{g}_ue8m0"] = group_quant(x, g, ue8m0=True)
        out["token"] = token_quant(x)
        out["tensor"] = tensor_quant(x)
        out["mx"] = mx_quant(x)
        out["block64"] = block_cast(x, 64, 64)
        out["fnuz_group128"] = group_quant(x, 128, 224.0, ml_dtypes.float8_e4m3fnuz)
    for name, (q, s) in out.items():
        np.ascontiguousarray(q).tofile(os.path.join(d, f"{name}.q"))
        np.ascontiguousarray(s).tofile(os.path.join(d, f"{name}.s"))
    print(f"wrote {len(out)} quantisations of a ({r}, {c}) input")


if __name__ == "__main__":
    main()
