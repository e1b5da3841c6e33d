"""`fp8moe plan` end to end on the real models' configs (examples/configs): the pinned answers,
--sweep-tp, --json, bare config.json files, exit statuses (0 works, 1 does not, 2 error) and error
objects. Run by ctest with FP8MOE_BIN and FP8MOE_SOURCE_DIR set; exits non-zero on failure."""

import json
import os
import subprocess
import sys
import tempfile

BIN = os.environ.get("FP8MOE_BIN", "build/fp8moe")
SRC = os.environ.get("FP8MOE_SOURCE_DIR", ".")
CONFIGS = os.path.join(SRC, "examples", "configs")
FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)


def plan(*args, expect=0, as_json=True):
    cmd = [BIN, "plan", *args] + (["--json"] if as_json else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    check(p.returncode == expect, f"{' '.join(cmd)}: exit {p.returncode}, expected {expect}\n{p.stderr}")
    return json.loads(p.stdout) if as_json else p.stdout


def model(name):
    return os.path.join(CONFIGS, name)


def main():
    # Pinned: Qwen3-30B-A3B-FP8 at TP4 refines to 64x64 with auto ...
    j = plan(model("Qwen3-30B-A3B-FP8"), "--tp", "4", "--platform", "cuda:90")
    s = j["shapes"][0]
    check(j["ok"], "qwen tp4 ok")
    check(s["block_resolution"]["mode"] == "refine" and s["block_resolution"]["block"] == [64, 64],
          f"qwen tp4 refine 64: {s['block_resolution']}")
    check(s["selection"]["backend"] == "TRITON", "qwen tp4 triton")
    # ... and pads with flashinfer_trtllm (on Blackwell, where TRT-LLM runs).
    j = plan(model("Qwen3-30B-A3B-FP8"), "--tp", "4", "--platform", "cuda:100", "--moe-backend",
             "flashinfer_trtllm")
    s = j["shapes"][0]
    check(s["block_resolution"]["mode"] == "pad" and s["shape"]["intermediate_per_partition"] == 256,
          f"qwen tp4 trtllm pad: {s['block_resolution']}")
    check(abs(s["flops_per_routed_token_per_layer"]["padding_overhead"] - 1 / 3) < 1e-9, "pad FLOPs")
    check([r["valid_intermediate"] for r in s["ranks"]] == [256, 256, 256, 0], "pad rank rows")
    # DeepSeek-V3 at TP8 keeps 128x128.
    j = plan(model("DeepSeek-V3"), "--tp", "8", "--platform", "cuda:90")
    s = j["shapes"][0]
    check(s["block_resolution"]["mode"] == "keep" and s["block_resolution"]["block"] == [128, 128],
          "deepseek tp8 keep")
    check(s["layers"] == list(range(3, 61)), "deepseek MoE layers 3..60")
    check(j["max_rank_expert_bytes"] == 58 * (256 * 3 * 256 * 7168 + 256 * 4 * (2 * 2 * 56 + 56 * 2)),
          f"deepseek bytes {j['max_rank_expert_bytes']}")
    # Expert parallel.
    j = plan(model("DeepSeek-V3"), "--ep", "8", "--platform", "cuda:90")
    check(j["shapes"][0]["selection"]["backend"] == "FLASHINFER_CUTLASS", "deepseek ep8 fi-cutlass")
    check(j["shapes"][0]["shape"]["num_local_experts"] == 32, "deepseek ep8 local experts")

    # A deployment that does not work: exit 1, the reason in the plan.
    j = plan(model("Qwen3-30B-A3B-FP8"), "--tp", "16", "--platform", "cuda:90", expect=1)
    check(not j["ok"] and j["shapes"][0]["failed_step"] == "validate", "tp16 fails at validate")
    check("--enable-expert-parallel" in j["shapes"][0]["error"]["message"], "tp16 suggests EP")
    j = plan(model("gpt-oss-120b"), "--tp", "2", "--platform", "cuda:90", expect=1)
    check(j["shapes"][0]["failed_step"] == "fp8", "gpt-oss not fp8")
    check(j["card"]["name"] == "H200" and j["shapes"][0]["roofline"] is None, "no FP8 roofline for MXFP4")

    # --sweep-tp
    j = plan(model("Qwen3-30B-A3B-FP8"), "--platform", "cuda:90", "--sweep-tp", "1,2,4,8,16")
    rows = {r["tp"]: r for r in j["sweep"]}
    check([rows[t]["ok"] for t in (1, 2, 4, 8, 16)] == [True, True, True, True, False], "sweep ok column")
    check(rows[8]["resolution"] == "refine" and rows[8]["block"] == [32, 32], "sweep tp8 refine 32")
    human = plan(model("Qwen3-30B-A3B-FP8"), "--platform", "cuda:90", "--sweep-tp", "1,4,16",
                 as_json=False)
    check("refine 64x64" in human and "TritonExperts" in human, f"human sweep:\n{human}")

    # A bare config.json works too; human output names the decision and the verdict.
    out = plan(os.path.join(model("DeepSeek-V3"), "config.json"), "--tp", "8", "--platform", "cuda:90",
               as_json=False)
    for fragment in ("blocks        keep", "TRITON / TritonExperts", "Verdict: runs on 8 GPU(s)",
                     "GiB of expert weights per GPU"):
        check(fragment in out, f"human plan lacks '{fragment}':\n{out}")

    # Errors: exit 2 with {"error", "message"}.
    with tempfile.TemporaryDirectory() as tmp:
        bad = os.path.join(tmp, "config.json")
        with open(bad, "w") as f:
            f.write('{"model_type": "qwen3_moe", "hidden_size": "big"}')
        j = plan(tmp, expect=2)
        check(j.get("error") == "FormatError" and "hidden_size" in j.get("message", ""), f"bad config: {j}")
        j = plan(model("DeepSeek-V3"), "--platform", "cuda:banana", expect=2)
        check(j.get("error") == "ValueError", f"bad platform: {j}")
        j = plan(model("DeepSeek-V3"), "--tp", "4", "--ep", "8", "--platform", "cuda:90", expect=1)
        check("does not match dp*pcp*tp" in j.get("error", ""), f"ep mismatch: {j}")

    roofline()

    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        sys.exit(1)
    print("ok")


# spec/models.md, "Roofline floors for one MoE layer on H200", DeepSeek-V3/R1 TP8 (us; the table
# counts no scales: fp8moe's include them, at most 0.03% more for 128x128 blocks).
DEEPSEEK_TP8_H200 = [9.2, 65.9, 187.6, 289.6, 298.0, 311.1, 364.6]


def near_table(us, table):
    return table - 0.05 <= us <= table * 1.0003 + 0.05


def roofline():
    ds = model("DeepSeek-V3")
    # Default card for cuda:90: H200; the default batch sizes; models.md's numbers.
    j = plan(ds, "--tp", "8", "--platform", "cuda:90")
    check(j["card"]["name"] == "H200" and not j["card"]["custom"], f"default card: {j['card']}")
    r = j["shapes"][0]["roofline"]
    check(r["lower_bound"] is True and r["layers"] == 58 and r["compute"] == "fp8", f"roofline head: {r}")
    pts = r["points"]
    check([p["tokens"] for p in pts] == [1, 8, 32, 128, 512, 2048, 8192], "default tokens")
    for p, t in zip(pts, DEEPSEEK_TP8_H200):
        check(near_table(p["floor_us"], t), f"deepseek tp8 M={p['tokens']}: {p['floor_us']} vs {t}")
        check(abs(p["layers_us"] - 58 * p["floor_us"]) < 1e-6 * p["layers_us"], "layers x floor")
        check(abs(p["tokens_per_s"] - p["tokens"] / (p["model_moe_step_us"] * 1e-6)) < 1e-6 * p["tokens_per_s"],
              "tokens/s = M / step")
        b = p["bytes"]
        check(abs(b["weights"] + b["scales"] + b["activations"] + b["intermediates"] - b["total"]) < 1e-3 * b["total"],
              "bytes add up")
    check([p["bound"] for p in pts] == ["memory"] * 6 + ["compute"], "deepseek tp8 bounds")

    # Human output: the block, labelled as a lower bound, with the pointer to measured kernels.
    out = plan(ds, "--tp", "8", "--platform", "cuda:90", as_json=False)
    for fragment in ("speed (roofline) LOWER BOUND per GPU on H200 (spec sheet: 4.8 TB/s HBM, 1979 TFLOP/s dense FP8)",
                     "no kernel is faster than this", "`fp8moe bench` / docs/PERFORMANCE.md",
                     "TP8: every GPU holds all 256 experts", "58 layers", "tok/s (<=)", "compute"):
        check(fragment in out, f"human roofline lacks '{fragment}':\n{out}")
    rows = [l.split() for l in out.splitlines() if l.strip().split(" ")[0] in ("1", "8192")]
    check(len(rows) == 2 and rows[0][5] == "memory" and rows[1][5] == "compute", f"rows: {rows}")

    # Other cards: --card, B200 default on cuda:100, a custom card equal to H200.
    j = plan(ds, "--tp", "8", "--platform", "cuda:90", "--card", "h100", "--tokens", "1")
    p = j["shapes"][0]["roofline"]["points"][0]
    check(j["card"]["name"] == "H100" and abs(p["floor_us"] - pts[0]["floor_us"] * 4.8 / 3.35) < 1e-6,
          f"h100 scales the memory floor by 4.8/3.35: {p['floor_us']}")
    j = plan(ds, "--tp", "8", "--platform", "cuda:100", "--tokens", "1")
    check(j["card"]["name"] == "B200", f"cuda:100 -> B200: {j['card']}")
    j = plan(ds, "--tp", "8", "--platform", "cuda:90", "--card-bw", "4.8", "--card-fp8", "1979")
    check(j["card"]["custom"] and [p["floor_us"] for p in j["shapes"][0]["roofline"]["points"]]
          == [p["floor_us"] for p in pts], "custom card with H200's peaks")
    j = plan(ds, "--tp", "8", "--platform", "cuda:90", "--tokens", "4,64")
    check([p["tokens"] for p in j["shapes"][0]["roofline"]["points"]] == [4, 64], "--tokens")

    # No card: the section says which flag gives one.
    j = plan(ds, "--tp", "8", "--platform", "rocm:gfx942")
    check(j["card"] is None and j["shapes"][0]["roofline"] is None and "--card" in j.get("card_note", ""),
          f"rocm: no default card: {j.get('card_note')}")
    out = plan(ds, "--tp", "8", "--platform", "rocm:gfx942", as_json=False)
    check("speed (roofline) no card: no default card for rocm:gfx942: give --card NAME" in out, f"rocm text:\n{out}")
    j = plan(ds, "--tp", "8", "--platform", "rocm:gfx942", "--card", "MI300X", "--tokens", "1")
    check(j["card"]["name"] == "MI300X" and j["shapes"][0]["roofline"] is not None, "--card MI300X")

    # EP: 32 experts per GPU; DP groups' tokens all-gathered.
    j = plan(ds, "--ep", "8", "--platform", "cuda:90", "--tokens", "1,128")
    r = j["shapes"][0]["roofline"]
    check(r["local_experts"] == 32 and r["rows_per_gpu"] == 2048 and "EP8" in r["layout"], f"ep8: {r['layout']}")
    check(abs(r["points"][0]["experts_touched"] - 1.0) < 1e-9, "ep8 M=1 touches one local expert")
    j = plan(ds, "--tp", "2", "--dp", "4", "--enable-ep", "--platform", "cuda:90", "--tokens", "1")
    r = j["shapes"][0]["roofline"]
    check(r["token_factor"] == 4 and r["points"][0]["moe_tokens"] == 4, f"dp4 tokens: {r['points'][0]}")
    check("allgather_reducescatter" in r["layout"], f"dp4 layout: {r['layout']}")

    # Padding costs bytes and FLOPs, and says so.
    args = [model("Qwen3-30B-A3B-FP8"), "--tp", "4", "--platform", "cuda:100", "--moe-backend",
            "flashinfer_trtllm", "--tokens", "1,8192"]
    j = plan(*args)
    for p in j["shapes"][0]["roofline"]["points"]:
        check(abs(p["padding_flops"] / p["flops"] - 0.25) < 1e-12, f"padding FLOPs share: {p}")
    out = plan(*args, as_json=False)
    check("padding     25.0% of the weight bytes and FLOPs go to padded rows" in out, f"padding text:\n{out}")

    # Bad flags: exit 2 with a ValueError naming the flag.
    for extra, fragment in (
        (["--card", "H300"], "unknown card 'H300': expected one of H100, H100-PCIe, H800, H200, H20, B200, MI300X"),
        (["--card-bw", "0", "--card-fp8", "1979"], "--card-bw expects a positive, finite number"),
        (["--card-bw", "nan", "--card-fp8", "1979"], "--card-bw"),
        (["--card-bw", "inf", "--card-fp8", "1979"], "--card-bw"),
        (["--card-bw", "4.8", "--card-fp8", "-1"], "--card-fp8 expects a positive"),
        (["--card-bw", "4.8x", "--card-fp8", "1979"], "--card-bw"),
        (["--card-bw", "4.8"], "needs both --card-bw TB/s and --card-fp8"),
        (["--card", "H200", "--card-bw", "4.8", "--card-fp8", "1979"], "exclude each other"),
        (["--tokens", "0"], "--tokens expects an integer >= 1"),
        (["--tokens", "1,,8"], "--tokens"),
        (["--tokens", "many"], "--tokens"),
        (["--sweep-tp", "4,8", "--card", "H200"], "--sweep-tp"),
    ):
        j = plan(ds, "--tp", "8", "--platform", "cuda:90", *extra, expect=2)
        check(j.get("error") == "ValueError" and fragment in j.get("message", ""), f"{extra}: {j}")


if __name__ == "__main__":
    main()
