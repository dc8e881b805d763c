// Throughput of MUFU / conversion instructions on one GPU, in per-thread
// instructions per clock per SM (benchmarks/NOTES.md, Mosaic section 5).
//   nvcc -O3 -arch=sm_90a -o mufu_throughput mufu_throughput.cu && ./mufu_throughput
// Cycles are thread 0's: valid for the MUFU- and convert-bound ops (every
// warp is throttled alike), not for FMA (thread 0's warp finishes early).
// cvt.rn.f32.s32 converts u ^ it (a fresh value each iteration: with a
// loop-invariant operand ptxas hoists it) and adds the result into f, so
// its rows include a LOP3 and an FADD per conversion; the "lop + fadd" row
// is that overhead alone.
#include <cstdio>
#include <cuda_runtime.h>
#define ITERS 2048
template <int OP>
__global__ void k(float *out, long long *cyc) {
  float f[8], g[8]; unsigned u[8];
  for (int i = 0; i < 8; i++) { f[i] = 0.001f * (threadIdx.x + i); g[i] = 0.f; u[i] = threadIdx.x * 7 + i; }
  __syncthreads();
  long long t0 = clock64();
  for (unsigned it = 0; it < ITERS; it++) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
      if (OP == 0) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(f[i]));
      if (OP == 1) asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(u[i]));
      if (OP == 2) asm volatile("{.reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, %0, %1; cvt.u32.u16 %1, h;}" : "+f"(f[i]), "+r"(u[i]));
      if (OP == 3) { float c; asm volatile("cvt.rn.f32.s32 %0, %1;" : "=f"(c) : "r"(u[i] ^ it)); f[i] += c; }
      if (OP == 4) asm volatile("{.reg .b16 h; cvt.rn.satfinite.e4m3x2.f16x2 h, %0; mov.b32 %0, {h, h};}" : "+r"(u[i]));
      if (OP == 5) { asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(f[i]));
                     asm volatile("{.reg .b16 h; cvt.rn.satfinite.e4m3x2.f16x2 h, %0; mov.b32 %0, {h, h};}" : "+r"(u[i])); }
      if (OP == 6) { float c; asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(f[i]));
                     asm volatile("cvt.rn.f32.s32 %0, %1;" : "=f"(c) : "r"(u[i] ^ it)); g[i] += c; }
      if (OP == 7) asm volatile("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(u[i]) : "f"(f[i]));
      if (OP == 8) { asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(f[i]));
                     asm volatile("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(u[i]) : "f"(f[(i+3)&7])); }
      if (OP == 9) asm volatile("fma.rn.f32 %0, %0, %0, %0;" : "+f"(f[i]));
      if (OP == 10) g[i] += __int_as_float((u[i] ^ it) & 0x3fffffff);
    }
  }
  long long t1 = clock64();
  float s = 0; for (int i = 0; i < 8; i++) s += f[i] + g[i] + (float)u[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}
template <int OP> void run(const char *name, int threads) {
  float *out; long long *cyc; int sms = 132;
  cudaMalloc(&out, sms * threads * 4); cudaMalloc(&cyc, sms * 8);
  k<OP><<<sms, threads>>>(out, cyc); cudaDeviceSynchronize();
  k<OP><<<sms, threads>>>(out, cyc); cudaDeviceSynchronize();
  long long c[132]; cudaMemcpy(c, cyc, sms * 8, cudaMemcpyDeviceToHost);
  double mx = 0; for (int i = 0; i < sms; i++) mx = c[i] > mx ? c[i] : mx;
  printf("%-40s threads=%4d  %.1f instr/clk/SM  (%s)\n", name, threads,
         (double)threads * ITERS * 8 / mx, cudaGetErrorString(cudaGetLastError()));
  cudaFree(out); cudaFree(cyc);
}
int main() {
  for (int t : {128, 1024}) {
    run<0>("ex2.approx.f32", t);
    run<1>("ex2.approx.f16x2", t);
    run<2>("cvt e4m3x2.f32 (+cvt.u32.u16)", t);
    run<3>("cvt.rn.f32.s32 (+lop, fadd)", t);
    run<4>("cvt e4m3x2.f16x2 (+mov)", t);
    run<5>("ex2.f32 + cvt e4m3x2.f16x2 (pairs)", t);
    run<6>("ex2.f32 + cvt.f32.s32 (pairs, +lop, fadd)", t);
    run<7>("cvt.rn.f16x2.f32", t);
    run<8>("ex2.f32 + cvt.f16x2.f32 (pairs)", t);
    run<9>("fma.f32", t);
    run<10>("lop + fadd (cvt rows' overhead)", t);
  }
}
