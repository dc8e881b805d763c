// Which SASS the H200 (sm_90a) gives for the softmax's per-score operations:
// integer and float maxima (ptxas fuses chained 32-bit integer maxima into
// the three-input VIMNMX3; FMNMX has no three-input form on sm_90), INT32 →
// FP32 conversion, and packed exponentials (ex2.approx.f16x2 / bf16x2 are two
// MUFU operations each, no faster than FP32). Build here, disassemble where
// nvdisasm is (benchmarks/NOTES.md, Mosaic section 44):
//   nvcc -arch=sm_90a -cubin benchmarks/isa_probe.cu -o probe.cubin
//   nvdisasm -c probe.cubin   # count opcodes per .text.<kernel>
// Results: benchmarks/data/isa_probe_h200_s31.txt.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
// 32 values a thread, as a softmax row max would see them: a running
// maximum (max() is fmaxf for float).
template <typename T>
__device__ T running_max32(const T* __restrict__ p){
  T v[32];
  #pragma unroll
  for (int i=0;i<32;i++) v[i]=p[threadIdx.x+i*128];
  T m=v[0];
  #pragma unroll
  for (int i=1;i<32;i++) m=max(m,v[i]);
  return m;
}
extern "C" __global__ void imax32(const int* __restrict__ p, int* out){
  out[threadIdx.x]=running_max32(p);
}
extern "C" __global__ void imax32_tree3(const int* __restrict__ p, int* out){
  int v[33];
  #pragma unroll
  for (int i=0;i<32;i++) v[i]=p[threadIdx.x+i*128];
  v[32]=v[0];
  int w[11];
  #pragma unroll
  for (int i=0;i<11;i++) w[i]=__vimax3_s32(v[3*i],v[3*i+1],v[3*i+2]);
  int x0=__vimax3_s32(w[0],w[1],w[2]), x1=__vimax3_s32(w[3],w[4],w[5]), x2=__vimax3_s32(w[6],w[7],w[8]);
  out[threadIdx.x]=__vimax3_s32(__vimax3_s32(x0,x1,x2),w[9],w[10]);
}
extern "C" __global__ void fmax32(const float* __restrict__ p, float* out){
  out[threadIdx.x]=running_max32(p);
}
extern "C" __global__ void i2f32(const int* __restrict__ p, float* out){
  float s=0;
  #pragma unroll
  for (int i=0;i<32;i++) s+= (float)p[threadIdx.x+i*128] * 0.5f;
  out[threadIdx.x]=s;
}
extern "C" __global__ void ex2h2(const unsigned* __restrict__ p, unsigned* out){
  unsigned x=p[threadIdx.x], y;
  asm("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
  unsigned z;
  asm("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(z) : "r"(y));
  out[threadIdx.x]=z;
}
extern "C" __global__ void ex2f(const float* __restrict__ p, float* out){
  float x=p[threadIdx.x], y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  out[threadIdx.x]=y;
}
extern "C" __global__ void cvts(const float* __restrict__ p, unsigned short* out, unsigned* o2){
  float a=p[threadIdx.x], b=p[threadIdx.x+128];
  unsigned h; unsigned short e, e2;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(a), "f"(b));
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(e) : "r"(h));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(e2) : "f"(a), "f"(b));
  out[threadIdx.x]=e; out[threadIdx.x+128]=e2; o2[threadIdx.x]=h;
}
