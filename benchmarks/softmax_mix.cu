// Exponential throughput inside the softmax's instruction mix, with no
// barriers, no tensor cores and no shared memory: is the H=64 loop's ~904
// clocks a warp-step (64 MUFU.EX2 a thread, benchmarks/NOTES.md, Mosaic
// section 46) what its per-score instructions cost on an SM partition, or
// what the kernel's structure adds?
//   nvcc -O3 -arch=sm_90a -o softmax_mix softmax_mix.cu && ./softmax_mix
// Each thread runs 8 independent chains; per score, cumulatively by MIX:
//   0: ex2 alone (the argument is the last result: MUFU and nothing else)
//   1: + the score from an INT32 (I2FP), its logit (FFMA) feeding ex2,
//        and the row sum (FADD)
//   2: + the FP8 pack of each pair of exponentials (F2FP), which feeds
//        the next iteration's INT32 (so nothing is hoisted)
//   3: + an FMUL and an FFMA (an accumulation) and half an integer max
//        (VIMNMX3); ptxas adds the pack's bit moves (LOP3, SHF)
// The instructions a loop iteration (8 exponentials) issues are in the
// SASS (nvdisasm); the ratio to the kernel's is what to compare.
// Prints ex2 results a clock per SM and the clocks one warp-step (64
// exponentials a thread) takes on a partition at that rate (8192 / rate).
#include <cstdio>
#include <cuda_runtime.h>
#define ITERS 1024
template <int MIX>
__global__ void k(float *out, long long *cyc, float factor, float shift) {
  float y[8], sum[8], acc[8];
  unsigned u[8];
  int imax = 0;
  for (int i = 0; i < 8; i++) {
    y[i] = 0.001f * (threadIdx.x + i); sum[i] = 0.f; acc[i] = 1.f;
    u[i] = threadIdx.x * 7 + i;
  }
  __syncthreads();
  long long t0 = clock64();
  for (unsigned it = 0; it < ITERS; it++) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
      float x;
      if (MIX == 0) {
        x = y[i];
      } else {
        float c;
        asm volatile("cvt.rn.f32.s32 %0, %1;" : "=f"(c) : "r"(u[i]));
        x = fmaf(c, factor, -shift);
      }
      asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y[i]) : "f"(x));
      if (MIX >= 1) sum[i] += y[i];
      if (MIX >= 3) {
        acc[i] = fmaf(acc[i], 0.999f, y[i] * 0.5f);
        if (i & 1) imax = __vimax3_s32(imax, (int)u[i], (int)u[i - 1]);
      }
      if (MIX >= 2 && (i & 1)) {
        unsigned short h;
        asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
                     : "=h"(h) : "f"(y[i]), "f"(y[i - 1]));
        u[i] = h ^ it; u[i - 1] = (h >> 3) ^ it;
      } else if (MIX == 1) {
        u[i] += 0x9e3779b9u;  // a fresh INT32 each iteration (one IADD)
      }
    }
  }
  long long t1 = clock64();
  float s = imax;
  for (int i = 0; i < 8; i++) s += y[i] + sum[i] + acc[i] + (float)u[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}
template <int MIX> void run(const char *name, int warps) {
  float *out; long long *cyc; int sms = 132, threads = 32 * warps;
  cudaMalloc(&out, sms * threads * 4); cudaMalloc(&cyc, sms * 8);
  k<MIX><<<sms, threads>>>(out, cyc, 0.01f, 3.f); cudaDeviceSynchronize();
  k<MIX><<<sms, threads>>>(out, cyc, 0.01f, 3.f); cudaDeviceSynchronize();
  long long c[132]; cudaMemcpy(c, cyc, sms * 8, cudaMemcpyDeviceToHost);
  double mx = 0; for (int i = 0; i < sms; i++) mx = c[i] > mx ? c[i] : mx;
  double rate = (double)threads * ITERS * 8 / mx;
  printf("mix %d %-44s %2d warps/SM: %5.2f ex2/clk/SM, %4.0f clk a warp-step (%s)\n",
         MIX, name, warps, rate, 8192.0 / rate,
         cudaGetErrorString(cudaGetLastError()));
  cudaFree(out); cudaFree(cyc);
}
int main() {
  for (int w : {4, 8, 12, 16}) {
    run<0>("ex2 alone", w);
    run<1>("+ I2FP, FFMA, FADD row sum", w);
    run<2>("+ F2FP pack feeding the next INT32", w);
    run<3>("+ FMUL, FFMA, 0.5 VIMNMX3", w);
  }
}
