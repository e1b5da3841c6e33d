#!/usr/bin/env python3
"""fp8moe oracle {select, resolve-block, quant-config, support} at the command-line level: the pinned
JSON shapes, exit codes, the error object, and the human-readable sections."""
import json
import os
import subprocess
import sys

BIN = os.environ.get("FP8MOE_BIN", "build/fp8moe")
FAILURES = []


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(extra)
    return env


def run(*args, env=None):
    p = subprocess.run([BIN, "oracle", *args], capture_output=True, text=True,
                       env=env or clean_env(), timeout=60)
    return p.returncode, p.stdout, p.stderr


def run_json(*args, env=None):
    rc, out, err = run(*args, "--json", env=env)
    try:
        return rc, json.loads(out)
    except json.JSONDecodeError:
        return rc, {"_unparsed": out, "_stderr": err}


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)


def test_select_json_shape():
    rc, j = run_json("select", "--platform", "cuda:90", "--installed", "all", "--num-experts",
                     "128", "--topk", "8", "--hidden", "2048", "--intermediate", "768", "--tp", "4")
    check(rc == 0, f"select rc {rc}")
    check(j.get("backend") == "TRITON", f"H200 TP4 block -> TRITON, got {j.get('backend')}")
    check(j.get("kernel") == "TritonExperts", "kernel TritonExperts")
    check(j.get("candidates", [None])[0] == "TRITON", "TRITON first (rule 2)")
    check("VLLM_CUTLASS" not in j.get("candidates", []), "VLLM_CUTLASS removed")
    for e in j.get("trace", []):
        check(set(e) >= {"backend", "kernel", "supported", "reason"}, f"trace entry keys {e}")
    check(j["trace"][-1]["supported"] is True, "trace ends with the chosen class")


def test_select_none_and_errors():
    rc, j = run_json("select", "--platform", "cpu", "--installed", "none")
    check(rc == 0 and j.get("backend") == "NONE" and j.get("kernel") is None,
          f"cpu with nothing installed -> NONE, got {rc} {j}")
    rc, j = run_json("select", "--platform", "cuda:70")
    check(rc == 2, f"NotImplementedError exits 2, got {rc}")
    check(j == {"error": "NotImplementedError",
                "message": "No FP8 MoE backend supports the deployment configuration."}, str(j))
    rc, j = run_json("select", "--platform", "cuda:90", "--moe-backend", "x")
    check(rc == 2 and j.get("error") == "ValueError", str(j))
    check(j.get("message") == (
        "moe_backend='x' is not supported for FP8 MoE. Expected one of ['triton', 'deep_gemm', "
        "'cutlass', 'flashinfer_trtllm', 'flashinfer_cutlass', 'marlin', 'humming', 'aiter', "
        "'hpc']."), str(j))
    rc, j = run_json("select", "--platform", "cuda:90", "--moe-backend", "cutlass")
    check(j.get("message") == "vLLM CUTLASS FP8 MoE backend is disabled for this configuration.",
          str(j))
    rc, j = run_json("select", "--platform", "cuda:90", "--moe-backend", "cutlass",
                     "--allow-vllm-cutlass", "--weight-key", "kFp8StaticTensorSym",
                     "--activation-key", "kFp8StaticTensorSym")
    check(j.get("backend") == "VLLM_CUTLASS", str(j))


def test_bad_input_is_one_line():
    cases = [
        (["--hidden", "0"], "--hidden expects a positive integer, got '0'"),
        (["--intermediate", "-3"], "--intermediate expects a positive integer, got '-3'"),
        (["--topk", "9", "--num-experts", "8"], "experts_per_token (topk) = 9 exceeds"),
        (["--weight-key", "kFoo"], "unknown quant key 'kFoo'"),
        (["--platform", "tpu"], "unknown platform 'tpu'"),
        (["--platform", "cuda:90", "--installed", "flashinfer"],
         "unknown installed feature 'flashinfer'"),
        (["--env", "VLLM_USE_DEEP_GEMM"], "malformed environment pair 'VLLM_USE_DEEP_GEMM'"),
        (["--env", "VLLM_NOPE=1"], "unknown environment variable 'VLLM_NOPE'"),
        (["--bogus"], "unexpected argument '--bogus'"),
    ]
    for args, needle in cases:
        rc, out, err = run("select", *args)
        lines = [l for l in err.splitlines() if l.strip()]
        check(rc == 2, f"{args}: rc {rc}")
        check(len(lines) == 1 and needle in lines[0] and lines[0].startswith("fp8moe: ValueError"),
              f"{args}: stderr {err!r}")
        rc, j = run_json("select", *args)
        check(rc == 2 and j.get("error") == "ValueError" and needle in j.get("message", ""),
              f"{args} --json: {j}")


def test_env():
    base = ("select", "--platform", "cuda:90")
    rc, j = run_json(*base, "--env", "VLLM_USE_DEEP_GEMM=1")
    check(j.get("backend") == "DEEPGEMM" and j.get("path") == "VLLM_USE_DEEP_GEMM", str(j))
    rc, j = run_json(*base, env=clean_env(VLLM_USE_DEEP_GEMM="1"))
    check(j.get("backend") == "DEEPGEMM", f"process environment is read: {j.get('backend')}")
    rc, j = run_json(*base, "--ignore-environment", env=clean_env(VLLM_USE_DEEP_GEMM="1"))
    check(j.get("backend") == "TRITON", f"--ignore-environment: {j.get('backend')}")
    rc, j = run_json(*base, "--env", "VLLM_USE_DEEP_GEMM=0", env=clean_env(VLLM_USE_DEEP_GEMM="1"))
    check("DEEPGEMM" not in j.get("candidates", ["DEEPGEMM"]), "--env overrides the environment")
    rc, j = run_json(*base, "--env", "VLLM_USE_DEEP_GEMM=abc")
    check(rc == 2 and j.get("message") == "invalid literal for int() with base 10: 'abc'", str(j))
    rc, j = run_json("select", "--platform", "cuda:90", "--env", "VLLM_ROCM_USE_AITER=1")
    check(rc == 2 and j.get("message", "").endswith(
        "since kernel does not support current device cuda. AITER MoE is not enabled \u2014 set "
        "VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_MOE=1 to enable it."), str(j))
    rc, j = run_json("select", "--platform", "rocm:gfx1201", "--env", "VLLM_ROCM_USE_AITER=1")
    check(j.get("backend") == "TRITON" and "AITER" not in j.get("candidates", []), str(j))


def test_parallel_flags():
    rc, j = run_json("select", "--platform", "cuda:90", "--tp", "8", "--enable-ep")
    check(j.get("backend") == "FLASHINFER_CUTLASS", f"--tp 8 --enable-ep is EP 8: {j.get('backend')}")
    rc, j = run_json("select", "--platform", "cuda:90", "--ep", "8")
    check(j.get("backend") == "FLASHINFER_CUTLASS", f"--ep 8: {j.get('backend')}")
    rc, j = run_json("select", "--platform", "cuda:90", "--dp", "2", "--enable-ep",
                     "--all2all-backend", "deepep_low_latency", "--moe-backend", "triton")
    check(j.get("backend") == "BATCHED_TRITON" and j.get("activation_format") == "batched_experts",
          str(j.get("backend")))
    rc, j = run_json("select", "--platform", "cuda:100", "--dp", "2", "--enable-ep",
                     "--all2all-backend", "deepep_v2")
    check(j.get("candidates", [None])[0] == "FLASHINFER_TRTLLM" and
          j.get("kernel") == "TrtLlmFp8ExpertsModular", str(j.get("candidates")))


def test_human_select():
    rc, out, err = run("select", "--platform", "cuda:100", "--installed", "none")
    check(rc == 0, f"rc {rc}")
    check(out.startswith("FP8 MoE backend: TRITON (experts class TritonExperts)"), out[:80])
    for section in ("Why:", "Candidates (priority order): ['AITER',", "Rejected:",
                    "kernel does not support current device cuda"):
        check(section in out, f"human output has {section!r}")
    rc, out, err = run("select", "--platform", "cuda:70")
    check(rc == 2 and "Tried:" in out and "NotImplementedError" in err, "failure explains the trace")


def test_resolve_block():
    base = ("resolve-block", "--hidden", "2048", "--intermediate", "768", "--tp", "4")
    rc, j = run_json(*base, "--platform", "cuda:90")
    check(j == {"block_shape": [64, 64], "refine": [2, 2], "intermediate_size_per_partition": 192,
                "tp_shard_with_padding": False}, f"Qwen3 TP4 auto: {j}")
    rc, j = run_json(*base, "--moe-backend", "flashinfer_trtllm", "--platform", "cuda:100")
    check(j == {"block_shape": [128, 128], "refine": None, "intermediate_size_per_partition": 256,
                "tp_shard_with_padding": True}, f"Qwen3 TP4 trtllm: {j}")
    rc, j = run_json(*base, "--moe-backend", "flashinfer_trtllm", "--not-serialized")
    check(j.get("block_shape") == [64, 64], f"--not-serialized never pads: {j}")
    rc, j = run_json("resolve-block", "--hidden", "7168", "--intermediate", "2048", "--tp", "8")
    check(j == {"block_shape": [128, 128], "refine": None, "intermediate_size_per_partition": 256,
                "tp_shard_with_padding": False}, f"DeepSeek-V3 TP8: {j}")
    rc, j = run_json("resolve-block", "--hidden", "2048", "--intermediate", "640", "--tp", "4")
    check(j.get("block_shape") == [32, 32] and j.get("refine") == [4, 4], f"I=640 TP4: {j}")
    rc, j = run_json("resolve-block", "--hidden", "2048", "--intermediate", "640", "--tp", "8",
                     "--moe-backend", "triton", "--lora", "--platform", "cuda:90")
    check(rc == 2 and j == {"error": "ValueError", "message": (
        "Block-aligned FP8 TP sharding requires 128-aligned global expert dimensions, pure TP, "
        "and no LoRA or expert bias.")}, f"pad error: {j}")
    rc, j = run_json("resolve-block", "--block", "0x128")
    check(rc == 2 and "--block expects" in j.get("message", ""), str(j))


def test_quant_config():
    rc, j = run_json("quant-config", "--backend", "FLASHINFER_CUTLASS")
    check(rc == 0 and j.get("w1", {}).get("alphas") is not None and
          j.get("a1", {}).get("gscale") is not None and j.get("layer_g1_alphas_shared") is True,
          f"per-tensor alphas: {j}")
    rc, j = run_json("quant-config", "--backend", "cpu", "--block", "128x128", "--swiglu-limit", "7")
    check(j.get("quant_dtype") is None and j.get("config_name") == "fp8_w8a16" and
          j.get("block_shape") is None and j.get("gemm1_clamp_limit") == 7.0, f"CPU W8A16: {j}")
    rc, j = run_json("quant-config", "--backend", "CPU_W8A8", "--block", "128x128", "--bias",
                     "--swiglu-limit", "7")
    check(j.get("w1", {}).get("bias") is None and j.get("gemm1_clamp_limit") is None and
          j.get("block_shape") == [128, 128], f"CPU_W8A8 carries no bias/SwiGLU: {j}")
    rc, j = run_json("quant-config", "--backend", "triton", "--block", "1x32")
    check(j.get("quant_dtype") == "mxfp8" and j.get("is_scale_swizzled") is False, f"MXFP8: {j}")
    rc, j = run_json("quant-config", "--backend", "nope")
    check(rc == 2 and "unknown FP8 MoE backend 'nope'" in j.get("message", ""), str(j))


def test_support():
    rc, j = run_json("support", "--platform", "cuda:90", "--tp", "4")
    check(rc == 0, f"rc {rc}")
    verdicts = j.get("verdicts", [])
    check(len(verdicts) == 20, f"20 classes over 15 backends, got {len(verdicts)}")
    ok = {(v["backend"], v["kernel"]) for v in verdicts if v["supported"]}
    check(("TRITON", "TritonExperts") in ok and ("MARLIN", "MarlinExperts") in ok, str(ok))
    check(j.get("priority", [None])[0] == "TRITON", "priority list")
    rc, out, err = run("support", "--platform", "cpu")
    check(rc == 0 and "CPUExpertsFp8W8A8" in out and "EXPERTS CLASS" in out, "support table")


def main():
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
