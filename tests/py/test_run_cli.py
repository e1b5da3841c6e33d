#!/usr/bin/env python3
"""fp8moe run / bench end to end, against an independent numpy implementation.

Writes a small Qwen3-MoE-shaped FP8 block checkpoint with its own safetensors writer (numpy +
ml_dtypes, nothing of fp8moe), runs `fp8moe run --check --output`, and recomputes the layer in
numpy from the checkpoint's real-valued weights' quantisation: routing (softmax, top-k, renorm),
per-1x128-group activation quantisation, GEMM1 with dequantised block weights, bf16 rounding,
SiLU*up, the second quantisation, GEMM2, the router weight and the top-k sum. The CLI's output
must agree within vLLM's block-FP8 tolerance (atol = rtol = 0.035) and be very close on average.
Also: TP 2 (a refined split) with every rank summed, the plan's JSON, bad input, bench --csv and
its traffic numbers (spec/models.md's formula), presets.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

BIN = os.environ.get("FP8MOE_BIN", "build/fp8moe")
F32 = np.float32
BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
FAILURES = []

H, I, E, TOPK, BLOCK = 256, 384, 4, 2, 128


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)


def write_safetensors(path, tensors):
    """tensors: name -> (dtype string, numpy array of the raw element type)."""
    header, blobs, off = {}, [], 0
    for name, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    kinds = {"BF16": BF16, "F32": F32}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + b:8 + n + e], dtype=kinds[t["dtype"]]).reshape(
            t["shape"])
    return out


def block_quant(w):
    """per_block_cast_to_fp8 with 128x128 blocks: amax floored at 1e-4, s = amax / 448."""
    r, c = w.shape
    q = np.zeros((r, c), dtype=FP8)
    s = np.zeros(((r + BLOCK - 1) // BLOCK, (c + BLOCK - 1) // BLOCK), dtype=F32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            sc = F32(max(float(np.abs(blk).max()), 1e-4)) / F32(448.0)
            s[i, j] = sc
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = np.clip(
                blk * (F32(1.0) / sc), -448, 448).astype(FP8)
    return q, s


def write_checkpoint(d):
    rng = np.random.default_rng(7)
    tensors, experts = {}, []
    gate_w = (rng.standard_normal((E, H)) * 0.1).astype(BF16)
    tensors["model.layers.0.mlp.gate.weight"] = ("BF16", gate_w)
    for e in range(E):
        names = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        ex = {}
        for proj, shape in names.items():
            w = (rng.standard_normal(shape) / 15).astype(F32)
            q, s = block_quant(w)
            p = f"model.layers.0.mlp.experts.{e}.{proj}"
            tensors[p + ".weight"] = ("F8_E4M3", q.view(np.uint8))
            tensors[p + ".weight_scale_inv"] = ("F32", s)
            ex[proj] = (q, s)
        experts.append(ex)
    write_safetensors(os.path.join(d, "model.safetensors"), tensors)
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
        "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": TOPK,
        "num_hidden_layers": 1, "norm_topk_prob": True, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "quant_method": "fp8",
                                "weight_block_size": [BLOCK, BLOCK]},
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return experts


def dequant(q, s):
    r, c = q.shape
    ss = np.repeat(np.repeat(s, BLOCK, axis=0), BLOCK, axis=1)[:r, :c]
    return q.astype(F32).astype(np.float64) * ss.astype(np.float64)


def group_quant(x, g=128):
    """per_token_group_quant_fp8 in float32; returns the dequantised values."""
    r, c = x.shape
    xg = x.reshape(r, c // g, g).astype(F32)
    s = (np.maximum(np.abs(xg).max(axis=-1), F32(1e-10)) / F32(448.0)).astype(F32)
    q = np.clip(xg / s[..., None], F32(-448), F32(448)).astype(FP8).astype(F32)
    return (q.astype(np.float64) * s[..., None].astype(np.float64)).reshape(r, c)


def bf16(v):
    return np.asarray(v, dtype=F32).astype(BF16).astype(F32)


def numpy_layer(x, logits, experts):
    """The block-FP8 fused MoE as vLLM's Triton path computes it (spec/numerics.md §7)."""
    M = x.shape[0]
    lg = logits.astype(F32)
    p = np.exp(lg - lg.max(axis=1, keepdims=True))
    p = (p / p.sum(axis=1, keepdims=True)).astype(F32)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :TOPK]
    w = np.take_along_axis(p, ids, axis=1)
    w = (w / w.sum(axis=1, keepdims=True)).astype(F32)
    xq = group_quant(x.astype(F32))
    out = np.zeros((M, H), dtype=F32)
    deq = [{k: dequant(*v) for k, v in ex.items()} for ex in experts]
    for t in range(M):
        acc = np.zeros(H, dtype=F32)
        for j in range(TOPK):
            d = deq[ids[t, j]]
            gate = bf16(d["gate_proj"] @ xq[t])
            up = bf16(d["up_proj"] @ xq[t])
            silu = bf16(gate / (1.0 + np.exp(-gate.astype(np.float64))))
            h = bf16(silu * up)
            hq = group_quant(h[None, :])[0]
            y = bf16((d["down_proj"] @ hq) * np.float64(w[t, j]))
            acc += y
        out[t] = bf16(acc)
    return out


def run(args, expect=0):
    p = subprocess.run([BIN] + args, capture_output=True, text=True)
    check(p.returncode == expect,
          f"fp8moe {' '.join(args)} exited {p.returncode}, expected {expect}: {p.stderr[-800:]}")
    return p


def main():
    with tempfile.TemporaryDirectory() as d:
        experts = write_checkpoint(d)

        # The plan alone: on this machine the oracle's choice has an implementation or not; the
        # exit status and the JSON agree either way.
        p = subprocess.run([BIN, "run", d, "--plan-only", "--json"], capture_output=True, text=True)
        j = json.loads(p.stdout)
        check(j["plan"]["resolution"]["mode"] == "keep", "TP 1 keeps the 128x128 blocks")
        check(j["plan"]["weight_key"].startswith("QuantKey(f8e4m3fn"), "weight key printed")
        check((p.returncode == 0) == j["ok"], "plan-only exit status matches 'ok'")
        if not j["ok"]:
            check("NONE" in j["error"]["message"] or "no implementation" in j["error"]["message"],
                  "a plan that cannot run says why: " + j["error"]["message"])

        # One checked forward with the reference, output written for the numpy comparison.
        out_file = os.path.join(d, "out.safetensors")
        p = run(["run", d, "--kernel", "ref", "--check", "--tokens", "12", "--json", "--reps", "1",
                 "--output", out_file])
        j = json.loads(p.stdout)
        check(j["ok"], "run --check passes")
        rk = j["ranks"][0]
        check(rk["check"]["vs_reference"]["bitwise_equal"], "the reference kernel equals itself")
        check(rk["check"]["vs_unquantized"]["mean_rel_abs_err"] > 0,
              "FP8 differs from the unquantised layer")
        check(rk["time"]["median_s"] > 0, "a time is reported")
        check(rk["kernel"]["how"] == "", "the reference has no describe_call line")
        check(j["input"]["router_logits"].startswith("x @ model.layers.0.mlp.gate.weight"),
              "router logits come from the checkpoint's router")
        t = read_safetensors(out_file)
        mine = numpy_layer(t["x"].astype(F32), t["router_logits"], experts)
        got = t["out"].astype(F32)
        err = np.abs(got - mine)
        tol = 0.035 + 0.035 * np.abs(mine)
        check(bool((err <= tol).all()), f"numpy vs fp8moe: max err {err.max():.4g} over tolerance")
        rel = float(err.mean() / np.abs(mine).mean())
        check(rel < 0.01, f"numpy vs fp8moe mean relative error {rel:.4g} should be tiny")
        print(f"numpy reference vs fp8moe run: max |err| {err.max():.3g}, mean rel {rel:.3g}, "
              f"{int((t['out'].view(np.uint16) != mine.astype(BF16).view(np.uint16)).sum())} of "
              f"{got.size} bf16 values differ")

        # A CPU kernel says how it runs (instruction set, threads) in the text and the JSON.
        p = subprocess.run([BIN, "run", d, "--kernel", "cpu_w8a8", "--tokens", "4", "--json",
                            "--reps", "1"], capture_output=True, text=True)
        if p.returncode == 0:
            how = json.loads(p.stdout)["ranks"][0]["kernel"]["how"]
            check(" kernels, " in how and how.endswith(" OpenMP threads"), "cpu_w8a8 how: " + how)
            p = run(["run", d, "--kernel", "cpu_w8a8", "--tokens", "4", "--reps", "1"])
            check("        cpu_w8a8: " + how in p.stdout, "the text prints the how line")

        # --input: the same x and logits give the same out.
        in_file = os.path.join(d, "in.safetensors")
        write_safetensors(in_file, {"x": ("BF16", t["x"]), "router_logits": ("F32",
                                                                            t["router_logits"])})
        out2 = os.path.join(d, "out2.safetensors")
        run(["run", d, "--kernel", "ref", "--input", in_file, "--output", out2, "--reps", "1"])
        t2 = read_safetensors(out2)
        check(np.array_equal(t2["out"].view(np.uint16), t["out"].view(np.uint16)),
              "--input reproduces the output bit for bit")

        # Every CPU kernel of this build on the same input: run --check agrees with the reference.
        # cpu_w8a8 computes the checkpoint's W8A8 scheme bit for bit as the reference does;
        # cpu_w8a16 is vLLM's CPU backend: make_fp8_moe_quant_config builds fp8_w8a16 for it, so
        # the activations stay unquantised (its own reference run, within vLLM's tolerance).
        for kernel, act, qname in (("cpu_w8a8", "group128", "fp8_w8a8"),
                                   ("cpu_w8a16", "none", "fp8_w8a16")):
            p = run(["run", d, "--kernel", kernel, "--input", in_file, "--check", "--json",
                     "--reps", "1"])
            j = json.loads(p.stdout)
            check(j["ok"], f"run --kernel {kernel} --check passes")
            rk = j["ranks"][0]
            check(rk["check"]["vs_reference"]["allclose"], f"{kernel} agrees with the reference")
            if kernel == "cpu_w8a8":
                check(rk["check"]["vs_reference"]["bitwise_equal"],
                      "cpu_w8a8 equals the reference bit for bit")
            check(j["plan"]["scheme"].endswith("a:" + act) and j["plan"]["quant_config_name"] == qname,
                  f"{kernel} plans {qname} with activations {act}: {j['plan']['scheme']}")
            print(f"--kernel {kernel}: vs reference max |err| "
                  f"{rk['check']['vs_reference'].get('max_abs_err')}")

        # TP 2: 384 / 2 = 192 rows per rank refine 128x128 to 64x64; every rank summed vs TP 1.
        p = run(["run", d, "--kernel", "ref", "--tp", "2", "--rank", "all", "--check", "--json",
                 "--tokens", "9", "--reps", "1"])
        j = json.loads(p.stdout)
        check(j["plan"]["resolution"]["mode"] == "refine", "TP 2 of 384 refines")
        check(j["plan"]["resolution"]["block"] == [64, 64], "refined to 64x64")
        check(j["ranks_summed"]["pass"], "TP 2 ranks summed match TP 1 within tolerance")
        check(len(j["ranks"]) == 2, "two ranks ran")

        # Bad input.
        bad = os.path.join(d, "bad.safetensors")
        write_safetensors(bad, {"x": ("F32", np.zeros((3, H + 1), dtype=F32))})
        p = run(["run", d, "--kernel", "ref", "--input", bad], expect=2)
        check("'x'" in p.stderr and f"(tokens, {H})" in p.stderr, "bad --input is named")
        p = run(["run", d, "--kernel", "no_such"], expect=2)
        check("unknown --kernel 'no_such'" in p.stderr, "unknown kernel named")
        p = run(["run", d, "--layer", "3"], expect=2)
        check("layer 3" in p.stderr, "bad layer named")
        p = run(["run", d, "--tp", "2", "--rank", "5", "--kernel", "ref"], expect=2)
        check("rank 5" in p.stderr, "bad rank named")

        # bench --csv on the checkpoint: one row per token count, the traffic of models.md.
        p = run(["bench", d, "--backend", "ref", "--tokens", "1,4", "--csv", "--min-time", "0",
                 "--min-reps", "1", "--max-reps", "2", "--no-ceilings"])
        lines = p.stdout.strip().splitlines()
        head = lines[0].split(",")
        check(head[:4] == ["target", "backend", "M", "E"], "CSV header")
        rows = [dict(zip(head, line.split(","))) for line in lines[1:]]
        check(len(rows) == 2, f"two CSV rows, got {len(rows)}")
        for r in rows:
            M = int(r["M"])
            check(r["status"] == "ok", "bench row ran")
            distinct = E * (1 - (1 - TOPK / E) ** M)
            expect_bytes = distinct * 3 * I * H + 4 * M * H + 6 * M * TOPK * I
            check(abs(float(r["bytes"]) - expect_bytes) < 1e-6 * expect_bytes,
                  f"bytes {r['bytes']} vs models.md formula {expect_bytes}")
            check(abs(float(r["flops"]) - 6 * M * TOPK * I * H) < 1,
                  "FLOPs = 6 * M * topk * N * K")
            check(float(r["median_s"]) > 0 and r["implementation"] == "ref", "time and kernel")

        # Presets.
        p = run(["bench", "--list-presets", "--json"])
        names = [x["name"] for x in json.loads(p.stdout)]
        for n in ["deepseek-v3-tp8", "deepseek-v3-tp2", "deepseek-v3-ep8", "qwen3-30b-a3b-tp1",
                  "qwen3-235b-a22b-tp4", "qwen3-coder-480b-tp4", "qwen3-next-80b-tp2",
                  "minimax-m2-tp4", "mixtral-8x7b-tp2", "kimi-k2-tp8", "glm-4.5-tp8",
                  "llama4-maverick-tp8"]:
            check(n in names, f"preset {n}")
        p = run(["bench", "--preset", "qwen3-next-80b-tp2", "--backend", "ref", "--tokens", "2",
                 "--json", "--min-time", "0", "--min-reps", "1", "--max-reps", "1",
                 "--max-weight-mib", "16"])
        j = json.loads(p.stdout)
        r = j["rows"][0]
        check(r["status"] == "ok" and r["N"] == 256 and r["K"] == 2048, "preset row at its shape")
        check("E scaled 512 ->" in r["note"], "the scaled expert count is reported")
        check(j["ceilings"]["measured"] and j["ceilings"]["read_bytes_per_s"] > 0,
              "ceilings measured in the same run")
        p = run(["bench", "--preset", "nope"], expect=2)
        check("unknown preset 'nope'" in p.stderr, "unknown preset named")

    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        return 1
    print("test_run_cli: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
