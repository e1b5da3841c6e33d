#!/usr/bin/env python3
"""An independent executable model of vLLM's FP8 MoE oracle, for differential testing of fp8moe.

Ported from the seed (/work/shared/seed/vllm_fused_moe_oracle_fp8.txt, vLLM's
`fused_moe/oracle/fp8.py`) and the spec (/work/shared/spec/oracle.md §1-§4) ONLY, on top of small
mocks of what those functions touch: QuantKey/ScaleDesc/GroupShape with vLLM's __str__, the named
keys, FusedMoEParallelConfig (dataclass repr, derived properties, make()), FusedMoEConfig, a platform
(cpu / cuda:<cap> / rocm:gfx* / xpu), the environment variables with vLLM's parsing, and every expert
class of spec §2.3 with `is_supported_config` = the base check of §2.1 plus the class overrides.
It was written without reading fp8moe's C++ oracle (src/oracle, src/experts): independence is the
point. Where the seed and spec are silent, docs/ORACLE.md's documented decisions are followed and
marked "fp8moe decision".

Entry points (all take plain CLI-style values, see `Case`):
  select(case)        -> {"backend", "kernel", "candidates", "trace", "path", "activation_format",
                          "weight_key", "activation_key"} or {"error", "message"}
  support(case)       -> {"priority", "verdicts": [{"backend", "kernel", "supported", "reason"}]}
  resolve_block(case) -> {"block_shape", "refine", "intermediate_size_per_partition",
                          "tp_shard_with_padding"} or {"error", "message"}
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

# ------------------------------------------------------------------------------------------------
# Errors: vLLM raises Python exceptions; the CLI prints {"error": <kind>, "message": <text>}.


class OracleError(Exception):
    kind = "Error"

    def __init__(self, message):
        super().__init__(message)
        self.message = message


class ValueError_(OracleError):
    kind = "ValueError"


class NotImplementedError_(OracleError):
    kind = "NotImplementedError"


# ------------------------------------------------------------------------------------------------
# GroupShape / ScaleDesc / QuantKey (spec §3.3)


class GroupShape(NamedTuple):
    row: int
    col: int


PER_TENSOR = GroupShape(-1, -1)
PER_TOKEN = GroupShape(1, -1)
PER_CHANNEL = GroupShape(-1, 1)


@dataclass(frozen=True)
class ScaleDesc:
    dtype: str  # torch.fx dtype_abbrs spelling: f32, u8, f8e4m3fn, f8e4m3fnuz
    static: bool
    group_shape: GroupShape

    def __str__(self):
        if self.group_shape == PER_TENSOR:
            gs = "per_tensor"
        elif self.group_shape == PER_TOKEN:
            gs = "per_token"
        elif self.group_shape == PER_CHANNEL:
            gs = "per_channel"
        else:
            gs = str(self.group_shape)  # NamedTuple repr: GroupShape(row=128, col=128)
        return f"{self.dtype},{'static' if self.static else 'dynamic'},{gs}"


@dataclass(frozen=True)
class QuantKey:
    dtype: str
    scale: ScaleDesc
    scale2: ScaleDesc | None = None
    symmetric: bool = True

    def __str__(self):
        scale2 = f"scale2({self.scale2})," if self.scale2 else ""
        return (f"QuantKey({self.dtype},scale({self.scale}),{scale2}"
                f"{'a' if not self.symmetric else ''}symmetric)")


def _fmt_key(k):
    return "None" if k is None else str(k)


def make_named_keys(fp8):
    """vLLM's named keys, built with FP8_DTYPE = current_platform.fp8_dtype() (spec §3.3)."""
    f32, u8 = "f32", "u8"
    s_tensor = ScaleDesc(f32, True, PER_TENSOR)
    k = {
        "kFp8StaticTensorSym": QuantKey(fp8, s_tensor),
        "kFp8DynamicTensorSym": QuantKey(fp8, ScaleDesc(f32, False, PER_TENSOR)),
        "kFp8StaticTokenSym": QuantKey(fp8, ScaleDesc(f32, True, PER_TOKEN)),
        "kFp8StaticChannelSym": QuantKey(fp8, ScaleDesc(f32, True, PER_CHANNEL)),
        "kFp8DynamicTokenSym": QuantKey(fp8, ScaleDesc(f32, False, PER_TOKEN)),
        "kFp8Dynamic128Sym": QuantKey(fp8, ScaleDesc(f32, False, GroupShape(1, 128))),
        "kFp8Static128BlockSym": QuantKey(fp8, ScaleDesc(f32, True, GroupShape(128, 128))),
        "kFp8Dynamic64Sym": QuantKey(fp8, ScaleDesc(f32, False, GroupShape(1, 64))),
        "kMxfp8Static": QuantKey(fp8, ScaleDesc(u8, True, GroupShape(1, 32))),
        "kMxfp8Dynamic": QuantKey(fp8, ScaleDesc(u8, False, GroupShape(1, 32))),
        "kMxfp4Static": QuantKey(u8, ScaleDesc(u8, True, GroupShape(1, 32))),
        "kMxfp4Dynamic": QuantKey(u8, ScaleDesc(u8, False, GroupShape(1, 32))),
        "kNvfp4Static": QuantKey(u8, ScaleDesc(fp8, True, GroupShape(1, 16)), scale2=s_tensor),
        "kNvfp4Dynamic": QuantKey(u8, ScaleDesc(fp8, False, GroupShape(1, 16)), scale2=s_tensor),
        "kInt8StaticChannelSym": QuantKey("i8", ScaleDesc(f32, True, PER_CHANNEL)),
        "kInt8DynamicTokenSym": QuantKey("i8", ScaleDesc(f32, False, PER_TOKEN)),
        "kInt8StaticTensorSym": QuantKey("i8", s_tensor),
        "kInt8DynamicTensorSym": QuantKey("i8", ScaleDesc(f32, False, PER_TENSOR)),
        # WNA16 weight keys (Marlin / Humming). Their dtypes are vLLM ScalarTypes; the spelling is
        # display only (fp8moe decision for the printed name).
        "kInt4Static": QuantKey("uint4b8", ScaleDesc(f32, True, GroupShape(1, 128))),
        "kInt8Static": QuantKey("i8", ScaleDesc(f32, True, GroupShape(1, 128))),
        "kInt4Static32": QuantKey("uint4b8", ScaleDesc(f32, True, GroupShape(1, 32))),
        "kInt4StaticAsym": QuantKey("uint4", ScaleDesc(f32, True, GroupShape(1, 128)),
                                    symmetric=False),
        "kInt4Static32Asym": QuantKey("uint4", ScaleDesc(f32, True, GroupShape(1, 32)),
                                      symmetric=False),
    }
    return k


def create_fp8_quant_key(static, group_shape, symmetric=True, scale_dtype="f32"):
    return QuantKey(current_platform.fp8_dtype(), ScaleDesc(scale_dtype, static, group_shape),
                    symmetric=symmetric)


def K(name):
    """A named key for the current platform (FP8_DTYPE follows the platform)."""
    return current_platform.keys[name]


# ------------------------------------------------------------------------------------------------
# Enums (spec §3.5, §3.6) and the activation format


class RoutingMethodType(enum.IntEnum):
    Default = 0
    Renormalize = 1
    DeepSeekV3 = 2
    Llama4 = 3
    RenormalizeNaive = 4
    TopK = 5
    SigmoidRenorm = 6
    MiniMax2 = 7
    Sigmoid = 8
    Unspecified = 9
    DeepseekV4 = 100
    Custom = 101
    Simulated = 102


class MoEActivation(enum.Enum):
    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU2 = "relu2"
    SWIGLUOAI = "swigluoai"
    SITU = "situ"
    SWIGLUOAI_UNINTERLEAVE = "swigluoai_uninterleave"
    SWIGLUSTEP = "swiglustep"
    SILU_NO_MUL = "silu_no_mul"
    GELU_NO_MUL = "gelu_no_mul"
    GELU_TANH_NO_MUL = "gelu_tanh_no_mul"
    RELU2_NO_MUL = "relu2_no_mul"

    @property
    def is_gated(self):
        return not self.value.endswith("_no_mul")

    # Python >= 3.11: f"{member}" of a plain Enum is "MoEActivation.SILU" (spec §2.1 check 3).
    def __format__(self, spec):
        return f"MoEActivation.{self.name}"

    @staticmethod
    def from_str(s):
        if s == "gelu_pytorch_tanh":
            s = "gelu_tanh"
        return MoEActivation(s)


APPLY_MOE_ACTIVATION_SUPPORTED = {
    MoEActivation.SILU, MoEActivation.GELU, MoEActivation.GELU_TANH, MoEActivation.SITU,
    MoEActivation.SWIGLUOAI, MoEActivation.SWIGLUOAI_UNINTERLEAVE, MoEActivation.SWIGLUSTEP,
    MoEActivation.SILU_NO_MUL, MoEActivation.GELU_NO_MUL, MoEActivation.GELU_TANH_NO_MUL,
    MoEActivation.RELU2_NO_MUL,
}


def apply_moe_activation_supported(a):
    return a in APPLY_MOE_ACTIVATION_SUPPORTED


class FusedMoEActivationFormat(enum.Enum):
    Standard = ("standard",)
    BatchedExperts = ("batched_experts",)


# ------------------------------------------------------------------------------------------------
# Platform (spec §2.2; features are the seed's has_*() functions, docs/ORACLE.md names)

FEATURES = ("deep_gemm", "flashinfer_trtllm", "flashinfer_cutlass", "humming", "hpc", "aiter",
            "cutlass_group_gemm", "amx_tile", "amx_fp8")


class Platform:
    def __init__(self, spec, installed="all"):
        self.spec = spec
        self.cap = None
        self.gfx = None
        self.arch = None
        if spec in ("cpu", "cpu:x86"):
            self.kind, self.arch = "cpu", "x86"
        elif spec == "cpu:arm":
            self.kind, self.arch = "cpu", "arm"
        elif spec.startswith("cuda:"):
            cap = spec[5:]
            if "." in cap:  # cuda:9.0 spelling (fp8moe CLI)
                major, minor = cap.split(".")
                cap = 10 * int(major) + int(minor)
            self.kind, self.cap = "cuda", int(cap)
        elif spec.startswith("rocm:"):
            self.kind, self.gfx = "rocm", spec[5:]
            assert self.gfx in ("gfx942", "gfx950", "gfx1200", "gfx1201")
        elif spec == "xpu":
            self.kind = "xpu"
        else:
            raise AssertionError(spec)
        if installed == "all":
            self.features = set(FEATURES)
        elif installed == "none":
            self.features = set()
        else:
            self.features = set(installed.split(","))
        self.keys = make_named_keys(self.fp8_dtype())

    # identity
    def is_cuda(self):
        return self.kind == "cuda"

    def is_rocm(self):
        return self.kind == "rocm"

    def is_cuda_alike(self):
        return self.kind in ("cuda", "rocm")

    def is_xpu(self):
        return self.kind == "xpu"

    def is_cpu(self):
        return self.kind == "cpu"

    @property
    def device_name(self):
        return self.kind

    def fp8_dtype(self):
        # float8_e4m3fnuz on MI300/MI325 (gfx94x), float8_e4m3fn everywhere else.
        return "f8e4m3fnuz" if self.gfx == "gfx942" else "f8e4m3fn"

    # capability helpers (vllm/platforms/interface.py). Only CUDA capabilities are modelled: every
    # use in the oracle and the predicates is guarded by is_cuda() (or, for FlashInfer's quant
    # list, only reached after its is_cuda() device check).
    def is_device_capability(self, c):
        return self.cap is not None and self.cap == c

    def is_device_capability_family(self, c):
        return self.cap is not None and self.cap // 10 == c // 10

    def has_device_capability(self, c):
        if isinstance(c, tuple):
            c = c[0] * 10 + c[1]
        return self.cap is not None and self.cap >= c

    def supports_fp8(self):
        if self.is_cuda():
            return self.has_device_capability(89)
        if self.is_rocm():
            return self.on_cdna() or self.on_rdna4()
        return self.is_xpu()

    # ROCm helpers
    def on_gfx9(self):
        return self.gfx is not None and self.gfx.startswith("gfx9")

    def on_cdna(self):
        return self.on_gfx9()

    def get_cdna_version(self):
        return {"gfx942": 3, "gfx950": 4}.get(self.gfx, 0)

    def on_gfx950(self):
        return self.gfx == "gfx950"

    def on_gfx1250(self):
        return False

    def on_rdna4(self):
        return self.gfx in ("gfx1200", "gfx1201")

    def support_deep_gemm(self):
        if not self.is_cuda():
            return False  # Platform default
        return (self.is_device_capability(90) or self.is_device_capability_family(100)
                or self.is_device_capability_family(120))

    # installed families
    def has(self, f):
        return f in self.features

    def is_x86(self):
        return self.arch == "x86"


# ------------------------------------------------------------------------------------------------
# Environment variables (spec §4)

ENV_VARS = ("VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0",
            "VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE", "VLLM_BATCH_INVARIANT",
            "VLLM_USE_FUSED_MOE_GROUPED_TOPK", "VLLM_HUMMING_MOE_GEMM_TYPE")


def _py_int(s):
    try:
        return int(s)
    except ValueError:
        raise ValueError_(f"invalid literal for int() with base 10: {s!r}") from None


class Envs:
    """vllm.envs: lazily parsed on every access (the parse errors are raised where vLLM reads)."""

    def __init__(self, env):
        self.env = dict(env)

    def is_set(self, name):
        assert name in ENV_VARS
        return name in self.env

    def _bool_int(self, name, default):
        return bool(_py_int(self.env.get(name, default)))

    def _bool_str(self, name, default):
        return self.env.get(name, default).lower() in ("true", "1")

    @property
    def VLLM_USE_DEEP_GEMM(self):
        return self._bool_int("VLLM_USE_DEEP_GEMM", "1")

    @property
    def VLLM_MOE_USE_DEEP_GEMM(self):
        return self._bool_int("VLLM_MOE_USE_DEEP_GEMM", "1")

    @property
    def VLLM_BATCH_INVARIANT(self):
        return self._bool_int("VLLM_BATCH_INVARIANT", "0")

    @property
    def VLLM_ROCM_USE_AITER(self):
        return self._bool_str("VLLM_ROCM_USE_AITER", "False")

    @property
    def VLLM_ROCM_USE_AITER_MOE(self):
        return self._bool_str("VLLM_ROCM_USE_AITER_MOE", "True")

    @property
    def VLLM_HUMMING_MOE_GEMM_TYPE(self):
        return self.env.get("VLLM_HUMMING_MOE_GEMM_TYPE")


# The "current" platform and envs, as module globals like vLLM's current_platform / vllm.envs.
current_platform: Platform = None  # type: ignore
envs: Envs = None  # type: ignore


def set_context(platform, env):
    global current_platform, envs
    current_platform = platform
    envs = env


class rocm_aiter_ops:
    @staticmethod
    def _aiter_supported():
        # @if_aiter_supported: ROCm, CDNA3+ (gfx9 umbrella), aiter importable
        p = current_platform
        return p.is_rocm() and p.get_cdna_version() > 2 and p.has("aiter")

    @staticmethod
    def is_fused_moe_enabled():
        if not rocm_aiter_ops._aiter_supported():
            return None
        # _AITER_ENABLED and _FMOE_ENABLED: class attributes captured from the env at import
        return envs.VLLM_ROCM_USE_AITER and envs.VLLM_ROCM_USE_AITER_MOE

    @staticmethod
    def is_rdna_aiter_enabled():
        p = current_platform
        if not (p.is_rocm() and p.has("aiter")):
            return False
        return p.on_rdna4() and envs.VLLM_ROCM_USE_AITER


def is_deep_gemm_supported():
    # envs.VLLM_USE_DEEP_GEMM and has_deep_gemm() and current_platform.support_deep_gemm()
    return (envs.VLLM_USE_DEEP_GEMM and current_platform.has("deep_gemm")
            and current_platform.support_deep_gemm())


def get_humming_moe_gemm_type():
    t = (envs.VLLM_HUMMING_MOE_GEMM_TYPE or "").lower()
    if t in ("grouped", "grouped_contiguous"):
        return "grouped_contiguous"
    return "indexed"


# ------------------------------------------------------------------------------------------------
# FusedMoEParallelConfig / FusedMoEConfig (spec §3.1, §3.2)


@dataclass
class FusedMoEParallelConfig:
    tp_size: int
    pcp_size: int
    dp_size: int
    ep_size: int
    tp_rank: int
    pcp_rank: int
    dp_rank: int
    ep_rank: int
    sp_size: int
    use_ep: bool
    all2all_backend: str
    enable_eplb: bool

    @property
    def is_sequence_parallel(self):
        return self.sp_size > 1

    @property
    def use_all2all_kernels(self):
        return self.use_ep and (self.dp_size > 1 or self.pcp_size > 1
                                or self.is_sequence_parallel)

    def _a2a(self, *names):
        return self.use_all2all_kernels and self.all2all_backend in names

    @property
    def use_deepep_ht_kernels(self):
        return self._a2a("deepep_high_throughput")

    @property
    def use_deepep_ll_kernels(self):
        return self._a2a("deepep_low_latency")

    @property
    def use_fi_nvl_two_sided_kernels(self):
        return self._a2a("flashinfer_all2allv", "flashinfer_nvlink_two_sided")

    @property
    def use_fi_nvl_one_sided_kernels(self):
        return self._a2a("flashinfer_nvlink_one_sided")

    @property
    def use_ag_rs_all2all_kernels(self):
        return self._a2a("allgather_reducescatter")

    @property
    def use_mori_kernels(self):
        return self._a2a("mori_high_throughput", "mori_low_latency")

    @property
    def use_nixl_ep_kernels(self):
        return self._a2a("nixl_ep")

    @property
    def use_deepep_v2_kernels(self):
        return self._a2a("deepep_v2")

    @property
    def use_batched_activation_format(self):
        return self.use_deepep_ll_kernels or self.use_nixl_ep_kernels

    @staticmethod
    def make(tp_size_, pcp_size_, dp_size_, sp_size_, enable_expert_parallel, all2all_backend,
             enable_eplb):
        # rank 0 of every group (the CLI describes rank 0)
        use_ep = dp_size_ * pcp_size_ * tp_size_ > 1 and enable_expert_parallel
        tp_size = dp_size_ * pcp_size_ * tp_size_
        tp_rank = 0
        if not use_ep:
            return FusedMoEParallelConfig(tp_size, pcp_size_, dp_size_, 1, tp_rank, 0, 0, 0,
                                          sp_size_, False, all2all_backend, enable_eplb)
        return FusedMoEParallelConfig(1, pcp_size_, dp_size_, tp_size, 0, 0, 0, tp_rank,
                                      sp_size_, True, all2all_backend, enable_eplb)


@dataclass
class FusedMoEConfig:
    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size: int
    activation: MoEActivation
    routing_method: RoutingMethodType
    moe_parallel_config: FusedMoEParallelConfig
    in_dtype: str
    router_logits_dtype: str | None = None
    moe_backend: str = "auto"
    has_bias: bool = False
    is_lora_enabled: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    swiglu_beta: float | None = None
    intermediate_size_per_partition: int = -1
    tp_shard_with_padding: bool = False

    def __post_init__(self):
        if self.router_logits_dtype is None:
            self.router_logits_dtype = self.in_dtype
        tp = self.moe_parallel_config.tp_size
        if self.intermediate_size % tp != 0:
            # vLLM asserts; fp8moe decision: a ValueError with this text.
            raise ValueError_(f"intermediate_size {self.intermediate_size} is not divisible by "
                              f"tp_size {tp}")
        self.intermediate_size_per_partition = self.intermediate_size // tp
        if not self.is_act_and_mul and not (current_platform.is_cuda_alike()
                                            or current_platform.is_xpu()):
            # fp8moe decision (docs/ORACLE.md): raised before selection.
            raise NotImplementedError_(
                "is_act_and_mul=False is supported only for CUDA, ROCm and XPU for now")

    @property
    def is_act_and_mul(self):
        return self.activation.is_gated

    @property
    def tp_size(self):
        return self.moe_parallel_config.tp_size

    @property
    def ep_size(self):
        return self.moe_parallel_config.ep_size


# ------------------------------------------------------------------------------------------------
# Expert classes (spec §2)


def _dtype_name(d):
    return {"bf16": "torch.bfloat16", "fp16": "torch.float16", "f32": "torch.float32"}[d]


class FusedMoEExperts:
    name = "?"
    monolithic = False

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.Standard

    @classmethod
    def _supports_current_device(cls):
        raise NotImplementedError

    @classmethod
    def _supports_no_act_and_mul(cls):
        raise NotImplementedError

    @classmethod
    def _supports_activation(cls, a):
        raise NotImplementedError

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        raise NotImplementedError

    @classmethod
    def _supports_parallel_config(cls, pc):
        raise NotImplementedError

    @classmethod
    def _supports_routing_method(cls, rm, wk, ak):
        return True

    @classmethod
    def _supports_router_logits_dtype(cls, dt, rm):
        return True

    @classmethod
    def _supports_shape(cls, hidden_dim):
        return True

    @classmethod
    def _supports_batch_invariance(cls):
        return False

    @classmethod
    def supports_lora(cls):
        return False

    @classmethod
    def base_is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
        def no(x):
            return False, "kernel does not support " + x

        if not cls._supports_current_device():
            return no(f"current device {current_platform.device_name}")
        if not (moe_config.is_act_and_mul or cls._supports_no_act_and_mul()):
            return no("no act_and_mul MLP layer")
        if not cls._supports_activation(moe_config.activation):
            return no(f"{moe_config.activation} activation")
        if not cls._supports_quant_scheme(weight_key, activation_key):
            return no(f"quantization scheme {_fmt_key(weight_key)}x{_fmt_key(activation_key)}")
        if not cls._supports_parallel_config(moe_config.moe_parallel_config):
            return no(f"parallel config {moe_config.moe_parallel_config!r}")
        if not cls._supports_routing_method(moe_config.routing_method, weight_key,
                                            activation_key):
            return no(f"routing method {int(moe_config.routing_method)}")
        if not cls._supports_router_logits_dtype(moe_config.router_logits_dtype,
                                                 moe_config.routing_method):
            return no(f"router logits dtype {_dtype_name(moe_config.router_logits_dtype)}")
        if not cls._supports_shape(moe_config.hidden_dim):
            return no(f"{moe_config.hidden_dim} hidden dim is not supported")
        if activation_format != cls.activation_format():
            return no(f"{activation_format.value} activation format")
        if not (not envs.VLLM_BATCH_INVARIANT or cls._supports_batch_invariance()):
            return no("batch invariance")
        if not (not moe_config.is_lora_enabled or cls.supports_lora()):
            return no("LoRA")
        return True, None

    @classmethod
    def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
        return cls.base_is_supported_config(moe_config, weight_key, activation_key,
                                            activation_format)


def _in(wk, ak, pairs):
    return (wk, ak) in pairs


def B128():
    return (K("kFp8Static128BlockSym"), K("kFp8Dynamic128Sym"))


def TT():
    return (K("kFp8StaticTensorSym"), K("kFp8StaticTensorSym"))


def TD():
    return (K("kFp8StaticTensorSym"), K("kFp8DynamicTensorSym"))


def TTok():
    return (K("kFp8StaticTensorSym"), K("kFp8DynamicTokenSym"))


def CTok():
    return (K("kFp8StaticChannelSym"), K("kFp8DynamicTokenSym"))


def MX():
    return (K("kMxfp8Static"), K("kMxfp8Dynamic"))


A = MoEActivation
R = RoutingMethodType

# --- FLASHINFER_TRTLLM --------------------------------------------------------------------------


def _trtllm_experts_limit(cls, moe_config, wk, ak, fmt):
    ok, reason = cls.base_is_supported_config(moe_config, wk, ak, fmt)
    if ok and moe_config.num_experts > 2048:
        return False, (f"FlashInfer TRTLLM routing supports at most 2048 experts, but got "
                       f"{moe_config.num_experts}")
    return ok, reason


class TrtLlmFp8ExpertsMonolithic(FusedMoEExperts):
    name = "TrtLlmFp8ExpertsMonolithic"
    monolithic = True

    @classmethod
    def _supports_current_device(cls):
        p = current_platform
        return p.is_cuda() and p.is_device_capability_family(100) and p.has("flashinfer_trtllm")

    @classmethod
    def _supports_no_act_and_mul(cls):
        return True  # (the docstring says "Does not support"; the method returns True)

    @classmethod
    def _supports_activation(cls, a):
        return a in (A.SILU, A.SWIGLUOAI_UNINTERLEAVE, A.RELU2_NO_MUL)

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        return _in(wk, ak, [B128(), TT(), MX()])

    @classmethod
    def _supports_parallel_config(cls, pc):
        return ((not pc.use_all2all_kernels or pc.use_ag_rs_all2all_kernels)
                and not (pc.enable_eplb or pc.is_sequence_parallel))

    @classmethod
    def _supports_routing_method(cls, rm, wk, ak):
        base = {R.DeepSeekV3, R.Renormalize, R.RenormalizeNaive, R.SigmoidRenorm, R.Sigmoid,
                R.MiniMax2, R.Simulated}
        if (wk, ak) in (B128(), MX()):
            return rm in base
        if (wk, ak) == TT():
            return rm in base | {R.Llama4}
        raise ValueError_("Unsupported quantization scheme.")

    @classmethod
    def _supports_router_logits_dtype(cls, dt, rm):
        return dt in ("bf16", "f32")

    @classmethod
    def is_supported_config(cls, moe_config, wk, ak, fmt):
        return _trtllm_experts_limit(cls, moe_config, wk, ak, fmt)


class TrtLlmFp8ExpertsModular(TrtLlmFp8ExpertsMonolithic):
    name = "TrtLlmFp8ExpertsModular"
    monolithic = False

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        return _in(wk, ak, [B128(), MX()])

    @classmethod
    def _supports_parallel_config(cls, pc):
        return ((not pc.use_all2all_kernels or pc.use_ag_rs_all2all_kernels
                 or pc.use_deepep_v2_kernels or pc.use_fi_nvl_one_sided_kernels
                 or pc.use_fi_nvl_two_sided_kernels) and not pc.enable_eplb)

    @classmethod
    def _supports_routing_method(cls, rm, wk, ak):
        return True

    @classmethod
    def _supports_router_logits_dtype(cls, dt, rm):
        return True


# --- FLASHINFER_CUTLASS -------------------------------------------------------------------------


class FlashInferExperts(FusedMoEExperts):
    name = "FlashInferExperts"

    @classmethod
    def _supports_current_device(cls):
        p = current_platform
        return (p.is_cuda() and (p.is_device_capability(90) or p.is_device_capability_family(100)
                                 or p.is_device_capability_family(120))
                and p.has("flashinfer_cutlass"))

    @classmethod
    def _supports_no_act_and_mul(cls):
        return True

    @classmethod
    def _supports_activation(cls, a):
        return a in (A.SILU, A.GELU_TANH, A.RELU2_NO_MUL, A.SWIGLUOAI, A.SWIGLUOAI_UNINTERLEAVE)

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        p = current_platform
        pairs = []
        if p.has_device_capability(90):
            pairs += [(None, None), TT()]
        if p.is_device_capability(90):
            pairs += [B128(), (K("kMxfp4Static"), None)]
        if p.has_device_capability(100):
            pairs += [(K("kMxfp4Static"), K("kMxfp8Dynamic")),
                      (K("kNvfp4Static"), K("kNvfp4Dynamic"))]
        return _in(wk, ak, pairs)

    @classmethod
    def _supports_parallel_config(cls, pc):
        return True


# --- DEEPGEMM / BATCHED_DEEPGEMM ----------------------------------------------------------------


class DeepGemmExperts(FusedMoEExperts):
    name = "DeepGemmExperts"

    @classmethod
    def _supports_current_device(cls):
        return is_deep_gemm_supported()

    @classmethod
    def _supports_no_act_and_mul(cls):
        return False

    @classmethod
    def _supports_activation(cls, a):
        return a in (A.SILU, A.SWIGLUSTEP, A.SWIGLUOAI_UNINTERLEAVE)

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        pairs = [B128()]
        if current_platform.is_device_capability_family(100):
            pairs.append(MX())
        return _in(wk, ak, pairs)

    @classmethod
    def _supports_parallel_config(cls, pc):
        return not (pc.use_fi_nvl_two_sided_kernels or pc.use_fi_nvl_one_sided_kernels)


class BatchedDeepGemmExperts(FusedMoEExperts):
    name = "BatchedDeepGemmExperts"

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.BatchedExperts

    @classmethod
    def _supports_current_device(cls):
        return is_deep_gemm_supported()

    @classmethod
    def _supports_no_act_and_mul(cls):
        return False

    @classmethod
    def _supports_activation(cls, a):
        return a == A.SILU

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        return _in(wk, ak, [B128()])

    @classmethod
    def _supports_parallel_config(cls, pc):
        return True


# --- TRITON / BATCHED_TRITON --------------------------------------------------------------------


class TritonExperts(FusedMoEExperts):
    name = "TritonExperts"

    @classmethod
    def _supports_current_device(cls):
        return current_platform.is_cuda_alike() or current_platform.is_xpu()

    @classmethod
    def _supports_no_act_and_mul(cls):
        return True

    @classmethod
    def _supports_activation(cls, a):
        return apply_moe_activation_supported(a)

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        p = current_platform
        pairs = [(None, None)]
        # int8: CUDA >= 7.5, ROCm, or XPU. fp8moe decision: the whole predicate follows the [N]
        # version of triton_moe.py (the one contemporary with the seed's refine path), which adds
        # XPU to the snapshot's CUDA/ROCm int8 rule.
        if (p.is_cuda() and p.has_device_capability((7, 5))) or p.is_rocm() or p.is_xpu():
            pairs += [(K("kInt8StaticChannelSym"), K("kInt8DynamicTokenSym")),
                      (K("kInt8StaticTensorSym"), K("kInt8DynamicTensorSym"))]
        if p.supports_fp8():
            pairs += [B128(), CTok(), TTok(), TT(), TD()]
            # fp8moe decision (docs/ORACLE.md; spec [N]): any static symmetric f32-scaled FP8
            # weight block (row > 1, col > 1) with kFp8Dynamic128Sym, so refined keys reach Triton.
            if (wk is not None and ak == K("kFp8Dynamic128Sym") and wk.dtype == p.fp8_dtype()
                    and wk.symmetric and wk.scale.static and wk.scale.dtype == "f32"
                    and wk.scale.group_shape.row > 1 and wk.scale.group_shape.col > 1):
                return True
        return _in(wk, ak, pairs)

    @classmethod
    def _supports_parallel_config(cls, pc):
        return not (pc.use_fi_nvl_two_sided_kernels or pc.use_fi_nvl_one_sided_kernels)

    @classmethod
    def _supports_batch_invariance(cls):
        return True

    @classmethod
    def supports_lora(cls):
        return True  # LoRAExpertsMixin

    @classmethod
    def is_supported_config(cls, moe_config, wk, ak, fmt):
        ok, reason = cls.base_is_supported_config(moe_config, wk, ak, fmt)
        if not ok or not current_platform.is_cuda_alike():
            return ok, reason
        if (moe_config.num_experts + 31) // 32 * 32 >= 1024:
            return False, "kernel's moe_align_block_size requires fewer than 1024 padded experts"
        return True, None


class BatchedTritonExperts(FusedMoEExperts):
    name = "BatchedTritonExperts"

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.BatchedExperts

    @classmethod
    def _supports_current_device(cls):
        return current_platform.is_cuda_alike() or current_platform.is_xpu()

    @classmethod
    def _supports_no_act_and_mul(cls):
        return True

    @classmethod
    def _supports_activation(cls, a):
        return a in (A.SILU, A.GELU, A.GELU_TANH, A.SWIGLUOAI, A.SILU_NO_MUL, A.GELU_NO_MUL,
                     A.GELU_TANH_NO_MUL, A.RELU2_NO_MUL)

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        p = current_platform
        # spec §2.3: ROCm get_cdna_version() > 2 or on_rdna4(); CUDA has_device_capability(89).
        # The spec names no XPU clause, so XPU gets (None, None) only.
        fp8 = ((p.is_rocm() and (p.get_cdna_version() > 2 or p.on_rdna4()))
               or (p.is_cuda() and p.has_device_capability((8, 9))))
        pairs = [(None, None)]
        if fp8:
            pairs += [B128(), CTok(), TTok(), TT(), TD()]
        return _in(wk, ak, pairs)

    @classmethod
    def _supports_parallel_config(cls, pc):
        return True


# --- FallbackExperts: AND of the primary and the fallback ---------------------------------------


class FallbackExperts(FusedMoEExperts):
    primary = None
    fallback = None

    @classmethod
    def get_clses(cls):
        return (cls.primary, cls.fallback)

    @classmethod
    def activation_format(cls):
        a, b = cls.get_clses()
        assert a.activation_format() == b.activation_format()
        return a.activation_format()

    @classmethod
    def _supports_current_device(cls):
        a, b = cls.get_clses()
        return a._supports_current_device() and b._supports_current_device()

    @classmethod
    def _supports_no_act_and_mul(cls):
        a, b = cls.get_clses()
        return a._supports_no_act_and_mul() and b._supports_no_act_and_mul()

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        a, b = cls.get_clses()
        return a._supports_quant_scheme(wk, ak) and b._supports_quant_scheme(wk, ak)

    @classmethod
    def _supports_activation(cls, act):
        a, b = cls.get_clses()
        return a._supports_activation(act) and b._supports_activation(act)

    @classmethod
    def _supports_parallel_config(cls, pc):
        a, b = cls.get_clses()
        return a._supports_parallel_config(pc) and b._supports_parallel_config(pc)

    # routing / logits / shape / batch invariance / LoRA: base defaults; is_supported_config:
    # the base check (the TritonExperts 1024-expert override is NOT applied).


class TritonOrDeepGemmExperts(FallbackExperts):
    name = "TritonOrDeepGemmExperts"
    primary = DeepGemmExperts
    fallback = TritonExperts


# --- VLLM_CUTLASS / BATCHED_VLLM_CUTLASS --------------------------------------------------------


class CutlassExpertsFp8(FusedMoEExperts):
    name = "CutlassExpertsFp8"

    @classmethod
    def _supports_current_device(cls):
        p = current_platform
        return p.is_cuda() and 90 <= p.cap < 110 and p.has("cutlass_group_gemm")

    @classmethod
    def _supports_no_act_and_mul(cls):
        return False

    @classmethod
    def _supports_activation(cls, a):
        return a.is_gated and apply_moe_activation_supported(a)

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        return _in(wk, ak, [CTok(), TD(), TT()])

    @classmethod
    def _supports_parallel_config(cls, pc):
        return not (pc.use_fi_nvl_two_sided_kernels or pc.use_deepep_ht_kernels
                    or pc.use_fi_nvl_one_sided_kernels)


class TritonOrCutlassExperts(FallbackExperts):
    name = "TritonOrCutlassExperts"
    primary = CutlassExpertsFp8
    fallback = TritonExperts


class CutlassBatchedExpertsFp8(CutlassExpertsFp8):
    name = "CutlassBatchedExpertsFp8"

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.BatchedExperts

    @classmethod
    def _supports_parallel_config(cls, pc):
        return True


# --- MARLIN -------------------------------------------------------------------------------------


class MarlinExperts(FusedMoEExperts):
    name = "MarlinExperts"

    @classmethod
    def _supports_current_device(cls):
        return current_platform.is_cuda() and current_platform.has_device_capability((7, 5))

    @classmethod
    def _supports_no_act_and_mul(cls):
        return True

    @classmethod
    def _supports_activation(cls, a):
        return apply_moe_activation_supported(a)

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        # weight key only; the activation key is ignored (W8A16)
        return wk in [K(n) for n in (
            "kFp8Static128BlockSym", "kFp8StaticChannelSym", "kFp8StaticTensorSym",
            "kMxfp4Static", "kMxfp8Static", "kNvfp4Static", "kInt4Static", "kInt8Static",
            "kInt4Static32", "kInt4StaticAsym", "kInt4Static32Asym")]

    @classmethod
    def _supports_parallel_config(cls, pc):
        return not pc.use_fi_nvl_two_sided_kernels

    @classmethod
    def supports_lora(cls):
        return True


# --- HUMMING ------------------------------------------------------------------------------------

class HummingExpertsBase(FusedMoEExperts):
    """Resolved disagreement (see the report): the spec summarises Humming's activation rule as
    apply_moe_activation_supported and its quant rule as "the FP8 entries plus every WNA16 weight
    key". vLLM's source of the snapshot (fused_humming_moe.py, whose FP8 entries are exactly the
    spec's, in the same order) spells both out: an explicit activation list WITHOUT SITU, and an
    explicit (W, A) list whose WNA16 weights are kInt4Static and kInt8Static only, plus the MXFP4,
    NVFP4 and INT8 W8A8 pairs. The model follows the source."""
    gemm_type = None

    @classmethod
    def _supports_current_device(cls):
        p = current_platform
        return p.has("humming") and p.is_cuda() and p.has_device_capability((7, 5))

    @classmethod
    def _supports_no_act_and_mul(cls):
        return True

    @classmethod
    def _supports_activation(cls, a):
        return a in (A.SILU, A.GELU, A.GELU_TANH, A.SWIGLUOAI, A.SWIGLUOAI_UNINTERLEAVE,
                     A.SWIGLUSTEP, A.SILU_NO_MUL, A.GELU_NO_MUL, A.GELU_TANH_NO_MUL,
                     A.RELU2_NO_MUL)

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        ch, t, blk = K("kFp8StaticChannelSym"), K("kFp8StaticTensorSym"), K("kFp8Static128BlockSym")
        tok, d128 = K("kFp8DynamicTokenSym"), K("kFp8Dynamic128Sym")
        mxs, mxd = K("kMxfp8Static"), K("kMxfp8Dynamic")
        mx4s, mx4d = K("kMxfp4Static"), K("kMxfp4Dynamic")
        nv4s, nv4d = K("kNvfp4Static"), K("kNvfp4Dynamic")
        i4, i8 = K("kInt4Static"), K("kInt8Static")
        i8ch, i8tok = K("kInt8StaticChannelSym"), K("kInt8DynamicTokenSym")
        pairs = [(mx4s, None), (mx4s, mx4d), (mx4s, mxd), (mx4s, tok), (nv4s, None), (nv4s, tok),
                 (mxs, None), (mxs, tok), (ch, None), (ch, tok), (blk, None), (blk, tok),
                 (i4, None), (i4, tok), (i8, None), (i8, tok),
                 (ch, t), (ch, d128), (t, None), (t, tok), (t, t), (t, d128), (blk, d128),
                 (i8ch, None), (i8ch, i8tok), (nv4s, nv4d), (mxs, mxd)]
        return _in(wk, ak, pairs)

    @classmethod
    def _supports_parallel_config(cls, pc):
        return True

    @classmethod
    def _supports_batch_invariance(cls):
        return True

    @classmethod
    def is_supported_config(cls, moe_config, wk, ak, fmt):
        ok, reason = cls.base_is_supported_config(moe_config, wk, ak, fmt)
        if not ok:
            return ok, reason
        preferred = get_humming_moe_gemm_type()
        if cls.gemm_type != preferred:
            return False, f"preferred gemm type {preferred} != supported gemm type {cls.gemm_type}"
        return True, None


class BatchedHummingGroupedExperts(HummingExpertsBase):
    name = "BatchedHummingGroupedExperts"
    gemm_type = "grouped_masked"

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.BatchedExperts


class HummingGroupedExperts(HummingExpertsBase):
    name = "HummingGroupedExperts"
    gemm_type = "grouped_contiguous"


class HummingIndexedExperts(HummingExpertsBase):
    name = "HummingIndexedExperts"
    gemm_type = "indexed"


# --- AITER --------------------------------------------------------------------------------------


class AiterExperts(FusedMoEExperts):
    name = "AiterExperts"

    @classmethod
    def _supports_current_device(cls):
        return bool(rocm_aiter_ops.is_fused_moe_enabled())

    @classmethod
    def _supports_no_act_and_mul(cls):
        return False

    @classmethod
    def _supports_activation(cls, a):
        return a in (A.SILU, A.GELU, A.SITU, A.SWIGLUOAI, A.SWIGLUOAI_UNINTERLEAVE)

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        p = current_platform
        pairs = [(None, None), B128(), TT(), TD(), CTok()]
        if p.on_gfx950() and not p.on_gfx1250():
            pairs += [(K("kMxfp4Static"), None), (K("kMxfp4Static"), K("kMxfp4Dynamic"))]
        return _in(wk, ak, pairs)

    @classmethod
    def _supports_parallel_config(cls, pc):
        return not (pc.use_fi_nvl_two_sided_kernels or pc.use_fi_nvl_one_sided_kernels)

    @classmethod
    def is_supported_config(cls, moe_config, wk, ak, fmt):
        ok, reason = cls.base_is_supported_config(moe_config, wk, ak, fmt)
        if not ok and not rocm_aiter_ops.is_fused_moe_enabled():
            reason = (f"{reason}. AITER MoE is not enabled — set VLLM_ROCM_USE_AITER=1 and "
                      "VLLM_ROCM_USE_AITER_MOE=1 to enable it")
        return ok, reason


# --- XPU ----------------------------------------------------------------------------------------


class XPUExpertsBase(FusedMoEExperts):
    @classmethod
    def _supports_current_device(cls):
        return current_platform.is_xpu()

    @classmethod
    def _supports_no_act_and_mul(cls):
        return True

    @classmethod
    def _supports_activation(cls, a):
        return a in (A.SILU, A.GELU, A.GELU_TANH, A.SWIGLUOAI, A.RELU2_NO_MUL)

    @classmethod
    def _supports_parallel_config(cls, pc):
        return True


class XPUExpertsFp8(XPUExpertsBase):
    name = "XPUExpertsFp8"

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        return _in(wk, ak, [(K("kFp8StaticTensorSym"), None), TD()])


class XPUExpertsMxFp8(XPUExpertsBase):
    name = "XPUExpertsMxFp8"

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        return _in(wk, ak, [(K("kMxfp8Static"), None), MX()])


class XPUExpertsBlockFp8(XPUExpertsBase):
    name = "XPUExpertsBlockFp8"

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        return _in(wk, ak, [B128()])


# --- CPU / CPU_W8A8 -----------------------------------------------------------------------------


class CPUExpertsFp8(FusedMoEExperts):
    name = "CPUExpertsFp8"
    monolithic = True

    @classmethod
    def _supports_current_device(cls):
        p = current_platform
        return p.is_cpu() and p.is_x86() and p.has("amx_tile")

    @classmethod
    def _supports_no_act_and_mul(cls):
        return False

    @classmethod
    def _supports_activation(cls, a):
        return a == A.SILU

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        return _in(wk, ak, [B128()])

    @classmethod
    def _supports_parallel_config(cls, pc):
        return True

    @classmethod
    def _supports_routing_method(cls, rm, wk, ak):
        return rm in (R.Default, R.Renormalize, R.RenormalizeNaive)

    @classmethod
    def _supports_router_logits_dtype(cls, dt, rm):
        return True


class CPUExpertsFp8W8A8(CPUExpertsFp8):
    """fp8moe decision (docs/ORACLE.md): the seed names CPU_W8A8 but gives only a comment. x86 with
    AMX-FP8, block FP8 (B128) only, SiLU only, routing Default/Renormalize/RenormalizeNaive; it
    rejects expert biases and any swiglu_limit/alpha/beta (its quant config carries none). The two
    extra reason texts are fp8moe's."""
    name = "CPUExpertsFp8W8A8"

    @classmethod
    def _supports_current_device(cls):
        p = current_platform
        return p.is_cpu() and p.is_x86() and p.has("amx_fp8")

    @classmethod
    def is_supported_config(cls, moe_config, wk, ak, fmt):
        ok, reason = cls.base_is_supported_config(moe_config, wk, ak, fmt)
        if not ok:
            return ok, reason
        if moe_config.has_bias:
            return False, ("kernel does not support expert bias (the CPU_W8A8 quant config "
                           "carries no biases)")
        if (moe_config.swiglu_limit is not None or moe_config.swiglu_alpha is not None
                or moe_config.swiglu_beta is not None):
            return False, ("kernel does not support SwiGLU limit/alpha/beta (the CPU_W8A8 quant "
                           "config carries no SwiGLU parameters)")
        return True, None


# --- HPC ----------------------------------------------------------------------------------------


class HPCExperts(FusedMoEExperts):
    name = "HPCExperts"

    @classmethod
    def _supports_current_device(cls):
        p = current_platform
        return p.is_cuda() and p.is_device_capability(90) and p.has("hpc")

    @classmethod
    def _supports_no_act_and_mul(cls):
        return False

    @classmethod
    def _supports_activation(cls, a):
        return a == A.SILU

    @classmethod
    def _supports_quant_scheme(cls, wk, ak):
        return _in(wk, ak, [TT(), B128()])

    @classmethod
    def _supports_shape(cls, hidden_dim):
        return hidden_dim % 128 == 0

    @classmethod
    def _supports_parallel_config(cls, pc):
        return True


# ------------------------------------------------------------------------------------------------
# Fp8MoeBackend, backend_to_kernel_cls, map_fp8_backend (spec §1.1-§1.3, seed)


class Fp8MoeBackend(enum.Enum):
    NONE = "NONE"
    FLASHINFER_TRTLLM = "FLASHINFER_TRTLLM"
    FLASHINFER_CUTLASS = "FLASHINFER_CUTLASS"
    DEEPGEMM = "DEEPGEMM"
    BATCHED_DEEPGEMM = "BATCHED_DEEPGEMM"
    MARLIN = "MARLIN"
    HUMMING = "HUMMING"
    TRITON = "TRITON"
    BATCHED_TRITON = "BATCHED_TRITON"
    AITER = "AITER"
    VLLM_CUTLASS = "VLLM_CUTLASS"
    BATCHED_VLLM_CUTLASS = "BATCHED_VLLM_CUTLASS"
    XPU = "XPU"
    CPU_W8A8 = "CPU_W8A8"
    CPU = "CPU"
    HPC = "HPC"


B = Fp8MoeBackend

BACKEND_TO_KERNEL_CLS = {
    B.FLASHINFER_TRTLLM: [TrtLlmFp8ExpertsMonolithic, TrtLlmFp8ExpertsModular],
    B.FLASHINFER_CUTLASS: [FlashInferExperts],
    B.DEEPGEMM: [TritonOrDeepGemmExperts],
    B.BATCHED_DEEPGEMM: [BatchedDeepGemmExperts],
    B.HUMMING: [BatchedHummingGroupedExperts, HummingGroupedExperts, HummingIndexedExperts],
    B.MARLIN: [MarlinExperts],
    B.TRITON: [TritonExperts],
    B.BATCHED_TRITON: [BatchedTritonExperts],
    B.AITER: [AiterExperts],
    B.VLLM_CUTLASS: [TritonOrCutlassExperts],
    B.BATCHED_VLLM_CUTLASS: [CutlassBatchedExpertsFp8],
    B.XPU: [XPUExpertsFp8, XPUExpertsMxFp8, XPUExpertsBlockFp8],
    B.CPU_W8A8: [CPUExpertsFp8W8A8],  # fp8moe decision
    B.CPU: [CPUExpertsFp8],
    B.HPC: [HPCExperts],
}


def backend_to_kernel_cls(backend):
    if backend not in BACKEND_TO_KERNEL_CLS:
        raise ValueError_(f"Unknown FP8 MoE backend: {backend.value}")
    return BACKEND_TO_KERNEL_CLS[backend]


def map_fp8_backend(runner_backend):
    mapping = {
        "triton": B.TRITON,
        "deep_gemm": B.DEEPGEMM,
        "cutlass": B.VLLM_CUTLASS,
        "flashinfer_trtllm": B.FLASHINFER_TRTLLM,
        "flashinfer_cutlass": B.FLASHINFER_CUTLASS,
        "marlin": B.MARLIN,
        "humming": B.HUMMING,
        "aiter": B.AITER,
        "hpc": B.HPC,
    }
    if backend := mapping.get(runner_backend):
        return backend
    raise ValueError_(f"moe_backend='{runner_backend}' is not supported for FP8 MoE. "
                      f"Expected one of {list(mapping.keys())}.")


# ------------------------------------------------------------------------------------------------
# The seed: _get_priority_backends and select_fp8_moe_backend


def _get_priority_backends(moe_config, weight_key, activation_key):
    avail = [B.AITER, B.FLASHINFER_TRTLLM, B.FLASHINFER_CUTLASS, B.DEEPGEMM, B.VLLM_CUTLASS,
             B.TRITON, B.MARLIN, B.HUMMING, B.BATCHED_DEEPGEMM, B.BATCHED_VLLM_CUTLASS,
             B.BATCHED_TRITON, B.XPU, B.CPU_W8A8, B.CPU, B.HPC]

    def _move_to_front(backends, backend):
        backends.insert(0, backends.pop(backends.index(backend)))

    p = current_platform
    pc = moe_config.moe_parallel_config
    block = (activation_key == K("kFp8Dynamic128Sym")
             and weight_key == K("kFp8Static128BlockSym"))
    if p.is_cuda() and p.is_device_capability_family(100) and pc.use_deepep_v2_kernels and block:
        _move_to_front(avail, B.FLASHINFER_TRTLLM)
    if p.is_cuda() and p.is_device_capability(90) and block:
        if pc.ep_size > 1:
            _move_to_front(avail, B.FLASHINFER_CUTLASS)
        else:
            _move_to_front(avail, B.TRITON)
    if p.is_xpu():
        _move_to_front(avail, B.XPU)
    if p.is_cpu():
        _move_to_front(avail, B.CPU)
        _move_to_front(avail, B.CPU_W8A8)
    return avail


def select_fp8_moe_backend(config, weight_key, activation_key, allow_vllm_cutlass, trace):
    """Returns (backend, k_cls, candidates, path); appends (backend, cls, ok, reason) to trace."""
    AVAILABLE = _get_priority_backends(config, weight_key, activation_key)
    activation_format = (FusedMoEActivationFormat.BatchedExperts
                         if config.moe_parallel_config.use_batched_activation_format
                         else FusedMoEActivationFormat.Standard)

    def _make_log_unsupported(backend, reason):
        if reason:
            return (f"FP8 MoE backend {backend.value} does not support the deployment "
                    f"configuration since {reason}.")
        return f"FP8 MoE backend '{backend.value}' does not support the deployment configuration."

    def _return_or_raise(backend, path):
        reason = None
        for k_cls in backend_to_kernel_cls(backend):
            supported, reason = k_cls.is_supported_config(config, weight_key, activation_key,
                                                          activation_format)
            trace.append((backend.value, k_cls.name, supported, reason))
            if supported:
                return backend, k_cls, [b.value for b in AVAILABLE], path, activation_format
        raise ValueError_(_make_log_unsupported(backend, reason))

    runner_backend = config.moe_backend
    if runner_backend != "auto":
        requested = map_fp8_backend(runner_backend)
        if activation_format == FusedMoEActivationFormat.BatchedExperts:
            if requested == B.DEEPGEMM:
                requested = B.BATCHED_DEEPGEMM
            elif requested == B.TRITON:
                requested = B.BATCHED_TRITON
            elif requested == B.VLLM_CUTLASS:
                requested = B.BATCHED_VLLM_CUTLASS
        if requested in (B.VLLM_CUTLASS, B.BATCHED_VLLM_CUTLASS) and not allow_vllm_cutlass:
            raise ValueError_("vLLM CUTLASS FP8 MoE backend is disabled for this configuration.")
        return _return_or_raise(requested, "moe_backend")

    if envs.is_set("VLLM_USE_DEEP_GEMM") or envs.is_set("VLLM_MOE_USE_DEEP_GEMM"):
        if not envs.VLLM_USE_DEEP_GEMM or not envs.VLLM_MOE_USE_DEEP_GEMM:
            AVAILABLE.remove(B.DEEPGEMM)
            AVAILABLE.remove(B.BATCHED_DEEPGEMM)
        else:
            backend = (B.DEEPGEMM if activation_format == FusedMoEActivationFormat.Standard
                       else B.BATCHED_DEEPGEMM)
            return _return_or_raise(backend, "VLLM_USE_DEEP_GEMM")

    if envs.is_set("VLLM_ROCM_USE_AITER") or envs.is_set("VLLM_ROCM_USE_AITER_MOE"):
        skip_aiter_moe = (not envs.VLLM_ROCM_USE_AITER or not envs.VLLM_ROCM_USE_AITER_MOE
                          or rocm_aiter_ops.is_rdna_aiter_enabled())
        if skip_aiter_moe:
            if B.AITER in AVAILABLE:
                AVAILABLE.remove(B.AITER)
        else:
            return _return_or_raise(B.AITER, "VLLM_ROCM_USE_AITER")

    if not allow_vllm_cutlass:
        AVAILABLE.remove(B.VLLM_CUTLASS)
        AVAILABLE.remove(B.BATCHED_VLLM_CUTLASS)

    for backend in AVAILABLE:
        for k_cls in backend_to_kernel_cls(backend):
            supported, reason = k_cls.is_supported_config(config, weight_key, activation_key,
                                                          activation_format)
            trace.append((backend.value, k_cls.name, supported, reason))
            if supported:
                return backend, k_cls, [b.value for b in AVAILABLE], "auto", activation_format

    if current_platform.is_cuda() or current_platform.is_rocm():
        raise NotImplementedError_("No FP8 MoE backend supports the deployment configuration.")
    return B.NONE, None, [b.value for b in AVAILABLE], "none", activation_format


# ------------------------------------------------------------------------------------------------
# The seed: refine / pad / resolve


def round_up(x, m):
    return (x + m - 1) // m * m


def refine_fp8_moe_block_shape(config, weight_block_size):
    block_n, block_k = weight_block_size
    ispp = config.intermediate_size_per_partition
    if ispp % block_n == 0 and (config.tp_size == 1 or ispp % block_k == 0):
        return None
    refine = math.gcd(block_n, block_k, ispp, config.hidden_dim)
    if refine < 32:
        return None
    return [refine, refine]


def pad_tp_shard_to_weight_blocks(config, weight_block_size):
    block_n, block_k = weight_block_size
    if (block_n != block_k or config.tp_size == 1
            or config.intermediate_size_per_partition % block_n == 0):
        return False
    if (config.intermediate_size % block_n != 0 or config.hidden_dim % block_n != 0
            or config.ep_size != 1 or config.is_lora_enabled or config.has_bias):
        raise ValueError_(
            f"Block-aligned FP8 TP sharding requires {block_n}-aligned "
            "global expert dimensions, pure TP, and no LoRA or "
            "expert bias.")
    config.tp_shard_with_padding = True
    config.intermediate_size_per_partition = round_up(config.intermediate_size_per_partition,
                                                      block_n)
    return True


def resolve_fp8_moe_weight_block_shape(config, weight_block_size, activation_key,
                                       is_checkpoint_fp8_serialized):
    refined_shape = refine_fp8_moe_block_shape(config, weight_block_size)
    if is_checkpoint_fp8_serialized and config.moe_backend != "auto":
        kernel_classes = backend_to_kernel_cls(map_fp8_backend(config.moe_backend))
        can_refine = refined_shape is not None and any(
            k_cls._supports_quant_scheme(
                create_fp8_quant_key(static=True, group_shape=GroupShape(*refined_shape)),
                activation_key)
            for k_cls in kernel_classes)
        if not can_refine and pad_tp_shard_to_weight_blocks(config, weight_block_size):
            return weight_block_size, None
    if refined_shape is None:
        return weight_block_size, None
    return refined_shape, (weight_block_size[0] // refined_shape[0],
                           weight_block_size[1] // refined_shape[1])


# ------------------------------------------------------------------------------------------------
# Case: one CLI invocation's values, and the entry points


@dataclass
class Case:
    platform: str = "cuda:90"
    installed: str = "all"
    weight_key: str = "kFp8Static128BlockSym"
    activation_key: str = "kFp8Dynamic128Sym"
    moe_backend: str = "auto"
    allow_vllm_cutlass: bool = False
    num_experts: int = 128
    topk: int = 8
    hidden: int = 2048
    intermediate: int = 768
    tp: int = 1
    dp: int = 1
    pcp: int = 1
    sp: int = 1
    enable_ep: bool = False
    all2all: str = "allgather_reducescatter"
    eplb: bool = False
    activation: str = "silu"
    routing: str = "Renormalize"
    logits_dtype: str | None = None
    dtype: str = "bf16"
    lora: bool = False
    bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    swiglu_beta: float | None = None
    env: dict = field(default_factory=dict)
    # resolve-block only
    block: str = "128x128"
    not_serialized: bool = False

    def cli_args(self, sub):
        a = ["--platform", self.platform, "--installed", self.installed]
        if sub in ("select", "support"):
            a += ["--weight-key", self.weight_key, "--activation-key", self.activation_key]
            if self.allow_vllm_cutlass:
                a.append("--allow-vllm-cutlass")
        a += ["--moe-backend", self.moe_backend]
        a += ["--num-experts", str(self.num_experts), "--topk", str(self.topk),
              "--hidden", str(self.hidden), "--intermediate", str(self.intermediate),
              "--tp", str(self.tp), "--dp", str(self.dp), "--pcp", str(self.pcp)]
        if self.enable_ep:
            a.append("--enable-ep")
        a += ["--activation", self.activation]
        if self.lora:
            a.append("--lora")
        if self.bias:
            a.append("--bias")
        if sub in ("select", "support"):
            a += ["--sp", str(self.sp), "--all2all-backend", self.all2all,
                  "--routing-method", self.routing, "--dtype", self.dtype]
            if self.eplb:
                a.append("--enable-eplb")
            if self.logits_dtype:
                a += ["--router-logits-dtype", self.logits_dtype]
            for n, v in (("--swiglu-limit", self.swiglu_limit),
                         ("--swiglu-alpha", self.swiglu_alpha),
                         ("--swiglu-beta", self.swiglu_beta)):
                if v is not None:
                    a += [n, repr(v)]
            a.append("--ignore-environment")
            for k, v in self.env.items():
                a += ["--env", f"{k}={v}"]
        else:
            a += ["--block", self.block, "--activation-key", self.activation_key]
            if self.not_serialized:
                a.append("--not-serialized")
        return a


_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "f16": "fp16",
           "f32": "f32", "fp32": "f32", "float32": "f32"}


def parse_key(s):
    if s == "none":
        return None
    if s.startswith("fp8:"):
        _, kind, gs = s.split(":")
        shape = {"tensor": PER_TENSOR, "token": PER_TOKEN, "channel": PER_CHANNEL}.get(gs)
        if shape is None:
            r, c = gs.split("x")
            shape = GroupShape(int(r), int(c))
        return create_fp8_quant_key(static=(kind == "static"), group_shape=shape)
    return K(s)


def _build_config(c):
    pc = FusedMoEParallelConfig.make(c.tp, c.pcp, c.dp, c.sp, c.enable_ep, c.all2all, c.eplb)
    return FusedMoEConfig(
        num_experts=c.num_experts, experts_per_token=c.topk, hidden_dim=c.hidden,
        intermediate_size=c.intermediate, activation=MoEActivation.from_str(c.activation),
        routing_method=RoutingMethodType[c.routing], moe_parallel_config=pc,
        in_dtype=_DTYPES[c.dtype],
        router_logits_dtype=_DTYPES[c.logits_dtype] if c.logits_dtype else None,
        # KernelConfig.moe_backend's validator normalises with value.lower().replace("-", "_")
        moe_backend=c.moe_backend.lower().replace("-", "_"), has_bias=c.bias, is_lora_enabled=c.lora,
        swiglu_limit=c.swiglu_limit, swiglu_alpha=c.swiglu_alpha, swiglu_beta=c.swiglu_beta)


def _err(e):
    return {"error": e.kind, "message": e.message}


def select(c):
    set_context(Platform(c.platform, c.installed), Envs(c.env))
    try:
        wk, ak = parse_key(c.weight_key), parse_key(c.activation_key)
        config = _build_config(c)
        trace = []
        backend, k_cls, cands, path, fmt = select_fp8_moe_backend(config, wk, ak,
                                                                  c.allow_vllm_cutlass, trace)
    except OracleError as e:
        return _err(e)
    return {
        "backend": backend.value,
        "kernel": k_cls.name if k_cls else None,
        "candidates": cands,
        "trace": [{"backend": b, "kernel": k, "supported": s, "reason": r}
                  for b, k, s, r in trace],
        "path": path,
        "activation_format": fmt.value[0],
        "weight_key": _fmt_key(wk),
        "activation_key": _fmt_key(ak),
    }


def support(c):
    set_context(Platform(c.platform, c.installed), Envs(c.env))
    try:
        wk, ak = parse_key(c.weight_key), parse_key(c.activation_key)
        config = _build_config(c)
        prio = _get_priority_backends(config, wk, ak)
        fmt = (FusedMoEActivationFormat.BatchedExperts
               if config.moe_parallel_config.use_batched_activation_format
               else FusedMoEActivationFormat.Standard)
        verdicts = []
        for b in prio:
            for k_cls in backend_to_kernel_cls(b):
                ok, reason = k_cls.is_supported_config(config, wk, ak, fmt)
                verdicts.append({"backend": b.value, "kernel": k_cls.name, "supported": ok,
                                 "reason": reason})
    except OracleError as e:
        return _err(e)
    return {"priority": [b.value for b in prio], "verdicts": verdicts,
            "activation_format": fmt.value[0]}


def resolve_block(c):
    set_context(Platform(c.platform, c.installed), Envs(c.env))
    try:
        config = _build_config(c)
        bn, bk = (int(x) for x in c.block.split("x"))
        ak = parse_key(c.activation_key)
        shape, refine = resolve_fp8_moe_weight_block_shape(config, [bn, bk], ak,
                                                           not c.not_serialized)
    except OracleError as e:
        return _err(e)
    return {"block_shape": list(shape), "refine": list(refine) if refine else None,
            "intermediate_size_per_partition": config.intermediate_size_per_partition,
            "tp_shard_with_padding": config.tp_shard_with_padding}


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(select(Case(**json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})),
                     indent=2, ensure_ascii=False))
