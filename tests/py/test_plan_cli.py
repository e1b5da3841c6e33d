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

    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
