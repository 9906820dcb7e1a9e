// Reordering the rows of an FC1 tensor between GLU column layouts (checkpoint conversion and the
// GroupedMLP module's load_state_dict).
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "moe_engine/error.hpp"
#include "moe_engine/glu.hpp"

namespace moe::detail {

// The rows of one expert's tensor (dim 0 of [2F, K] or [2F], row-major bytes) reordered from GLU
// layout `from` to `to`. Rows that do not hold F gate/linear pairs in both layouts (an odd count,
// or F not a multiple of a blocks:s size) raise `code`, naming `what`.
inline std::vector<uint8_t> permute_glu_rows(std::span<const uint8_t> bytes, int64_t rows, const GluLayout& from,
                                             const GluLayout& to, ErrorCode code, const std::string& what) {
  std::vector<uint8_t> out(bytes.begin(), bytes.end());
  if (from == to) return out;
  MOE_CHECK(rows % 2 == 0, code, what, ": ", rows, " rows cannot hold GLU gate/linear pairs (odd)");
  const int64_t ffn = rows / 2;
  for (const GluLayout* l : {&from, &to})
    MOE_CHECK(ffn == 0 || ffn % l->block_size(ffn) == 0, code, what, ": F = ", ffn, " gate/linear pairs do not fit GLU layout ",
              l->name());
  if (ffn == 0) return out;
  const size_t row_bytes = bytes.size() / size_t(rows);
  const std::vector<int64_t> perm = glu_row_permutation(from, to, ffn);
  for (size_t i = 0; i < perm.size(); ++i)
    std::memcpy(out.data() + i * row_bytes, bytes.data() + size_t(perm[i]) * row_bytes, row_bytes);
  return out;
}

}  // namespace moe::detail
