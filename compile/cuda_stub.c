/*
 * A stand-in for the NVIDIA driver (libcuda.so.1) on machines that have the CUDA toolkit but
 * no GPU. TVM's CUDA runtime library links against the driver; without one it does not load
 * and TVM's codegen falls back to embedding CUDA source, leaving the GPU host to JIT it. With
 * this stub loaded first, the library loads and codegen calls our nvcc callback instead.
 *
 * Compilation never touches a device, so every entry point just reports "no device". Only the
 * symbols libtvm_runtime_cuda.so imports are defined (plus cuInit and cuDriverGetVersion, which
 * a driver is expected to have). Built by cuda_toolchain.py into a private temporary folder and
 * never used when a real driver can be loaded.
 */
#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;

enum { CUDA_ERROR_NO_DEVICE = 100 };

static const char kStubMessage[] = "no CUDA device (qwen35-tvm compile-time stub driver)";

CUresult cuInit(unsigned int flags) {
  (void)flags;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *version) {
  (void)version;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  (void)name;
  (void)len;
  (void)dev;
  return CUDA_ERROR_NO_DEVICE;
}

/* The two message look-ups succeed, so a caller formatting an error gets readable text. */
CUresult cuGetErrorName(CUresult error, const char **str) {
  (void)error;
  if (str != NULL) *str = "CUDA_ERROR_NO_DEVICE";
  return 0;
}

CUresult cuGetErrorString(CUresult error, const char **str) {
  (void)error;
  if (str != NULL) *str = kStubMessage;
  return 0;
}

CUresult cuModuleLoadData(void **module, const void *image) {
  (void)module;
  (void)image;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuModuleUnload(void *module) {
  (void)module;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuModuleGetFunction(void **func, void *module, const char *name) {
  (void)func;
  (void)module;
  (void)name;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuFuncSetAttribute(void *func, int attrib, int value) {
  (void)func;
  (void)attrib;
  (void)value;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuLaunchKernelEx(const void *config, void *func, void **params, void **extra) {
  (void)config;
  (void)func;
  (void)params;
  (void)extra;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuTensorMapEncodeTiled(void *tensor_map, int data_type, unsigned int rank,
                                void *global_address, const void *global_dim,
                                const void *global_strides, const void *box_dim,
                                const void *element_strides, int interleave, int swizzle,
                                int l2_promotion, int oob_fill) {
  (void)tensor_map;
  (void)data_type;
  (void)rank;
  (void)global_address;
  (void)global_dim;
  (void)global_strides;
  (void)box_dim;
  (void)element_strides;
  (void)interleave;
  (void)swizzle;
  (void)l2_promotion;
  (void)oob_fill;
  return CUDA_ERROR_NO_DEVICE;
}
