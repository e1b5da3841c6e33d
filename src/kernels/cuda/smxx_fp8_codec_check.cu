// Device-side conversions for the codec tests: cuda_fp8.h's own e4m3 decode/encode and bf16
// rounding next to the conversions the kernels use (cvt.rn.satfinite.e4m3x2, __float2bfloat16_rn),
// so a host test can check both against the CPU codecs bit for bit.
#include "cuda_common.cuh"
#include "fused_moe_cuda.hpp"

namespace fp8moe::cuda {

namespace {

__global__ void codec_kernel(const float* __restrict__ in, int n, float* __restrict__ decoded,
                             uint8_t* __restrict__ enc_cudafp8, uint8_t* __restrict__ enc_kernel,
                             uint16_t* __restrict__ bf16_cudafp8,
                             uint16_t* __restrict__ bf16_kernel) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 256) {
    __nv_fp8_e4m3 v;
    v.__x = static_cast<__nv_fp8_storage_t>(i);
    decoded[i] = static_cast<float>(v);
  }
  if (i < n) {
    const float f = in[i];
    enc_cudafp8[i] = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
    enc_kernel[i] = float_to_e4m3(f);
    bf16_cudafp8[i] = __bfloat16_as_ushort(__float2bfloat16(f));
    bf16_kernel[i] = float_to_bf16_bits(f);
  }
}

}  // namespace

void device_codec_check(const float* in_host, int n, float* decoded256, uint8_t* enc_cudafp8,
                        uint8_t* enc_kernel, uint16_t* bf16_cudafp8, uint16_t* bf16_kernel) {
  float *d_in = nullptr, *d_dec = nullptr;
  uint8_t *d_e1 = nullptr, *d_e2 = nullptr;
  uint16_t *d_b1 = nullptr, *d_b2 = nullptr;
  const size_t nn = static_cast<size_t>(n);
  FP8MOE_CUDA_CHECK(cudaMalloc(&d_in, nn * 4 + 4));
  FP8MOE_CUDA_CHECK(cudaMalloc(&d_dec, 256 * 4));
  FP8MOE_CUDA_CHECK(cudaMalloc(&d_e1, nn + 1));
  FP8MOE_CUDA_CHECK(cudaMalloc(&d_e2, nn + 1));
  FP8MOE_CUDA_CHECK(cudaMalloc(&d_b1, nn * 2 + 2));
  FP8MOE_CUDA_CHECK(cudaMalloc(&d_b2, nn * 2 + 2));
  FP8MOE_CUDA_CHECK(cudaMemcpy(d_in, in_host, nn * 4, cudaMemcpyHostToDevice));
  const int threads = 256;
  const int blocks = static_cast<int>((std::max(n, 256) + threads - 1) / threads);
  codec_kernel<<<blocks, threads>>>(d_in, n, d_dec, d_e1, d_e2, d_b1, d_b2);
  FP8MOE_CUDA_CHECK_LAUNCH();
  FP8MOE_CUDA_CHECK(cudaMemcpy(decoded256, d_dec, 256 * 4, cudaMemcpyDeviceToHost));
  FP8MOE_CUDA_CHECK(cudaMemcpy(enc_cudafp8, d_e1, nn, cudaMemcpyDeviceToHost));
  FP8MOE_CUDA_CHECK(cudaMemcpy(enc_kernel, d_e2, nn, cudaMemcpyDeviceToHost));
  FP8MOE_CUDA_CHECK(cudaMemcpy(bf16_cudafp8, d_b1, nn * 2, cudaMemcpyDeviceToHost));
  FP8MOE_CUDA_CHECK(cudaMemcpy(bf16_kernel, d_b2, nn * 2, cudaMemcpyDeviceToHost));
  cudaFree(d_in);
  cudaFree(d_dec);
  cudaFree(d_e1);
  cudaFree(d_e2);
  cudaFree(d_b1);
  cudaFree(d_b2);
}

}  // namespace fp8moe::cuda
