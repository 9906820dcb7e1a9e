// TMA tensor maps (CUtensorMap) for the Hopper kernels, encoded on the host from static shapes and
// pointers only (never from the routing), so they can be captured in a CUDA graph as kernel
// parameters. All use 128-byte swizzling: a box is 128 bytes wide.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "moe_engine/device.hpp"
#include "moe_engine/dtype.hpp"
#include "moe_engine/grouped_param.hpp"

namespace moe::cuda::sm90 {

// A [groups, rows, cols] tensor (row stride and group stride in elements), box {box_cols, box_rows,
// 1}.
CUtensorMap make_tensor_map_3d(const void* base, DType dtype, int64_t groups, int64_t rows,
                               int64_t cols, int64_t row_stride, int64_t group_stride,
                               uint32_t box_cols, uint32_t box_rows);

// A "ragged" map over a [T, cols] matrix that reads and writes the rows of one group at a time,
// with the hardware's bounds checks ending at the group's last row: loads past it return zeros,
// stores past it are dropped. Rank 4 with two extra outer dimensions:
//   dims    {cols, 2^30, 2^31 - 2^16, 2^31 - 2^16}
//   strides {row_stride, row_stride, 2^34 - row_stride} (bytes)
// Element (row r of a group starting at `begin` with `rows` rows, col c) is addressed by the
// coordinates {c, 2^30 - rows + r, begin + rows, 2^30}: the address wraps around 2^64 to
// base + (begin + r) * row_stride, and the second coordinate leaves the 2^30 bound exactly at
// r = rows. (The construction of Triton's and QuACK's ragged TMA descriptors.)
CUtensorMap make_ragged_tensor_map(const void* base, DType dtype, int64_t cols, int64_t row_stride,
                                   uint32_t box_cols, uint32_t box_rows);

// Per-expert operands (GroupedParam::per_expert, contiguous [rows, cols] experts): one map per
// expert, in device memory, for the kernel to pick by group (coordinate 0 in the group dimension).
// Encoded on the host from the experts' addresses and cached by them (with dtype, shape and box),
// so later calls and CUDA-graph replays with the same tensors read the same device copy; cache
// entries live as long as the process (G x 128 bytes each). A set first met while `stream` is
// being captured is a clear error: one eager call with the same tensors must come first.
const CUtensorMap* expert_tensor_maps(int device, Stream stream, const GroupedParam& experts, DType dtype,
                                      int64_t rows, int64_t cols, uint32_t box_cols, uint32_t box_rows);

}  // namespace moe::cuda::sm90
