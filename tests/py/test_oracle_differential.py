#!/usr/bin/env python3
"""Differential test: `fp8moe oracle select|support|resolve-block --json` against the independent
Python model of vLLM's FP8 MoE oracle (tests/py/oracle_model.py).

(a) a table of pinned cases, each also checked against a hand-written expectation taken from the
    seed/spec (so the model itself is pinned, not only the agreement);
(b) a seeded random sweep over platforms x installed features x keys x sizes x parallel configs x
    activations x routing methods x logits dtypes x env vars x moe_backend x allow_vllm_cutlass.
Every case compares the full result: backend, kernel, candidates, trace (backend, kernel,
supported, reason), path and activation format, the keys' str(); or the error kind and message.

Environment: FP8MOE_BIN (the fp8moe binary), FP8MOE_DIFF_CASES (sweep size, default 3000),
FP8MOE_DIFF_SEED (default 20260901). Exit 1 on any disagreement or failed expectation.
"""
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle_model as M  # noqa: E402
from oracle_model import Case  # noqa: E402

BIN = os.environ.get("FP8MOE_BIN", "build/fp8moe")
FAILURES = []
SELECT_FIELDS = ("backend", "kernel", "candidates", "trace", "path", "activation_format",
                 "weight_key", "activation_key")
TRACE_FIELDS = ("backend", "kernel", "supported", "reason")


def _clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}


ENV = _clean_env()


def run_cli(sub, case):
    argv = [BIN, "oracle", sub, *case.cli_args(sub), "--json"]
    p = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=60)
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        return argv, {"_unparsed": p.stdout[-400:], "_stderr": p.stderr[-400:],
                      "_rc": p.returncode}
    if "error" in out:
        if p.returncode != 2:
            out["_rc"] = p.returncode
        return argv, {"error": out["error"], "message": out.get("message")}
    if p.returncode != 0:
        out["_rc"] = p.returncode
    if sub == "select":
        r = {k: out.get(k) for k in SELECT_FIELDS}
        r["trace"] = [{k: t.get(k) for k in TRACE_FIELDS} for t in out.get("trace", [])]
    elif sub == "support":
        r = {"priority": out.get("priority"), "activation_format": out.get("activation_format"),
             "verdicts": [{k: t.get(k) for k in TRACE_FIELDS} for t in out.get("verdicts", [])]}
    else:
        r = {k: out.get(k) for k in ("block_shape", "refine", "intermediate_size_per_partition",
                                     "tp_shard_with_padding")}
    if "_rc" in out:
        r["_rc"] = out["_rc"]
    return argv, r


MODEL = {"select": M.select, "support": M.support, "resolve-block": M.resolve_block}


def diff(cli, model):
    """A compact list of differences."""
    lines = []
    for k in sorted(set(cli) | set(model)):
        a, b = cli.get(k, "<absent>"), model.get(k, "<absent>")
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list) and k in ("trace", "verdicts"):
            for i in range(max(len(a), len(b))):
                x = a[i] if i < len(a) else "<absent>"
                y = b[i] if i < len(b) else "<absent>"
                if x != y:
                    lines.append(f"  {k}[{i}]:\n    cli:   {x}\n    model: {y}")
                    break
            if len(a) != len(b):
                lines.append(f"  len({k}): cli {len(a)} model {len(b)}")
        else:
            lines.append(f"  {k}:\n    cli:   {a}\n    model: {b}")
    return lines


DISAGREEMENTS = []


def compare(sub, case, label):
    argv, cli = run_cli(sub, case)
    model = MODEL[sub](case)
    if cli != model:
        DISAGREEMENTS.append((label, sub, argv, diff(cli, model)))
        return None
    return model


def expect(label, cond, what):
    if not cond:
        FAILURES.append(f"{label}: {what}")
        print(f"EXPECTATION FAILED {label}: {what}")


# ------------------------------------------------------------------------------------------------
# (a) pinned cases: (label, subcommand, case, expectation on the model's result or None)

def C(**kw):
    return Case(**kw)


H200 = dict(platform="cuda:90")
B200 = dict(platform="cuda:100")
TEN = dict(weight_key="kFp8StaticTensorSym", activation_key="kFp8StaticTensorSym")
TD = dict(weight_key="kFp8StaticTensorSym", activation_key="kFp8DynamicTensorSym")
CTOK = dict(weight_key="kFp8StaticChannelSym", activation_key="kFp8DynamicTokenSym")
MX = dict(weight_key="kMxfp8Static", activation_key="kMxfp8Dynamic")
EP8 = dict(tp=8, enable_ep=True)
LL = dict(tp=2, dp=2, enable_ep=True, all2all="deepep_low_latency")


def be(b, k=None):
    def f(r):
        return r.get("backend") == b and (k is None or r.get("kernel") == k)
    f.__doc__ = f"backend {b} {k or ''}"
    return f


def err(kind, msg=None):
    def f(r):
        return r.get("error") == kind and (msg is None or r.get("message") == msg)
    f.__doc__ = f"{kind}: {msg}"
    return f


def first(b):
    def f(r):
        return (r.get("candidates") or r.get("priority") or [None])[0] == b
    f.__doc__ = f"{b} first"
    return f


def blk(shape, refine, ispp, pad):
    def f(r):
        return r == {"block_shape": shape, "refine": refine,
                     "intermediate_size_per_partition": ispp, "tp_shard_with_padding": pad}
    f.__doc__ = f"block {shape} refine {refine} ispp {ispp} pad {pad}"
    return f


NO_BACKEND = "No FP8 MoE backend supports the deployment configuration."
CUTLASS_OFF = "vLLM CUTLASS FP8 MoE backend is disabled for this configuration."
PAD_ERR = ("Block-aligned FP8 TP sharding requires 128-aligned global expert dimensions, pure TP, "
           "and no LoRA or expert bias.")
AITER_ON = {"VLLM_ROCM_USE_AITER": "1"}


def pinned_cases():
    P = []
    add = P.append
    # reorder rules
    add(("rule2 H200 TP -> TRITON first", "select", C(**H200, tp=4), lambda r: be("TRITON")(r)
         and first("TRITON")(r)))
    add(("rule2 H200 EP -> FI_CUTLASS first", "select", C(**H200, **EP8), first("FLASHINFER_CUTLASS")))
    add(("rule2 H200 EP FI-CUTLASS chosen", "select", C(**H200, **EP8), be("FLASHINFER_CUTLASS")))
    add(("rule2 not for per-tensor", "select", C(**H200, **TEN), first("AITER")))
    add(("rule2 not for refined key", "select",
         C(**H200, weight_key="fp8:static:64x64", tp=4), lambda r: first("AITER")(r)
         and be("TRITON")(r)))
    add(("rule2 only exactly SM90", "support", C(platform="cuda:89"), first("AITER")))
    add(("rule1 B200 deepep_v2 -> TRTLLM first", "select",
         C(**B200, tp=2, dp=2, enable_ep=True, all2all="deepep_v2"), first("FLASHINFER_TRTLLM")))
    add(("rule1 B300 family", "select",
         C(platform="cuda:103", tp=2, dp=2, enable_ep=True, all2all="deepep_v2"),
         first("FLASHINFER_TRTLLM")))
    add(("rule1 needs all2all", "support", C(**B200, tp=4, all2all="deepep_v2"), first("AITER")))
    add(("rule1 not SM120", "support",
         C(platform="cuda:120", tp=2, dp=2, enable_ep=True, all2all="deepep_v2"), first("AITER")))
    add(("rule3 XPU first", "select", C(platform="xpu"), lambda r: first("XPU")(r)
         and be("XPU", "XPUExpertsBlockFp8")(r)))
    add(("rule4 CPU: CPU_W8A8 then CPU", "select", C(platform="cpu"),
         lambda r: r["candidates"][:2] == ["CPU_W8A8", "CPU"] and be("CPU_W8A8")(r)))
    add(("CPU arm -> NONE", "select", C(platform="cpu:arm"), be("NONE")))
    add(("CPU no amx_fp8 -> CPU", "select", C(platform="cpu", installed="amx_tile"), be("CPU")))
    add(("CPU bias -> CPU (fp8moe W8A8 rule)", "select", C(platform="cpu", bias=True), be("CPU")))
    add(("CPU swiglu -> CPU", "select", C(platform="cpu", swiglu_limit=7.0), be("CPU")))
    add(("CPU bias+swiglu W8A8 reason order", "select",
         C(platform="cpu", bias=True, swiglu_alpha=1.702), be("CPU")))
    add(("CPU DeepSeekV3 routing -> NONE", "select", C(platform="cpu", routing="DeepSeekV3"),
         be("NONE")))
    add(("CPU non-gated -> NotImplementedError", "select",
         C(platform="cpu", activation="silu_no_mul"), err(
             "NotImplementedError",
             "is_act_and_mul=False is supported only for CUDA, ROCm and XPU for now")))
    add(("CPU non-gated support -> NotImplementedError", "support",
         C(platform="cpu", activation="gelu_no_mul"), err("NotImplementedError")))
    add(("CPU non-gated resolve-block -> NotImplementedError", "resolve-block",
         C(platform="cpu", activation="relu2_no_mul", tp=4), err("NotImplementedError")))
    add(("XPU non-gated resolve-block ok", "resolve-block",
         C(platform="xpu", activation="relu2_no_mul", tp=4), blk([64, 64], [2, 2], 192, False)))
    add(("moe_backend normalised: Deep-GEMM", "select", C(**B200, moe_backend="Deep-GEMM"),
         be("DEEPGEMM")))
    add(("moe_backend normalised: FLASHINFER-TRTLLM resolve", "resolve-block",
         C(intermediate=768, tp=4, moe_backend="FLASHINFER-TRTLLM"),
         blk([128, 128], None, 256, True)))
    add(("platform cuda:9.0 spelling", "select", C(platform="cuda:9.0"), be("TRITON")))
    add(("platform cpu:x86 spelling", "select", C(platform="cpu:x86"), be("CPU_W8A8")))
    # B200 typical outcome
    add(("B200 block -> TRTLLM mono", "select", C(**B200),
         be("FLASHINFER_TRTLLM", "TrtLlmFp8ExpertsMonolithic")))
    add(("B200 Llama4 routing block -> modular", "select", C(**B200, routing="Llama4"),
         be("FLASHINFER_TRTLLM", "TrtLlmFp8ExpertsModular")))
    add(("B200 per-tensor Llama4 -> mono", "select", C(**B200, **TEN, routing="Llama4"),
         be("FLASHINFER_TRTLLM", "TrtLlmFp8ExpertsMonolithic")))
    add(("B200 fp16 logits -> modular", "select", C(**B200, logits_dtype="fp16"),
         be("FLASHINFER_TRTLLM", "TrtLlmFp8ExpertsModular")))
    add(("B200 no flashinfer -> DEEPGEMM", "select", C(**B200, installed="deep_gemm"),
         be("DEEPGEMM")))
    add(("B200 nothing -> TRITON", "select", C(**B200, installed="none"), be("TRITON")))
    add(("TRTLLM 2048 experts ok", "select", C(**B200, num_experts=2048), be("FLASHINFER_TRTLLM")))
    add(("TRTLLM 2049 experts limit", "select", C(**B200, num_experts=2049, topk=8),
         lambda r: r["trace"][1]["reason"] ==
         "FlashInfer TRTLLM routing supports at most 2048 experts, but got 2049"))
    add(("Triton 993 experts -> 1024 padded", "select",
         C(**H200, num_experts=993, installed="none", tp=4), lambda r: be("MARLIN")(r)))
    add(("Triton 992 experts ok", "select", C(**H200, num_experts=992, tp=4), be("TRITON")))
    add(("TritonOrDeepGemm ignores the 1024 rule", "select",
         C(**B200, num_experts=1024, installed="deep_gemm"), be("DEEPGEMM")))
    add(("H100 EP no FlashInfer -> DEEPGEMM", "select", C(**H200, **EP8, installed="deep_gemm"),
         be("DEEPGEMM")))
    # explicit backends, batched mapping, cutlass gate
    for mb in ("triton", "deep_gemm", "cutlass", "flashinfer_trtllm", "flashinfer_cutlass",
               "marlin", "humming", "aiter", "hpc"):
        add((f"explicit {mb} H200", "select", C(**H200, moe_backend=mb), None))
        add((f"explicit {mb} B200 batched", "select", C(**B200, **LL, moe_backend=mb), None))
        add((f"explicit {mb} H200 per-tensor cutlass allowed", "select",
             C(**H200, **TEN, moe_backend=mb, allow_vllm_cutlass=True), None))
    add(("cutlass disabled", "select", C(**H200, moe_backend="cutlass"),
         err("ValueError", CUTLASS_OFF)))
    add(("batched cutlass disabled", "select", C(**H200, **LL, moe_backend="cutlass", **TEN),
         err("ValueError", CUTLASS_OFF)))
    add(("batched triton mapping", "select", C(**H200, **LL, moe_backend="triton"),
         be("BATCHED_TRITON")))
    add(("batched deep_gemm mapping", "select", C(**H200, **LL, moe_backend="deep_gemm"),
         be("BATCHED_DEEPGEMM")))
    add(("batched cutlass mapping", "select",
         C(**H200, **LL, **TEN, moe_backend="cutlass", allow_vllm_cutlass=True),
         be("BATCHED_VLLM_CUTLASS")))
    add(("VLLM_CUTLASS per-tensor allowed auto", "select",
         C(platform="cuda:100", **TD, allow_vllm_cutlass=True, installed="cutlass_group_gemm"),
         be("VLLM_CUTLASS")))
    add(("explicit unknown backend", "select", C(**H200, moe_backend="batched_triton"),
         err("ValueError", "moe_backend='batched_triton' is not supported for FP8 MoE. Expected "
             "one of ['triton', 'deep_gemm', 'cutlass', 'flashinfer_trtllm', "
             "'flashinfer_cutlass', 'marlin', 'humming', 'aiter', 'hpc'].")))
    add(("explicit wins over env", "select",
         C(**H200, moe_backend="triton", env={"VLLM_USE_DEEP_GEMM": "1"}), be("TRITON")))
    add(("explicit flashinfer_cutlass per-tensor on SM100 refused", "select",
         C(**B200, moe_backend="flashinfer_cutlass"), err("ValueError")))
    # DeepGEMM env combinations
    vals = [None, "0", "1", "x"]
    for a in vals:
        for b in vals:
            env = {}
            if a is not None:
                env["VLLM_USE_DEEP_GEMM"] = a
            if b is not None:
                env["VLLM_MOE_USE_DEEP_GEMM"] = b
            for plat in ("cuda:90", "cuda:100"):
                add((f"deepgemm env {a}/{b} {plat}", "select",
                     C(platform=plat, env=env, tp=2), None))
            add((f"deepgemm env {a}/{b} batched", "select", C(**B200, **LL, env=env), None))
    add(("VLLM_USE_DEEP_GEMM=1 forces DEEPGEMM", "select",
         C(**B200, env={"VLLM_USE_DEEP_GEMM": "1"}), be("DEEPGEMM")))
    add(("VLLM_USE_DEEP_GEMM=1 per-tensor raises", "select",
         C(**B200, **TEN, env={"VLLM_USE_DEEP_GEMM": "1"}), err("ValueError")))
    add(("VLLM_USE_DEEP_GEMM=0 removes", "select",
         C(**B200, env={"VLLM_USE_DEEP_GEMM": "0"}),
         lambda r: "DEEPGEMM" not in r["candidates"]
         and "BATCHED_DEEPGEMM" not in r["candidates"]))
    add(("VLLM_USE_DEEP_GEMM=x raises", "select", C(**B200, env={"VLLM_USE_DEEP_GEMM": "x"}),
         err("ValueError", "invalid literal for int() with base 10: 'x'")))
    add(("VLLM_USE_DEEP_GEMM=0 short-circuits the MOE garbage", "select",
         C(**B200, env={"VLLM_USE_DEEP_GEMM": "0", "VLLM_MOE_USE_DEEP_GEMM": "x"}),
         be("FLASHINFER_TRTLLM")))
    # (Python's int() also takes non-ASCII digits such as '٣'; fp8moe rejects them: a documented
    # divergence, docs/ENV.md, so it is not compared here.)
    for v in ("", " 1 ", "+0", "1_0", "00", "-1", "true", "1.0", "1__0", "_1", "\t0\n"):
        add((f"VLLM_USE_DEEP_GEMM={v!r}", "select",
             C(**B200, env={"VLLM_USE_DEEP_GEMM": v}), None))
    add(("VLLM_USE_DEEP_GEMM garbage with explicit deep_gemm", "select",
         C(**B200, moe_backend="deep_gemm", env={"VLLM_USE_DEEP_GEMM": "x"}), err("ValueError")))
    add(("VLLM_USE_DEEP_GEMM garbage with explicit triton", "select",
         C(**B200, moe_backend="triton", env={"VLLM_USE_DEEP_GEMM": "x"}), be("TRITON")))
    add(("E8M0/GROUPED_TOPK garbage are not read", "select",
         C(**H200, env={"VLLM_USE_DEEP_GEMM_E8M0": "x", "VLLM_USE_FUSED_MOE_GROUPED_TOPK": "y"}),
         be("TRITON")))
    # AITER env combinations
    avals = [None, "1", "true", "TRUE", "0", "false", "yes", ""]
    for a in avals:
        for b in (None, "1", "0", "True"):
            env = {}
            if a is not None:
                env["VLLM_ROCM_USE_AITER"] = a
            if b is not None:
                env["VLLM_ROCM_USE_AITER_MOE"] = b
            for plat in ("rocm:gfx942", "rocm:gfx950", "rocm:gfx1201"):
                add((f"aiter env {a}/{b} {plat}", "select", C(platform=plat, env=env), None))
    add(("AITER on gfx942", "select", C(platform="rocm:gfx942", env=AITER_ON), be("AITER")))
    add(("AITER not installed on gfx942", "select",
         C(platform="rocm:gfx942", env=AITER_ON, installed="none"), err("ValueError")))
    add(("AITER on CUDA raises with suffix", "select", C(**H200, env=AITER_ON),
         err("ValueError", "FP8 MoE backend AITER does not support the deployment configuration "
             "since kernel does not support current device cuda. AITER MoE is not enabled — set "
             "VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_MOE=1 to enable it.")))
    add(("AITER rdna4 with aiter removed", "select", C(platform="rocm:gfx1201", env=AITER_ON),
         lambda r: "AITER" not in r.get("candidates", ["AITER"])))
    add(("AITER rdna4 without aiter forced", "select",
         C(platform="rocm:gfx1201", env=AITER_ON, installed="none"), err("ValueError")))
    add(("AITER gfx1200", "select", C(platform="rocm:gfx1200", env=AITER_ON), None))
    add(("ROCm default auto -> TRITON", "select", C(platform="rocm:gfx950"), be("TRITON")))
    add(("ROCm gfx942 keys are fnuz", "select", C(platform="rocm:gfx942"),
         lambda r: "f8e4m3fnuz" in r["weight_key"]))
    add(("ROCm nothing fits -> NotImplementedError", "select",
         C(platform="rocm:gfx942", weight_key="kMxfp8Static", activation_key="kMxfp8Dynamic"),
         err("NotImplementedError", NO_BACKEND)))
    add(("XPU nothing fits -> NONE", "select",
         C(platform="xpu", weight_key="kInt4Static", activation_key="none"), be("NONE")))
    add(("XPU batched", "select", C(platform="xpu", **LL), None))
    add(("XPU int8 triton", "select",
         C(platform="xpu", weight_key="kInt8StaticChannelSym",
           activation_key="kInt8DynamicTokenSym"), None))
    add(("cuda:70 -> NotImplementedError", "select", C(platform="cuda:70"),
         err("NotImplementedError", NO_BACKEND)))
    add(("cuda:80 block -> MARLIN", "select", C(platform="cuda:80"), be("MARLIN")))
    add(("cuda:110 -> no FI-CUTLASS", "select", C(platform="cuda:110", **TEN), None))
    add(("cuda:120 block", "select", C(platform="cuda:120"), None))
    add(("HPC per-tensor H200 hidden 100", "select",
         C(**H200, **TEN, hidden=100, installed="hpc"), None))
    add(("HPC hidden not /128 explicit", "select", C(**H200, hidden=2880, moe_backend="hpc"),
         err("ValueError", "FP8 MoE backend HPC does not support the deployment configuration "
             "since kernel does not support 2880 hidden dim is not supported.")))
    # LoRA, bias, activations, routing, logits
    add(("LoRA H200 -> TRITON", "select", C(**H200, lora=True), be("TRITON")))
    add(("LoRA B200 -> TRITON (TRTLLM no LoRA)", "select", C(**B200, lora=True), be("TRITON")))
    add(("LoRA 1024 experts -> MARLIN", "select", C(**B200, lora=True, num_experts=1024),
         be("MARLIN")))
    add(("LoRA explicit deep_gemm", "select", C(**B200, lora=True, moe_backend="deep_gemm"),
         err("ValueError", "FP8 MoE backend DEEPGEMM does not support the deployment "
             "configuration since kernel does not support LoRA.")))
    add(("bias B200", "select", C(**B200, bias=True), None))
    for act in ("silu", "gelu", "gelu_tanh", "relu2", "swigluoai", "situ",
                "swigluoai_uninterleave", "swiglustep", "silu_no_mul", "gelu_no_mul",
                "gelu_tanh_no_mul", "relu2_no_mul"):
        for plat in ("cuda:90", "cuda:100", "rocm:gfx950", "xpu"):
            add((f"activation {act} {plat}", "select",
                 C(platform=plat, activation=act, env=AITER_ON if plat.startswith("rocm") else {}),
                 None))
    add(("relu2 gated on H200 -> MARLIN? no: apply_moe_activation", "select",
         C(**H200, activation="relu2"), err("NotImplementedError", NO_BACKEND)))
    for rm in M.RoutingMethodType.__members__:
        add((f"routing {rm} B200", "select", C(**B200, routing=rm), None))
        add((f"routing {rm} B200 per-tensor", "select", C(**B200, **TEN, routing=rm), None))
    for dt in ("bf16", "fp16", "f32"):
        add((f"logits {dt}", "select", C(**B200, logits_dtype=dt), None))
        add((f"in dtype {dt}", "select", C(**B200, dtype=dt), None))
    add(("batch invariant", "select", C(**B200, env={"VLLM_BATCH_INVARIANT": "1"}), be("TRITON")))
    add(("batch invariant garbage", "select", C(**B200, env={"VLLM_BATCH_INVARIANT": "x"}),
         err("ValueError", "invalid literal for int() with base 10: 'x'")))
    for ht in ("indexed", "grouped", "grouped_contiguous", "GROUPED", "masked", ""):
        add((f"humming type {ht!r}", "select",
             C(**H200, moe_backend="humming", env={"VLLM_HUMMING_MOE_GEMM_TYPE": ht}), None))
    # EP / DP / all2all
    for a2a in ("allgather_reducescatter", "naive", "pplx", "deepep_high_throughput",
                "deepep_low_latency", "deepep_v2", "flashinfer_all2allv",
                "flashinfer_nvlink_one_sided", "flashinfer_nvlink_two_sided",
                "mori_high_throughput", "mori_low_latency", "nixl_ep"):
        for plat in ("cuda:90", "cuda:100"):
            add((f"all2all {a2a} {plat}", "select",
                 C(platform=plat, tp=2, dp=2, enable_ep=True, all2all=a2a), None))
        add((f"all2all {a2a} per-tensor cutlass", "select",
             C(**H200, **TEN, tp=2, dp=2, enable_ep=True, all2all=a2a,
               allow_vllm_cutlass=True), None))
    add(("deepep_ll -> batched format", "select", C(**H200, **LL),
         lambda r: r["activation_format"] == "batched_experts"))
    add(("nixl_ep -> batched", "select",
         C(**H200, tp=2, dp=2, enable_ep=True, all2all="nixl_ep"),
         lambda r: r["activation_format"] == "batched_experts"))
    add(("deepep_ll without EP -> standard", "select",
         C(**H200, tp=2, dp=2, all2all="deepep_low_latency"),
         lambda r: r["activation_format"] == "standard"))
    add(("EP without dp -> no all2all", "select", C(**H200, **EP8, all2all="deepep_low_latency"),
         lambda r: r["activation_format"] == "standard"))
    add(("sp>1 all2all", "select",
         C(**B200, tp=2, sp=2, enable_ep=True, all2all="deepep_low_latency"), None))
    add(("eplb B200", "select", C(**B200, eplb=True), None))
    add(("pcp", "select", C(**B200, tp=2, pcp=2, enable_ep=True, all2all="deepep_v2"), None))
    # keys
    for wk, ak in (("none", "none"), ("kFp8StaticTensorSym", "none"), ("kMxfp8Static", "none"),
                   ("kMxfp4Static", "none"), ("kMxfp4Static", "kMxfp8Dynamic"),
                   ("kNvfp4Static", "kNvfp4Dynamic"), ("kInt4Static", "none"),
                   ("kInt4Static32Asym", "kFp8DynamicTokenSym"),
                   ("fp8:static:128x128", "fp8:dynamic:1x128"), ("fp8:static:32x32",
                                                               "kFp8Dynamic128Sym"),
                   ("fp8:static:1x128", "kFp8Dynamic128Sym"),
                   ("fp8:dynamic:64x64", "kFp8Dynamic128Sym"),
                   ("fp8:static:channel", "fp8:dynamic:token"),
                   ("kFp8StaticTensorSym", "kFp8DynamicTokenSym"), ("kFp8Static128BlockSym",
                                                                    "kFp8DynamicTokenSym")):
        for plat in ("cuda:90", "cuda:100", "rocm:gfx950", "rocm:gfx942", "xpu", "cpu"):
            add((f"keys {wk} x {ak} {plat}", "select",
                 C(platform=plat, weight_key=wk, activation_key=ak), None))
    add(("MX B200 -> TRTLLM", "select", C(**B200, **MX), be("FLASHINFER_TRTLLM")))
    add(("CTok H200 auto -> TRITON", "select", C(**H200, **CTOK), be("TRITON")))
    # support
    for plat in ("cuda:90", "cuda:100", "cuda:120", "rocm:gfx942", "rocm:gfx1201", "xpu", "cpu",
                 "cpu:arm"):
        add((f"support {plat}", "support", C(platform=plat), None))
        add((f"support {plat} LL", "support", C(platform=plat, **LL), None))
    # refine / pad / resolve
    add(("Qwen3-30B-A3B I=768 TP4 auto -> [64,64]", "resolve-block",
         C(hidden=2048, intermediate=768, tp=4), blk([64, 64], [2, 2], 192, False)))
    add(("Qwen3-30B-A3B TP4 triton -> refine", "resolve-block",
         C(hidden=2048, intermediate=768, tp=4, moe_backend="triton"),
         blk([64, 64], [2, 2], 192, False)))
    add(("Qwen3-30B-A3B TP4 flashinfer_trtllm -> pad to 256", "resolve-block",
         C(hidden=2048, intermediate=768, tp=4, moe_backend="flashinfer_trtllm"),
         blk([128, 128], None, 256, True)))
    for mb in ("deep_gemm", "cutlass", "flashinfer_cutlass", "marlin", "humming", "aiter", "hpc"):
        add((f"Qwen3 TP4 {mb} -> pad", "resolve-block",
             C(hidden=2048, intermediate=768, tp=4, moe_backend=mb),
             blk([128, 128], None, 256, True)))
    add(("Qwen3 TP4 triton not serialized -> refine", "resolve-block",
         C(hidden=2048, intermediate=768, tp=4, moe_backend="marlin", not_serialized=True),
         blk([64, 64], [2, 2], 192, False)))
    add(("Qwen3 TP4 triton on CPU (no fp8) -> pad", "resolve-block",
         C(platform="cpu", hidden=2048, intermediate=768, tp=4, moe_backend="triton"),
         blk([128, 128], None, 256, True)))
    add(("Qwen3 TP4 triton on cuda:80 -> pad", "resolve-block",
         C(platform="cuda:80", hidden=2048, intermediate=768, tp=4, moe_backend="triton"),
         blk([128, 128], None, 256, True)))
    add(("Qwen3 TP4 triton, act key token -> pad", "resolve-block",
         C(hidden=2048, intermediate=768, tp=4, moe_backend="triton",
           activation_key="kFp8DynamicTokenSym"), blk([128, 128], None, 256, True)))
    add(("DeepSeek-V3 TP8 -> keep", "resolve-block",
         C(hidden=7168, intermediate=2048, tp=8, num_experts=256),
         blk([128, 128], None, 256, False)))
    add(("DeepSeek-V3 TP8 trtllm -> keep", "resolve-block",
         C(hidden=7168, intermediate=2048, tp=8, moe_backend="flashinfer_trtllm"),
         blk([128, 128], None, 256, False)))
    add(("I=640 TP4 -> [32,32]", "resolve-block", C(hidden=2048, intermediate=640, tp=4),
         blk([32, 32], [4, 4], 160, False)))
    add(("I=640 TP8 auto -> keep", "resolve-block", C(hidden=2048, intermediate=640, tp=8),
         blk([128, 128], None, 80, False)))
    add(("I=640 TP8 trtllm -> pad 128", "resolve-block",
         C(hidden=2048, intermediate=640, tp=8, moe_backend="flashinfer_trtllm"),
         blk([128, 128], None, 128, True)))
    add(("I=640 TP8 triton -> pad 128", "resolve-block",
         C(hidden=2048, intermediate=640, tp=8, moe_backend="triton"),
         blk([128, 128], None, 128, True)))
    add(("I=640 TP8 lora -> error", "resolve-block",
         C(hidden=2048, intermediate=640, tp=8, moe_backend="triton", lora=True),
         err("ValueError", PAD_ERR)))
    add(("I=640 TP8 bias -> error", "resolve-block",
         C(hidden=2048, intermediate=640, tp=8, moe_backend="marlin", bias=True),
         err("ValueError", PAD_ERR)))
    add(("I=640 TP4 hidden 2880 trtllm -> error", "resolve-block",
         C(hidden=2880, intermediate=640, tp=4, moe_backend="flashinfer_trtllm"),
         err("ValueError", PAD_ERR)))
    add(("I=768 EP8 -> keep", "resolve-block",
         C(hidden=2048, intermediate=768, tp=8, enable_ep=True, moe_backend="marlin"),
         blk([128, 128], None, 768, False)))
    add(("I=768 TP4 DP2 EP -> keep", "resolve-block",
         C(hidden=2048, intermediate=768, tp=4, dp=2, enable_ep=True, moe_backend="marlin"),
         blk([128, 128], None, 768, False)))
    add(("I=768 TP2 DP2 no EP -> flattened tp 4", "resolve-block",
         C(hidden=2048, intermediate=768, tp=2, dp=2), blk([64, 64], [2, 2], 192, False)))
    add(("non-square 128x64", "resolve-block",
         C(hidden=2048, intermediate=768, tp=4, block="128x64", moe_backend="marlin"), None))
    add(("block 64x64 TP4 I=768", "resolve-block",
         C(hidden=2048, intermediate=768, tp=4, block="64x64"), None))
    add(("bad backend in resolve", "resolve-block",
         C(intermediate=768, tp=4, moe_backend="emulation"), err("ValueError")))
    add(("bad backend in resolve, not serialized", "resolve-block",
         C(intermediate=768, tp=4, moe_backend="emulation", not_serialized=True), None))
    add(("hidden 96 refine gcd 32", "resolve-block", C(hidden=96, intermediate=384, tp=4),
         blk([32, 32], [4, 4], 96, False)))
    add(("hidden 48 no refine", "resolve-block", C(hidden=48, intermediate=384, tp=4),
         blk([128, 128], None, 96, False)))
    return P


# ------------------------------------------------------------------------------------------------
# (b) the random sweep

PLATFORMS = ["cpu", "cpu", "cpu:arm", "cuda:70", "cuda:75", "cuda:80", "cuda:89", "cuda:90",
             "cuda:90", "cuda:90", "cuda:100", "cuda:100", "cuda:103", "cuda:110", "cuda:120",
             "cuda:121", "rocm:gfx942", "rocm:gfx950", "rocm:gfx950", "rocm:gfx1200",
             "rocm:gfx1201", "xpu", "xpu"]
ALL_KEYS = list(M.make_named_keys("f8e4m3fn").keys())
GENERIC = ["fp8:static:64x64", "fp8:static:32x32", "fp8:static:128x128", "fp8:static:1x128",
           "fp8:static:128x64", "fp8:dynamic:1x128", "fp8:static:tensor", "fp8:dynamic:tensor",
           "fp8:dynamic:token", "fp8:static:channel", "fp8:static:256x256", "fp8:dynamic:64x64"]
PAIRS = [("kFp8Static128BlockSym", "kFp8Dynamic128Sym")] * 8 + [
    ("kFp8StaticTensorSym", "kFp8StaticTensorSym"), ("kFp8StaticTensorSym", "kFp8StaticTensorSym"),
    ("kFp8StaticTensorSym", "kFp8DynamicTensorSym"), ("kFp8StaticTensorSym", "kFp8DynamicTokenSym"),
    ("kFp8StaticChannelSym", "kFp8DynamicTokenSym"), ("kMxfp8Static", "kMxfp8Dynamic"),
    ("fp8:static:64x64", "kFp8Dynamic128Sym"), ("fp8:static:32x32", "kFp8Dynamic128Sym"),
    ("none", "none"), ("kFp8StaticTensorSym", "none"), ("kMxfp8Static", "none"),
    ("kFp8StaticChannelSym", "kFp8Dynamic128Sym"), ("kMxfp4Static", "none"),
    ("kMxfp4Static", "kMxfp8Dynamic"), ("kNvfp4Static", "kNvfp4Dynamic"),
    ("kInt8StaticChannelSym", "kInt8DynamicTokenSym"),
    ("kInt8StaticTensorSym", "kInt8DynamicTensorSym"), ("kInt4Static", "none"),
    ("kInt4Static32", "kFp8DynamicTokenSym"), ("kFp8Static128BlockSym", "none"),
    ("kFp8Static128BlockSym", "kFp8DynamicTokenSym"), ("kMxfp4Static", "kMxfp4Dynamic"),
]
ACTS = ["silu"] * 8 + ["gelu", "gelu_tanh", "relu2", "swigluoai", "situ", "swigluoai_uninterleave",
                       "swiglustep", "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul",
                       "relu2_no_mul", "gelu_pytorch_tanh"]
ROUTING = (["Renormalize"] * 4 + ["DeepSeekV3"] * 2 + list(M.RoutingMethodType.__members__))
A2A = ["allgather_reducescatter", "naive", "pplx", "deepep_high_throughput", "deepep_low_latency",
       "deepep_low_latency", "deepep_v2", "deepep_v2", "flashinfer_all2allv",
       "flashinfer_nvlink_one_sided", "flashinfer_nvlink_two_sided", "mori_high_throughput",
       "mori_low_latency", "nixl_ep"]
BACKENDS = ["triton", "deep_gemm", "cutlass", "flashinfer_trtllm", "flashinfer_cutlass", "marlin",
            "humming", "aiter", "hpc", "batched_triton", "emulation"]
DG_VALS = ["0", "1", "1", "0", "2", "-1", " 1", "+0", "1_0", "", "x", "true", "00"]
AITER_VALS = ["1", "1", "1", "true", "TRUE", "True", "0", "false", "yes", "", " 1"]
# name -> (probability on a matching platform, elsewhere, values)
ENV_CHOICES = {
    "VLLM_USE_DEEP_GEMM": (0.2, 0.1, DG_VALS),
    "VLLM_MOE_USE_DEEP_GEMM": (0.12, 0.06, DG_VALS),
    "VLLM_ROCM_USE_AITER": (0.5, 0.05, AITER_VALS),
    "VLLM_ROCM_USE_AITER_MOE": (0.25, 0.05, AITER_VALS),
    "VLLM_BATCH_INVARIANT": (0.08, 0.08, ["0", "1", "1", "x"]),
    "VLLM_HUMMING_MOE_GEMM_TYPE": (0.15, 0.15, ["indexed", "grouped", "grouped_contiguous",
                                                "GROUPED", "foo"]),
    "VLLM_USE_DEEP_GEMM_E8M0": (0.05, 0.05, ["0", "1", "x"]),
    "VLLM_USE_FUSED_MOE_GROUPED_TOPK": (0.05, 0.05, ["0", "1", "x"]),
}
PLAUSIBLE_BACKENDS = {"cuda": ["triton", "deep_gemm", "cutlass", "flashinfer_trtllm",
                               "flashinfer_cutlass", "marlin", "humming", "hpc"],
                      "rocm": ["aiter", "triton"], "xpu": ["triton"], "cpu": ["triton", "marlin"]}


def random_case(rng, sub):
    c = Case()
    c.platform = rng.choice(PLATFORMS)
    kind = c.platform.split(":")[0]
    r = rng.random()
    if r < 0.6:
        c.installed = "all"
    elif r < 0.68:
        c.installed = "none"
    else:
        feats = [f for f in M.FEATURES if rng.random() < 0.5]
        c.installed = ",".join(feats) if feats else "none"
    r = rng.random()
    if r < 0.85:
        c.weight_key, c.activation_key = rng.choice(PAIRS)
    else:
        pool = ALL_KEYS + GENERIC + ["none"]
        c.weight_key, c.activation_key = rng.choice(pool), rng.choice(pool)
    c.num_experts = rng.choice([8, 16, 64, 128, 128, 256, 256, 512, 960, 992, 993, 1000, 1024,
                                2048, 2049, 4096])
    c.topk = rng.choice([k for k in (1, 2, 4, 6, 8) if k <= c.num_experts])
    c.hidden = rng.choice([2048, 2048, 7168, 4096, 2880, 1536, 640, 576, 100, 96, 48])
    c.intermediate = rng.choice([768, 768, 640, 1536, 2048, 18432, 2880, 96, 256, 384, 1408, 1024,
                                 160, 2112])
    c.tp = rng.choice([1, 1, 2, 4, 4, 8, 8])
    c.dp = rng.choice([1, 1, 1, 1, 2, 4])
    c.pcp = rng.choice([1, 1, 1, 1, 2])
    c.sp = rng.choice([1, 1, 1, 1, 2]) if sub != "resolve-block" else 1
    c.enable_ep = rng.random() < 0.35
    tp_flat = c.tp * c.dp * c.pcp
    if c.intermediate % tp_flat != 0 and not (c.enable_ep and tp_flat > 1):
        c.tp, c.dp, c.pcp = 1, 1, 1
    c.all2all = rng.choice(A2A)
    c.eplb = rng.random() < 0.1
    c.activation = "silu" if rng.random() < 0.5 else rng.choice(ACTS)
    c.routing = rng.choice(ROUTING)
    c.logits_dtype = rng.choice([None, None, None, "bf16", "fp16", "f32"])
    c.dtype = rng.choice(["bf16", "bf16", "bf16", "fp16", "f32"])
    c.lora = rng.random() < 0.12
    c.bias = rng.random() < 0.12
    c.swiglu_limit = 7.0 if rng.random() < 0.08 else None
    c.swiglu_alpha = 1.702 if rng.random() < 0.05 else None
    c.swiglu_beta = 1.0 if rng.random() < 0.05 else None
    c.env = {}
    for name, (p_match, p_other, vals) in ENV_CHOICES.items():
        match = (kind == "rocm") if "AITER" in name else (kind == "cuda")
        if rng.random() < (p_match if match else p_other):
            c.env[name] = rng.choice(vals)
    r = rng.random()
    c.moe_backend = ("auto" if r < 0.7 else rng.choice(PLAUSIBLE_BACKENDS[kind]) if r < 0.85
                     else rng.choice(BACKENDS[:9]) if r < 0.97 else rng.choice(BACKENDS[9:]))
    c.allow_vllm_cutlass = rng.random() < 0.3
    if sub == "resolve-block":
        c.block = rng.choice(["128x128"] * 6 + ["64x64", "128x64", "256x256", "32x32", "96x96",
                                               "64x128"])
        c.activation_key = rng.choice(["kFp8Dynamic128Sym"] * 6 + ["kFp8DynamicTokenSym",
                                                                    "fp8:dynamic:1x64", "none"])
        c.not_serialized = rng.random() < 0.15
        c.env = {}
    return c


# ------------------------------------------------------------------------------------------------
# (c) malformed input: one line on stderr naming the value and what was expected, exit code 2,
# nothing on stdout for argument errors, no crash.

BAD_INPUTS = [
    (["select", "--platform", "cuda:90", "--hidden", "abc"], "'abc'"),
    (["select", "--platform", "cuda:90", "--hidden", "99999999999999999999"], "no larger than"),
    (["select", "--platform", "cuda:90", "--tp", "0"], "--tp expects a positive integer"),
    (["select", "--platform", "cuda:90", "--weight-key", ""], "empty quant key"),
    (["select", "--platform", "cuda:90", "--weight-key", "fp8:static:0x128"],
     "'fp8:static:0x128'"),
    (["select", "--platform", "cuda:90", "--activation", "swish"], "'swish'"),
    (["select", "--platform", "cuda:90", "--routing-method", "42"], "'42'"),
    (["select", "--platform", "cuda:90", "--env", "VLLM_USE_DEEP_GEMM"], "NAME=VALUE"),
    (["select", "--platform", "cuda:90", "--env", "VLLM_FOO=1"], "'VLLM_FOO'"),
    (["select", "--platform", "rocm:gfx90a"], "'rocm:gfx90a'"),
    (["select", "--platform", "cuda:90", "--installed", "deep_gem"], "'deep_gem'"),
    (["select", "--platform", "cuda:90", "--all2all-backend", "deepep"], "'deepep'"),
    (["select", "--platform", "cuda:90", "--ep", "4", "--tp", "2"], "--ep 4"),
    (["select", "--platform", "cuda:90", "--intermediate", "770", "--tp", "4"], "770"),
    (["select", "--platform", "cuda:90", "--swiglu-limit", "nan"], "'nan'"),
    (["support", "--platform", "xpu", "--num-experts", "4", "--topk", "8"], "= 8"),
    (["resolve-block", "--block", "128"], "'128'"),
    (["resolve-block", "--block", "0x128"], "'0x128'"),
]


def check_bad_inputs():
    for argv, needle in BAD_INPUTS:
        for js in ([], ["--json"]):
            p = subprocess.run([BIN, "oracle", *argv, *js], capture_output=True, text=True,
                               env=ENV, timeout=60)
            label = f"bad input {' '.join(argv + js)!r}"
            expect(label, p.returncode == 2, f"exit code {p.returncode}, expected 2")
            if js:
                try:
                    j = json.loads(p.stdout)
                except json.JSONDecodeError:
                    j = {}
                expect(label, j.get("error") == "ValueError" and needle in j.get("message", ""),
                       f"JSON error naming {needle!r}, got {p.stdout.strip()[:200]!r}")
            else:
                lines = p.stderr.strip().splitlines()
                expect(label, len(lines) == 1 and lines[0].startswith("fp8moe: ValueError: ")
                       and needle in lines[0], f"one stderr line naming {needle!r}, got "
                       f"{p.stderr.strip()[:300]!r}")
                expect(label, p.stdout == "", f"nothing on stdout, got {p.stdout[:200]!r}")


def main():
    t0 = time.time()
    n_pinned = 0
    for label, sub, case, exp in pinned_cases():
        n_pinned += 1
        model = MODEL[sub](case)
        if exp is not None:
            expect(label, exp(model), f"model gives {json.dumps(model)[:300]}; expected "
                   f"{exp.__doc__ or exp.__name__}")
        compare(sub, case, f"pinned: {label}")
    check_bad_inputs()
    t1 = time.time()
    n = int(os.environ.get("FP8MOE_DIFF_CASES", "3000"))
    seed = int(os.environ.get("FP8MOE_DIFF_SEED", "20260901"))
    rng = random.Random(seed)
    counts = {}
    outcomes = {}
    for i in range(n):
        r = rng.random()
        sub = "select" if r < 0.65 else ("support" if r < 0.8 else "resolve-block")
        case = random_case(rng, sub)
        counts[sub] = counts.get(sub, 0) + 1
        m = compare(sub, case, f"sweep #{i} (seed {seed})")
        if m is not None and sub == "select":
            key = m.get("backend") or m.get("error")
            outcomes[key] = outcomes.get(key, 0) + 1
    t2 = time.time()
    print(f"pinned: {n_pinned} cases in {t1 - t0:.1f}s; sweep: {n} cases {counts} in "
          f"{t2 - t1:.1f}s (seed {seed})")
    print("agreed select outcomes:", dict(sorted(outcomes.items(), key=lambda kv: -kv[1])))
    if DISAGREEMENTS:
        print(f"{len(DISAGREEMENTS)} disagreements; the first ones:")
        for label, sub, argv, lines in DISAGREEMENTS[:12]:
            print(f"- {label}: {' '.join(repr(a) if (' ' in a or not a) else a for a in argv)}")
            print("\n".join(lines))
    if FAILURES or DISAGREEMENTS:
        print(f"FAILED: {len(FAILURES)} expectations, {len(DISAGREEMENTS)} disagreements")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
