// The Hopper FP8 grouped GEMM kernel on its own (label "gpu"): random E4M3 operands and scales
// written directly (no quantizer involved), each GEMM against the float64 sum of the block-scaled
// products, odd routings, poisoned tails, wgrad's modes. Skips, saying why, off Hopper.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "gpu_support.hpp"
#include "moe_engine/fp8.hpp"

namespace moe::test {
namespace {

// E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f / 0xff are NaN.
double e4m3_value(uint8_t b) {
  const int sign = b >> 7, exponent = (b >> 3) & 15, mantissa = b & 7;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

// Random finite E4M3 bytes of magnitude 2^-4 .. 2^3.
uint8_t random_e4m3(Rng& rng) {
  const int sign = rng.integer(0, 1), exponent = rng.integer(3, 10), mantissa = rng.integer(0, 7);
  return uint8_t(sign << 7 | exponent << 3 | mantissa);
}

struct HostBytes {
  Tensor t;
  explicit HostBytes(Shape shape) : t(Tensor::zeros(shape, DType::kFloat8E4M3)) {}
  uint8_t& at(int64_t i) { return static_cast<uint8_t*>(t.data())[i]; }
  // Every byte's value, for the reference's inner loops.
  std::vector<double> values() {
    std::vector<double> v(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) v[size_t(i)] = e4m3_value(at(i));
    return v;
  }
};

Tensor random_scales(Rng& rng, Shape shape) {
  Tensor s = Tensor::empty(shape, DType::kFloat32);
  for (int64_t i = 0; i < s.numel(); ++i) s.data_as<float>()[i] = float(std::ldexp(rng.uniform(0.5, 1.0), rng.integer(-3, 3)));
  return s;
}

int64_t blocks(int64_t n) { return (n + 127) / 128; }

struct Fp8Case {
  const char* name;
  std::vector<int64_t> splits;
  int64_t capacity, n, k;
};

std::vector<Fp8Case> cases() {
  Rng rng;
  std::vector<int64_t> many = random_splits(rng, 256, 40);
  const int64_t sum_many = std::accumulate(many.begin(), many.end(), int64_t(0));
  return {
      {"odd", {0, 1, 130, 77, 300, 0, 5}, 530, 208, 272},
      {"single_expert", {1000}, 1003, 256, 512},
      {"one_takes_all", {0, 0, 777, 0}, 800, 144, 400},
      {"g256", many, sum_many + 9, 128, 128},
      {"long_k", {600, 900, 3}, 1510, 384, 1040},
      // <= 64 rows a group on average: the bf16 forward and dgrad run on ping-pong tiles
      // (heuristics.hpp; g256 too), here with groups of 2 to 5 row tiles (odd counts: ghosts) and
      // columns off both tile widths.
      {"pingpong_uneven", {0, 300, 1, 0, 65, 2, 0, 0, 129, 0, 0, 3}, 503, 336, 400},
  };
}

// Relative error, two ways: ||got - want|| / ||want|| (norm) and max |got - want| / rms(want)
// (worst), the latter after taking off what rounding the output to `rounding` may cost each element.
struct Error {
  double norm, worst;
};
Error rel_error(const std::vector<double>& want, const std::vector<double>& got, double rounding = 0) {
  double se = 0, de = 0, worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    se += want[i] * want[i];
    de += (got[i] - want[i]) * (got[i] - want[i]);
    worst = std::max(worst, std::abs(got[i] - want[i]) - rounding * std::abs(want[i]));
  }
  if (!(de == de)) return {INFINITY, INFINITY};  // NaN
  const double rms = std::max(std::sqrt(se / double(std::max<size_t>(want.size(), 1))), 1e-30);
  return {std::sqrt(de) / std::max(std::sqrt(se), 1e-30), worst / rms};
}

// The tensor core keeps about 14 bits while it sums a 128-long block of FP8 products (truncating),
// so the kernel's results differ from the exact sum of the same block-scaled products by about
// 2e-4 in norm and up to ~1-2.5% of the output's rms in the worst element (measured on the H200); bf16
// outputs add their own rounding (2^-9 relative, 1.7e-3 in norm).
Error gemm_error(const std::vector<double>& want, const std::vector<double>& got, DType out) {
  return rel_error(want, got, out == DType::kFloat32 ? 0.0 : std::ldexp(1.0, -8));
}
void expect_within_bounds(const Error& e, DType out, const char* what, const char* of = "") {
  std::printf("  [%s, %s] error vs float64%s: norm %.3g, worst / rms %.3g\n", what, dtype_name(out), of, e.norm,
              e.worst);
  EXPECT_LE(e.norm, out == DType::kFloat32 ? 1e-3 : 4e-3) << what;
  EXPECT_LE(e.worst, 3e-2) << what;
}
void expect_close(const std::vector<double>& want, const std::vector<double>& got, DType out, const char* what) {
  expect_within_bounds(gemm_error(want, got, out), out, what);
}

// A wgrad's G products one by one (expert g's dW is want[g * size, (g + 1) * size)): each against
// its own magnitude, since few-token and empty experts would otherwise dilute the rms that the
// worst element is measured against; an empty expert's gradient must be exactly zero.
void expect_close_per_group(const std::vector<double>& want, const std::vector<double>& got, int64_t groups,
                            DType out, const char* what) {
  const size_t size = want.size() / size_t(groups);
  Error most{0, 0};
  for (int64_t g = 0; g < groups; ++g) {
    const std::vector<double> w(want.begin() + g * size, want.begin() + (g + 1) * size),
        o(got.begin() + g * size, got.begin() + (g + 1) * size);
    if (std::all_of(w.begin(), w.end(), [](double v) { return v == 0; })) {
      EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](double v) { return v == 0; }))
          << what << ": expert " << g << " has no tokens, its gradient is not zero";
      continue;
    }
    const Error e = gemm_error(w, o, out);
    most = {std::max(most.norm, e.norm), std::max(most.worst, e.worst)};
  }
  expect_within_bounds(most, out, what, ", the most of any expert");
}

std::vector<double> as_doubles(const Tensor& host, int64_t count) {
  std::vector<double> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i)
    v[size_t(i)] = host.dtype() == DType::kFloat32 ? host.data_as<float>()[i] : double(float(BFloat16::from_bits(host.data_as<uint16_t>()[i])));
  return v;
}


class GpuFp8Gemm : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { MOE_SKIP_WITHOUT_HOPPER(); }
};

// Forward (and dgrad, the same kernel over the transposed copy): y[r, n] = sum_b (sum_k a b) sa sw.
TEST_P(GpuFp8Gemm, RowsTimesWeightMatchFloat64) {
  const DType out_dtype = GetParam();
  for (const Fp8Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Rng rng;
    const int64_t T = c.capacity, N = c.n, K = c.k, G = int64_t(c.splits.size()), S = fp8_scales_pitch(T);
    HostBytes a({T, K}), w({G, N, K});
    for (int64_t i = 0; i < T * K; ++i) a.at(i) = random_e4m3(rng);
    for (int64_t i = 0; i < G * N * K; ++i) w.at(i) = random_e4m3(rng);
    const Tensor sa = random_scales(rng, {blocks(K), S}), sw = random_scales(rng, {G, blocks(N), blocks(K)});
    DualRouting routing(c.splits, T);
    const Tensor a_d = to_gpu(a.t), w_d = to_gpu(w.t), sa_d = to_gpu(sa), sw_d = to_gpu(sw);
    // The float64 sum of the block-scaled products (the same for both forms: dgrad is this kernel
    // over the transposed copy, here the same bytes).
    const std::vector<double> av = a.values(), wv = w.values();
    const int64_t rows = routing.cpu.rows();
    std::vector<double> want(size_t(rows * N));
    int64_t r0 = 0;
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t r = r0; r < r0 + c.splits[size_t(g)]; ++r)
        for (int64_t n = 0; n < N; ++n) {
          double sum = 0;
          for (int64_t b = 0; b < blocks(K); ++b) {
            double part = 0;
            const double* ar = av.data() + r * K;
            const double* wr = wv.data() + (g * N + n) * K;
            for (int64_t k = 128 * b; k < std::min(K, 128 * b + 128); ++k) part += ar[k] * wr[k];
            sum += part * sa.data_as<float>()[b * S + r] * sw.data_as<float>()[(g * blocks(N) + n / 128) * blocks(K) + b];
          }
          want[size_t(r * N + n)] = sum;
        }
      r0 += c.splits[size_t(g)];
    }
    for (const bool dgrad : {false, true}) {
      SCOPED_TRACE(dgrad ? "dgrad" : "forward");
      Tensor y = poisoned_gpu({T, N}, out_dtype);
      Fp8Weight weight;
      (dgrad ? weight.data_t : weight.data) = w_d;
      (dgrad ? weight.scales_t : weight.scales) = sw_d;
      if (dgrad) grouped_linear_dgrad(Fp8Rows{a_d, sa_d}, weight, routing.gpu, y);
      else grouped_linear_forward(Fp8Rows{a_d, sa_d}, weight, routing.gpu, y);
      routing.flag.check();
      const Tensor got = to_host(y);
      expect_close(want, as_doubles(got, rows * N), out_dtype, (std::string(c.name) + (dgrad ? " dgrad" : " forward")).c_str());
      EXPECT_TRUE(tail_untouched(got, rows)) << "rows past sum(splits) were written";
    }
  }
}

// Wgrad over the columns copies: dW_g[n, k] = sum over g's 128-token blocks j of
// (sum_t dy[n, t] x[k, t]) sdy[j, n] sx[j, k]; write, accumulate and empty experts.
TEST_P(GpuFp8Gemm, ColumnsWgradMatchesFloat64) {
  const DType out_dtype = GetParam();
  for (const Fp8Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Rng rng;
    const int64_t N = c.n, K = c.k, G = int64_t(c.splits.size());
    const int64_t C = fp8_columns_capacity(c.capacity, G);
    std::vector<int64_t> col(size_t(G + 1), 0);
    for (int64_t g = 0; g < G; ++g) col[size_t(g + 1)] = col[size_t(g)] + blocks(c.splits[size_t(g)]) * 128;
    HostBytes dy({N, C}), x({K, C});
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = col[size_t(g)]; t < col[size_t(g)] + c.splits[size_t(g)]; ++t) {
        for (int64_t n = 0; n < N; ++n) dy.at(n * C + t) = random_e4m3(rng);
        for (int64_t k = 0; k < K; ++k) x.at(k * C + t) = random_e4m3(rng);
      }
    const Tensor sdy = random_scales(rng, {C / 128, N}), sx = random_scales(rng, {C / 128, K});
    Tensor offsets = Tensor::empty({G + 1}, DType::kInt64);
    std::memcpy(offsets.data(), col.data(), col.size() * 8);
    DualRouting routing(c.splits, c.capacity);
    // The views need owners that outlive them.
    const Tensor dy_d = to_gpu(dy.t), sdy_d = to_gpu(sdy), x_d = to_gpu(x.t), sx_d = to_gpu(sx), offsets_d = to_gpu(offsets);
    const Fp8Columns dy_c{dy_d, sdy_d, offsets_d}, x_c{x_d, sx_d, offsets_d};
    const std::vector<double> dyv = dy.values(), xv = x.values();
    std::vector<double> want(size_t(G * N * K), 0.0);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          double sum = 0;
          for (int64_t t0 = col[size_t(g)]; t0 < col[size_t(g + 1)]; t0 += 128) {
            double part = 0;
            for (int64_t t = t0; t < t0 + 128; ++t) part += dyv[size_t(n * C + t)] * xv[size_t(k * C + t)];
            sum += part * sdy.data_as<float>()[(t0 / 128) * N + n] * sx.data_as<float>()[(t0 / 128) * K + k];
          }
          want[size_t((g * N + n) * K + k)] = sum;
        }
    // Write: every expert's gradient, empty ones zero.
    Tensor dw = poisoned_gpu({G, N, K}, out_dtype);
    grouped_linear_wgrad(dy_c, x_c, routing.gpu, GroupedParam::packed(dw), GradMode::kWrite);
    expect_close_per_group(want, as_doubles(to_host(dw), G * N * K), G, out_dtype,
                           (std::string(c.name) + " wgrad").c_str());
    if (out_dtype != DType::kFloat32) continue;
    // Accumulate: main_grad += dW (empty experts untouched).
    Tensor base = Tensor::empty({G, N, K}, DType::kFloat32);
    for (int64_t i = 0; i < base.numel(); ++i) base.data_as<float>()[i] = float(rng.normal());
    Tensor main_grad = to_gpu(base);
    grouped_linear_wgrad(dy_c, x_c, routing.gpu, GroupedParam::packed(main_grad), GradMode::kAccumulate);
    const Tensor acc = to_host(main_grad);
    std::vector<double> added(want.size());  // what the accumulation added to each element
    for (size_t i = 0; i < added.size(); ++i) added[i] = double(acc.data_as<float>()[i]) - base.data_as<float>()[i];
    expect_close_per_group(want, added, G, DType::kFloat32, (std::string(c.name) + " wgrad accumulate").c_str());
    for (int64_t g = 0; g < G; ++g)
      if (c.splits[size_t(g)] == 0)
        EXPECT_EQ(0, std::memcmp(acc.data_as<float>() + g * N * K, base.data_as<float>() + g * N * K, size_t(N * K) * 4))
            << "empty expert " << g << " changed under accumulate";
    // Per-expert main_grad tensors (one map per expert): bit-identical to the packed result.
    PerExpertCopy per_expert(to_gpu(base));
    grouped_linear_wgrad(dy_c, x_c, routing.gpu, per_expert.param, GradMode::kAccumulate);
    for (int64_t g = 0; g < G; ++g)
      EXPECT_EQ(0, std::memcmp(to_host(per_expert.experts[size_t(g)]).data(), acc.data_as<float>() + g * N * K,
                               size_t(N * K) * 4))
          << c.name << ": per-expert main_grad of expert " << g << " differs from the packed one";
  }
}

INSTANTIATE_TEST_SUITE_P(Out, GpuFp8Gemm, ::testing::Values(DType::kBFloat16, DType::kFloat32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace moe::test
