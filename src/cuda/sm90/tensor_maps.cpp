#include "cuda/sm90/tensor_maps.hpp"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/cuda_api.hpp"
#include "cuda/runtime/check.hpp"
#include "moe_engine/error.hpp"

namespace moe::cuda::sm90 {
namespace {

// cuTensorMapEncodeTiled from the driver, found through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                    cudaEnableDefault, &status),
                   "looking up cuTensorMapEncodeTiled");
    MOE_CHECK(status == cudaDriverEntryPointSuccess && p != nullptr, ErrorCode::kCuda,
              "the CUDA driver does not provide cuTensorMapEncodeTiled (needs a driver for CUDA 12+)");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  return fn;
}

CUtensorMapDataType tma_dtype(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case DType::kFloat16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::kFloat32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    case DType::kFloat8E4M3: return CU_TENSOR_MAP_DATA_TYPE_UINT8;  // TMA moves bytes
    default: throw_error(ErrorCode::kInternal, "tensor map: unsupported dtype ", dtype_name(dtype));
  }
}

CUtensorMap encode(const void* base, DType dtype, uint32_t rank, const cuuint64_t* dims,
                   const cuuint64_t* strides, const cuuint32_t* box) {
  CUtensorMap map{};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode_function()(&map, tma_dtype(dtype), rank, const_cast<void*>(base), dims,
                                       strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                       CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOE_CHECK(r == CUDA_SUCCESS, ErrorCode::kCuda, "cuTensorMapEncodeTiled failed (CUresult ", int(r),
            ") for a rank-", rank, " map at ", base, " with dims [", dims[0], ", ", dims[1], ", ",
            dims[2], "]");
  return map;
}

}  // namespace

CUtensorMap make_tensor_map_3d(const void* base, DType dtype, int64_t groups, int64_t rows,
                               int64_t cols, int64_t row_stride, int64_t group_stride,
                               uint32_t box_cols, uint32_t box_rows) {
  const uint64_t es = dtype_size(dtype);
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(groups)};
  const cuuint64_t strides[2] = {cuuint64_t(row_stride) * es, cuuint64_t(group_stride) * es};
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  return encode(base, dtype, 3, dims, strides, box);
}

CUtensorMap make_ragged_tensor_map(const void* base, DType dtype, int64_t cols, int64_t row_stride,
                                   uint32_t box_cols, uint32_t box_rows) {
  const uint64_t rs = uint64_t(row_stride) * dtype_size(dtype);
  constexpr cuuint64_t kOuter = 0x7fff0000u;
  const cuuint64_t dims[4] = {cuuint64_t(cols), cuuint64_t(1) << 30, kOuter, kOuter};
  const cuuint64_t strides[3] = {rs, rs, (cuuint64_t(1) << 34) - rs};
  const cuuint32_t box[4] = {box_cols, box_rows, 1, 1};
  return encode(base, dtype, 4, dims, strides, box);
}

const CUtensorMap* expert_tensor_maps(int device, Stream stream, const GroupedParam& experts, DType dtype,
                                      int64_t rows, int64_t cols, uint32_t box_cols, uint32_t box_rows) {
  using Key = std::tuple<int, int, int64_t, int64_t, uint32_t, uint32_t, std::vector<uintptr_t>>;
  static std::mutex mutex;
  static std::map<Key, void*> cache;  // device copies of the maps, never freed (see the header)
  std::vector<uintptr_t> addresses;
  for (int64_t g = 0; g < experts.num_groups(); ++g)
    addresses.push_back(reinterpret_cast<uintptr_t>(experts.expert(g).data()));
  Key key{device, int(dtype), rows, cols, box_cols, box_rows, std::move(addresses)};
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return static_cast<const CUtensorMap*>(it->second);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  MOE_CHECK(capture == cudaStreamCaptureStatusNone, ErrorCode::kInvalidArgument,
            "per-expert tensors met for the first time during CUDA graph capture: the Hopper kernel "
            "encodes their TMA maps once, outside capture; run one eager call with the same tensors first");
  std::vector<CUtensorMap> maps;
  for (const uintptr_t a : std::get<6>(key))
    maps.push_back(make_tensor_map_3d(reinterpret_cast<const void*>(a), dtype, 1, rows, cols, cols, rows * cols,
                                      box_cols, box_rows));
  const size_t bytes = maps.size() * sizeof(CUtensorMap);
  const cuda_api::ScopedDevice scoped(device);
  void* d = cuda_api::malloc(bytes, device);
  MOE_CUDA_CHECK(cudaMemcpy(d, maps.data(), bytes, cudaMemcpyHostToDevice), "storing ", maps.size(),
                 " per-expert tensor maps on cuda:", device);
  cache.emplace(std::move(key), d);
  return static_cast<const CUtensorMap*>(d);
}

}  // namespace moe::cuda::sm90
