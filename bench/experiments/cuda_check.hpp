// CK(call): the experiments' standalone programs stop with the CUDA error's name and place.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(call)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)
