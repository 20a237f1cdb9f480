"""The one arch test our CUDA kernels make: a device function every translation unit defines
(compile/cuda_toolchain.py prepends SM90A_PRELUDE; no TVM import here, so the toolchain loads
before TVM does). It is true where nvcc compiles for sm_90a, the one arch with wgmma, so a
kernel may branch on it at no cost (nvcc folds it) and carry an sm_90a path beside its sm_80
one."""

SM90A_FN = "qwen35_sm90a"
SM90A_PRELUDE = f"""
__device__ __forceinline__ bool {SM90A_FN}() {{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  return true;
#else
  return false;
#endif
}}
"""
