"""`fp8moe plan` on a full-size DeepSeek-V3 checkpoint layout (61 layers, 256 experts, 163 shards,
~89k expert tensors, ~640 GB of declared data) built from sparse files: real safetensors headers,
file sizes that match them, and no data on disk. The planner must check every expert tensor against
config.json, read no weight byte, and answer within seconds. Skipped when the file system does not
make sparse files. Run by ctest with FP8MOE_BIN and FP8MOE_SOURCE_DIR set."""

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

BIN = os.environ.get("FP8MOE_BIN", "build/fp8moe")
SRC = os.environ.get("FP8MOE_SOURCE_DIR", ".")


def write_sparse_shard(path, tensors):
    """tensors: list of (name, dtype, shape, nbytes). Writes the header, then extends the file to
    its full size without writing data."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(8 + len(h) + off)
    return off


def main():
    with open(os.path.join(SRC, "examples", "configs", "DeepSeek-V3", "config.json")) as f:
        cfg = json.load(f)
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    L, first = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    tmp = os.environ.get("FP8MOE_KEEP_SPARSE") or tempfile.mkdtemp(prefix="fp8moe_sparse_")
    os.makedirs(tmp, exist_ok=True)
    try:
        # Probe: does this file system keep a truncated file sparse?
        probe = os.path.join(tmp, "probe")
        with open(probe, "wb") as f:
            f.truncate(1 << 30)
        if os.stat(probe).st_blocks * 512 > (1 << 20):
            print("skip: the file system does not make sparse files")
            return
        os.remove(probe)
        shutil.copy(os.path.join(SRC, "examples", "configs", "DeepSeek-V3", "config.json"), tmp)
        blocks = lambda r, c: [-(-r // 128), -(-c // 128)]
        layers = []
        for layer in range(L):
            t = [(f"model.layers.{layer}.input_layernorm.weight", "BF16", [H], 2 * H)]
            if layer >= first:
                for e in range(E):
                    for proj, (r, c) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                        n = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                        t.append((n + ".weight", "F8_E4M3", [r, c], r * c))
                        s = blocks(r, c)
                        t.append((n + ".weight_scale_inv", "F32", s, 4 * s[0] * s[1]))
            layers.append(t)
        # 163 shards, as the real checkpoint has.
        flat = [x for t in layers for x in t]
        per = -(-len(flat) // 163)
        weight_map, total = {}, 0
        for i in range(163):
            chunk = flat[i * per:(i + 1) * per]
            if not chunk:
                break
            name = f"model-{i + 1:05d}-of-000163.safetensors"
            total += write_sparse_shard(os.path.join(tmp, name), chunk)
            for n, *_ in chunk:
                weight_map[n] = name
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)

        start = time.monotonic()
        p = subprocess.run([BIN, "plan", tmp, "--tp", "8", "--platform", "cuda:90", "--json"],
                           capture_output=True, text=True)
        elapsed = time.monotonic() - start
        if p.returncode != 0:
            print(p.stdout, p.stderr)
            sys.exit(1)
        j = json.loads(p.stdout)
        failures = []
        if j["checkpoint"]["weight_bytes_read"]:
            failures.append("weight bytes were read")
        if j["checkpoint"]["data_bytes"] != total:
            failures.append(f"data bytes {j['checkpoint']['data_bytes']} != {total}")
        expected = f"{(L - first) * E * 6} expert tensors of {L - first} layer(s) match config.json"
        if expected not in j["shapes"][0].get("checkpoint", ""):
            failures.append(f"header check: {j['shapes'][0].get('checkpoint')!r}")
        if j["shapes"][0]["block_resolution"]["mode"] != "keep":
            failures.append("DeepSeek-V3 at TP8 should keep 128x128")
        if elapsed > 20:
            failures.append(f"planning took {elapsed:.1f} s")
        print(f"planned {total / 2**30:.0f} GiB in {len(set(weight_map.values()))} shards, "
              f"{len(weight_map)} tensors, in {elapsed:.2f} s")
        if failures:
            print("FAIL:", "; ".join(failures))
            sys.exit(1)
        print("ok")
    finally:
        if not os.environ.get("FP8MOE_KEEP_SPARSE"):
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
