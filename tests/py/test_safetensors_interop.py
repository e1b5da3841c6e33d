"""fp8moe's safetensors code against the reference implementation (PyPI safetensors 0.5.3) and an
independent fp8 decoder (ml_dtypes):

  * files written by the reference writer are read by `fp8moe inspect` (names, dtypes, shapes,
    offsets and a hash of every tensor's bytes);
  * files written by fp8moe (`fp8moe make-example`) are read by the reference reader, and their
    block quantisation is checked with ml_dtypes;
  * `fp8moe shard` writes each rank's experts; dequantised with ml_dtypes and concatenated over the
    ranks they equal the dequantised unsharded checkpoint bit for bit (keep, refine, pad, EP), and
    padding holds exactly weight 0 and scale 1;
  * malformed files written from Python are refused with a clear error naming the file.

Run by ctest with FP8MOE_BIN and PYTHONPATH (.deps/python) set; exits non-zero on failure.
"""

import json
import os
import struct
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
from safetensors import deserialize
from safetensors.numpy import save

BIN = os.environ.get("FP8MOE_BIN", "build/fp8moe")
F8 = ml_dtypes.float8_e4m3fn
FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)


def run(*args, expect=0):
    p = subprocess.run([BIN, *args], capture_output=True, text=True)
    if p.returncode != expect:
        raise AssertionError(
            f"fp8moe {' '.join(args)} exited {p.returncode}, expected {expect}\n{p.stdout}\n{p.stderr}")
    return p


def run_json(*args, expect=0):
    return json.loads(run(*args, "--json", expect=expect).stdout)


def fnv1a64(b: bytes) -> str:
    h = 0xcbf29ce484222325
    for x in b:
        h = ((h ^ x) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def read_reference(path):
    """{name: (dtype, shape, bytes)} through the reference reader."""
    with open(path, "rb") as f:
        data = f.read()
    return {n: (v["dtype"], list(v["shape"]), bytes(v["data"])) for n, v in deserialize(data)}


def as_array(entry):
    dtype, shape, data = entry
    np_dtype = {"F8_E4M3": F8, "F32": np.float32, "U8": np.uint8, "F8_E8M0": np.uint8,
                "I32": np.int32, "BF16": ml_dtypes.bfloat16}[dtype]
    return np.frombuffer(data, dtype=np_dtype).reshape(shape)


# ---- reference writer -> fp8moe reader ----------------------------------------------------------------

def test_reference_files_read_by_fp8moe(tmp):
    rng = np.random.default_rng(7)
    tensors = {
        "model.layers.0.mlp.experts.0.gate_proj.weight": rng.standard_normal((128, 64)).astype(F8),
        "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv": rng.random((1, 1)).astype(np.float32),
        "mx.scale": rng.integers(100, 140, size=(4, 2), dtype=np.uint8),  # e8m0 bytes as U8
        "norm.weight": np.ones(64, dtype=ml_dtypes.bfloat16),
        "h": np.arange(6, dtype=np.float16).reshape(2, 3),
        "ids": np.arange(5, dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "scalar": np.array(3.5, dtype=np.float32),
    }
    path = os.path.join(tmp, "ref.safetensors")
    with open(path, "wb") as f:
        f.write(save(tensors, metadata={"format": "pt", "origin": "reference"}))
    ref = read_reference(path)
    j = run_json("inspect", path, "--hash")
    got = {t["name"]: t for t in j["tensors"]}
    check(set(got) == set(ref), f"tensor names {sorted(got)} vs {sorted(ref)}")
    for name, (dtype, shape, data) in ref.items():
        t = got[name]
        check(t["dtype"] == dtype, f"{name}: dtype {t['dtype']} vs {dtype}")
        check(t["shape"] == shape, f"{name}: shape {t['shape']} vs {shape}")
        check(t["data_offsets"][1] - t["data_offsets"][0] == len(data), f"{name}: size")
        check(t["fnv1a64"] == fnv1a64(data), f"{name}: bytes differ")
    check(j["shards"][0]["metadata"] == {"format": "pt", "origin": "reference"}, "metadata")


def test_e8m0_dtype_name_is_accepted(tmp):
    # safetensors 0.5.3 cannot write F8_E8M0 (newer versions do): write the header by hand.
    header = json.dumps({"s": {"dtype": "F8_E8M0", "shape": [2, 2], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    path = os.path.join(tmp, "e8m0.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes([127, 128, 126, 130]))
    j = run_json("inspect", path)
    check(j["tensors"][0]["dtype"] == "F8_E8M0", "F8_E8M0 dtype name")


# ---- fp8moe writer -> reference reader ----------------------------------------------------------------

def test_example_read_by_reference(example):
    with open(os.path.join(example, "model.safetensors.index.json")) as f:
        index = json.load(f)
    with open(os.path.join(example, "config.json")) as f:
        config = json.load(f)
    check(config["model_type"] == "qwen3_moe", "model_type")
    check(config["quantization_config"]["weight_block_size"] == [128, 128], "weight_block_size")
    shards = {}
    for shard in sorted(set(index["weight_map"].values())):
        shards[shard] = read_reference(os.path.join(example, shard))
    for name, shard in index["weight_map"].items():
        check(name in shards[shard], f"index maps {name} to {shard}, which lacks it")
    check(index["metadata"]["total_size"] == sum(len(d) for s in shards.values() for (_, _, d) in s.values()),
          "total_size")
    everything = {n: e for s in shards.values() for n, e in s.items()}
    H, I = config["hidden_size"], config["moe_intermediate_size"]
    for layer in range(config["num_hidden_layers"]):
        for e in range(config["num_experts"]):
            for proj, shape in (("gate_proj", [I, H]), ("up_proj", [I, H]), ("down_proj", [H, I])):
                w = everything[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]
                s = everything[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight_scale_inv"]
                check(w[0] == "F8_E4M3" and w[1] == shape, f"{proj} weight dtype/shape")
                check(s[0] == "F32" and s[1] == [-(-shape[0] // 128), -(-shape[1] // 128)], f"{proj} scale")
    # per_block_cast_to_fp8: every block's largest element quantises to exactly +-448 (amax / 448
    # scaling), decoded independently with ml_dtypes.
    q = as_array(everything["model.layers.1.mlp.experts.3.down_proj.weight"]).astype(np.float32)
    for bi in range(0, q.shape[0], 128):
        for bj in range(0, q.shape[1], 128):
            check(np.abs(q[bi:bi + 128, bj:bj + 128]).max() == 448.0, f"block ({bi},{bj}) max")


# ---- sharding: dequantised shards vs the dequantised checkpoint ----------------------------------------

def dequant(q, s, bn, bk):
    qf = q.astype(np.float32)
    up = np.repeat(np.repeat(s, bn, axis=0), bk, axis=1)[: q.shape[0], : q.shape[1]]
    return qf * up


def full_expert(everything, layer, e):
    out = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        q = as_array(everything[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"])
        s = as_array(everything[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight_scale_inv"])
        out[proj] = dequant(q, s, 128, 128)
    return out


def check_shards(example, tmp, layer, world, extra, label, expect_mode):
    everything = {}
    for f in os.listdir(example):
        if f.endswith(".safetensors"):
            everything.update(read_reference(os.path.join(example, f)))
    with open(os.path.join(example, "config.json")) as f:
        config = json.load(f)
    E, H, I = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    full = [full_expert(everything, layer, e) for e in range(E)]
    gate = [np.full((I, H), np.nan, np.float32) for _ in range(E)]
    upp = [np.full((I, H), np.nan, np.float32) for _ in range(E)]
    down = [np.full((H, I), np.nan, np.float32) for _ in range(E)]
    owners = np.zeros((E, I), dtype=np.int32)
    for r in range(world):
        out = os.path.join(tmp, f"{label}-{r}.safetensors")
        j = run_json("shard", example, "--layer", str(layer), "--rank", str(r), "-o", out, *extra)
        check(j["mode"] == expect_mode, f"{label}: mode {j['mode']}")
        t = read_reference(out)
        bn, bk = j["block"]
        W, valid = j["local_size"], j["valid_size"]
        g0 = j["tp"]["rank"] * W
        w13, w2 = as_array(t["w13_weight"]), as_array(t["w2_weight"])
        s13, s2 = as_array(t["w13_weight_scale_inv"]), as_array(t["w2_weight_scale_inv"])
        emap = as_array(t["expert_map"])
        local = list(as_array(t["local_experts"]))
        check(local == j["local_experts"], f"{label}: local experts")
        for g in range(E):
            check(emap[g] == (local.index(g) if g in local else -1), f"{label}: expert_map[{g}]")
        for le, ge in enumerate(local):
            d13 = dequant(w13[le], s13[le], bn, bk)
            d2 = dequant(w2[le], s2[le], bn, bk)
            gate[ge][g0:g0 + valid] = d13[:valid]
            upp[ge][g0:g0 + valid] = d13[W:W + valid]
            down[ge][:, g0:g0 + valid] = d2[:, :valid]
            owners[ge, g0:g0 + valid] += 1
            # Padding: weight exactly 0, scale exactly 1.
            if valid < W:
                pad_rows = np.concatenate([np.arange(valid, W), np.arange(W + valid, 2 * W)])
                check(np.all(w13[le][pad_rows].view(np.uint8) == 0), f"{label}: w13 padding weight")
                check(np.all(s13[le][[r_ // bn for r_ in pad_rows]] == 1.0), f"{label}: w13 padding scale")
                check(np.all(w2[le][:, valid:].view(np.uint8) == 0), f"{label}: w2 padding weight")
                check(np.all(s2[le][:, valid // bk:] == 1.0), f"{label}: w2 padding scale")
    check(np.all(owners == 1), f"{label}: every row owned by exactly one rank")
    for e in range(E):
        for name, got in (("gate_proj", gate[e]), ("up_proj", upp[e]), ("down_proj", down[e])):
            same = np.array_equal(got.view(np.uint32), full[e][name].view(np.uint32))
            check(same, f"{label}: expert {e} {name} differs from the unsharded checkpoint")


def test_sharding(example, tmp):
    check_shards(example, tmp, 1, 4, ["--tp", "4", "--platform", "cuda:90"], "tp4-refine", "refine")
    check_shards(example, tmp, 0, 2, ["--tp", "2", "--platform", "cuda:90"], "tp2-refine", "refine")
    check_shards(example, tmp, 0, 8, ["--tp", "8", "--platform", "cuda:100", "--moe-backend",
                                      "flashinfer_trtllm"], "tp8-pad", "pad")
    check_shards(example, tmp, 1, 4, ["--tp", "4", "--platform", "cuda:100", "--moe-backend",
                                      "flashinfer_trtllm"], "tp4-pad", "pad")
    check_shards(example, tmp, 1, 3, ["--ep", "3", "--platform", "cuda:90"], "ep3", "keep")
    check_shards(example, tmp, 0, 1, ["--platform", "cuda:90"], "tp1", "keep")


def test_plan_reads_headers_only(example):
    j = run_json("plan", example, "--tp", "4", "--platform", "cuda:90")
    check(j["ok"] is True, "plan ok")
    check(j["checkpoint"]["weight_bytes_read"] is False, "plan read weight bytes")
    check(j["shapes"][0]["block_resolution"]["mode"] == "refine", "plan refine")


# ---- malformed files written from Python --------------------------------------------------------------

def test_malformed_files(tmp):
    good = save({"a": np.arange(8, dtype=np.float32)})

    def raw(header, data=b""):
        h = json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + data

    cases = {
        "truncated": (good[:-4], "data region"),
        "short": (b"\x01\x02", "too small"),
        "huge_header": (struct.pack("<Q", 1 << 40) + b"{}", "exceeds the limit"),
        "bad_json": (struct.pack("<Q", 5) + b"{\"a\":", "not valid JSON"),
        "bad_dtype": (raw({"a": {"dtype": "F8_E4M3FN", "shape": [1], "data_offsets": [0, 1]}}, b"x"),
                      "unknown dtype"),
        "size_mismatch": (raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"xxxx"),
                          "needs 8 bytes"),
        "overlap": (raw({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                         "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"xxxxxx"), "overlap"),
        "hole": (raw({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"xx"), "no tensor"),
    }
    for name, (data, fragment) in cases.items():
        path = os.path.join(tmp, f"{name}.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        p = subprocess.run([BIN, "inspect", path, "--json"], capture_output=True, text=True)
        check(p.returncode == 2, f"{name}: exit {p.returncode}")
        try:
            err = json.loads(p.stdout)
        except json.JSONDecodeError:
            check(False, f"{name}: no JSON error: {p.stdout!r} {p.stderr!r}")
            continue
        check(err.get("error") == "FormatError", f"{name}: error kind {err}")
        check(path in err.get("message", ""), f"{name}: message does not name the file: {err}")
        check(fragment in err.get("message", ""), f"{name}: message lacks '{fragment}': {err}")
        # The reference implementation refuses them too.
        try:
            deserialize(data)
            check(False, f"{name}: the reference implementation accepted it")
        except Exception:
            pass


def main():
    with tempfile.TemporaryDirectory() as tmp:
        example = os.path.join(tmp, "example")
        run("make-example", example)
        for test in (lambda: test_reference_files_read_by_fp8moe(tmp),
                     lambda: test_e8m0_dtype_name_is_accepted(tmp),
                     lambda: test_example_read_by_reference(example),
                     lambda: test_plan_reads_headers_only(example),
                     lambda: test_sharding(example, tmp),
                     lambda: test_malformed_files(tmp)):
            try:
                test()
            except AssertionError as e:
                FAILURES.append(str(e))
                print("FAIL:", e)
    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
