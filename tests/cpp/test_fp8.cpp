// FP8 block scaling on the CPU backend: the E4M3 conversion of every float against a reference
// built from the format's definition; the quantizers against the rule of fp8.hpp, written here
// again in float64 (zero, denormal-scale, pow2, epsilon, non-finite and saturating tiles, K off a
// multiple of 128); the layouts (column offsets, zero padding, nothing written past the routed rows
// and columns); the dequantizer against q * s (round trips, every code and kind of scale, NaN
// tiles, strided and ragged rows, poison past the routed rows); the GEMMs against the float64
// oracle of the dequantized operands and against the 16-bit GEMM of the original inputs; and every
// validation error.
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "common/fp8_math.hpp"
#include "fp8_support.hpp"
#include "oracle/fp8_oracle.hpp"

namespace moe::test {
namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// ---- the E4M3 conversion ----

TEST(Fp8Math, DecodeMatchesTheFormatForEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const double want = oracle::e4m3_value(uint8_t(c));
    const float got = detail::e4m3_to_float(uint8_t(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(double(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
    }
  }
}

TEST(Fp8Math, EncodeTiesSubnormalsSaturationAndNan) {
  const float sub = std::ldexp(1.f, -9);  // the E4M3 subnormal step
  const struct {
    float v;
    uint8_t code;
  } cases[] = {
      {0.f, 0x00},          {-0.f, 0x80},        {1.f, 0x38},           {-1.f, 0xb8},
      {1.0625f, 0x38},      // tie 1 | 1.125: the even code
      {1.1875f, 0x3a},      // tie 1.125 | 1.25: the even code
      {-1.1875f, 0xba},     {sub, 0x01},         {sub / 2, 0x00},       // tie 0 | 2^-9: 0
      {std::nextafter(sub / 2, 1.f), 0x01},      {1.5f * sub, 0x02},    // tie 1 | 2 (x 2^-9): 2
      {2.5f * sub, 0x02},   {3.5f * sub, 0x04},  {6.5f * sub, 0x06},
      {7.5f * sub, 0x08},   // tie 7 x 2^-9 | 2^-6 (the smallest normal, code 8): 8
      {std::ldexp(1.f, -6), 0x08},               {std::ldexp(1.f, -7), 0x04},
      {1e-30f, 0x00},       {-1e-30f, 0x80},     {1e-40f, 0x00},        // a float denormal
      {424.f, 0x7d},        {432.f, 0x7e},       // tie 416 | 448: the even 448
      {447.f, 0x7e},        {448.f, 0x7e},       {-448.f, 0xfe},        {449.f, 0x7e},
      {464.f, 0x7e},        {465.f, 0x7e},       {480.f, 0x7e},         {1e30f, 0x7e},
      {kInf, 0x7e},         {-kInf, 0xfe},       {kNan, 0x7f},          {-kNan, 0x7f},
  };
  for (const auto& c : cases)
    EXPECT_EQ(int(detail::e4m3_from_float(c.v)), int(c.code)) << "E4M3(" << c.v << ")";
}

// Every float: the code must be the nearest E4M3 value with ties to the even code, saturated at 448.
// The reference walks the floats in increasing order against the 126 decision points, each the
// midpoint of two neighbouring E4M3 magnitudes (the oracle's table), which belongs to the even code.
TEST(Fp8Math, EncodeEveryFloatAsTheNearestEven) {
  std::array<uint32_t, 127> first{};  // first[c]: the smallest non-negative float encoded as c
  for (int c = 1; c < 127; ++c) {
    const double mid = (oracle::e4m3_value(uint8_t(c - 1)) + oracle::e4m3_value(uint8_t(c))) / 2;
    ASSERT_EQ(double(float(mid)), mid);  // a few significant bits: exact in float
    first[size_t(c)] = bits_of(float(mid)) + (c % 2 == 1 ? 1u : 0u);
  }
  int code = 0;
  int64_t wrong = 0;
  uint32_t first_wrong = 0;
  for (uint32_t a = 0;; ++a) {
    while (code < 126 && a >= first[size_t(code + 1)]) ++code;
    const bool nan = a > 0x7f800000u;
    const uint8_t want = nan ? 0x7f : uint8_t(code), want_negative = nan ? 0x7f : uint8_t(code | 0x80);
    if (detail::e4m3_from_float(float_of(a)) != want || detail::e4m3_from_float(float_of(a | 0x80000000u)) != want_negative)
      if (wrong++ == 0) first_wrong = a;
    if (a == 0x7fffffffu) break;
  }
  EXPECT_EQ(wrong, 0) << "first wrong float: bits 0x" << std::hex << first_wrong << " = " << float_of(first_wrong);
}

// ---- the tile's multiplier and scale ----

TEST(Fp8Math, TileMultiplierAndScaleSpecialAmaxes) {
  const auto tile = [](float amax, bool pow2 = false, float eps = 0.f) {
    return detail::fp8_tile_scale(bits_of(amax), pow2, eps);
  };
  const float big = std::numeric_limits<float>::max(), tiny = std::numeric_limits<float>::denorm_min();
  for (bool pow2 : {false, true}) {
    SCOPED_TRACE(pow2 ? "pow2" : "plain");
    EXPECT_EQ(tile(0.f, pow2).multiplier, 1.f);
    EXPECT_EQ(tile(0.f, pow2).scale, 1.f);
    EXPECT_EQ(tile(448.f, pow2).multiplier, 1.f);
    EXPECT_EQ(tile(448.f, pow2).scale, 1.f);
    for (float bad : {kInf, kNan}) {
      EXPECT_TRUE(std::isnan(tile(bad, pow2).multiplier) && std::isnan(tile(bad, pow2).scale)) << bad;
      EXPECT_TRUE(std::isnan(tile(bad, pow2, 1.f).scale)) << "epsilon does not hide " << bad;
    }
    // 448 / amax overflows (or exceeds 2^126) for tiny amaxes: the multiplier stops at 2^126.
    for (float a : {tiny, 1e-40f, std::numeric_limits<float>::min(), 1e-37f}) {
      EXPECT_EQ(tile(a, pow2).multiplier, std::ldexp(1.f, 126)) << a;
      EXPECT_EQ(tile(a, pow2).scale, std::ldexp(1.f, -126)) << a;
    }
    // The largest amax: the smallest multiplier, still normal; its scale finite.
    EXPECT_TRUE(std::isnormal(tile(big, pow2).multiplier));
    EXPECT_TRUE(std::isfinite(tile(big, pow2).scale));
  }
  EXPECT_EQ(tile(big).multiplier, 448.f / big);
  EXPECT_EQ(tile(big, true).multiplier, std::ldexp(1.f, -120));  // 448 / FLT_MAX = 1.3e-36: 2^-120 below
  EXPECT_EQ(tile(big, true).scale, std::ldexp(1.f, 120));
  EXPECT_EQ(tile(3.f).multiplier, 448.f / 3.f);
  EXPECT_EQ(tile(3.f).scale, 1.f / (448.f / 3.f));
  EXPECT_EQ(tile(3.f, true).multiplier, 128.f);  // 149.3 rounded down
  EXPECT_EQ(tile(3.f, true).scale, 0.0078125f);
  EXPECT_EQ(tile(0.f, false, 2.f).multiplier, 224.f);  // epsilon raises the amax
  EXPECT_EQ(tile(1.f, false, 2.f).multiplier, 224.f);
  EXPECT_EQ(tile(5.f, false, 2.f).multiplier, 448.f / 5.f);
}

// Over amaxes of every exponent (normals and denormals, a few mantissas each): the multiplier is
// the float 448 / amax clamped to 2^126, the pow2 one the power of two at or below it, and the
// scale its IEEE reciprocal: normal, never above 2^126 in the multiplier's place.
TEST(Fp8Math, TileMultiplierAndScaleOverEveryExponent) {
  int64_t checked = 0;
  for (uint32_t e = 0; e < 255; ++e)
    for (uint32_t mantissa : {0u, 1u, 0x2aaaabu, 0x400000u, 0x7fffffu}) {
      const uint32_t bits = e << 23 | mantissa;
      if (bits == 0) continue;
      const float amax = float_of(bits);
      const detail::Fp8TileScale plain = detail::fp8_tile_scale(bits, false, 0.f);
      const detail::Fp8TileScale pow2 = detail::fp8_tile_scale(bits, true, 0.f);
      const float want = std::min(448.f / amax, std::ldexp(1.f, 126));
      ASSERT_EQ(bits_of(plain.multiplier), bits_of(want)) << "amax " << amax;
      ASSERT_EQ(bits_of(plain.scale), bits_of(1.f / want)) << "amax " << amax;
      ASSERT_TRUE(std::isnormal(plain.scale) && std::isnormal(plain.multiplier)) << "amax " << amax;
      ASSERT_EQ(bits_of(pow2.multiplier) & 0x7fffffu, 0u) << "amax " << amax;
      ASSERT_TRUE(pow2.multiplier <= want && 2 * pow2.multiplier > want) << "amax " << amax;
      ASSERT_EQ(pow2.scale * pow2.multiplier, 1.f) << "amax " << amax;  // an exact power of two
      ++checked;
    }
  EXPECT_EQ(checked, 255 * 5 - 1);
}

// ---- the quantization rule, written again from fp8.hpp's text ----

struct Rule {
  Fp8Recipe recipe;

  // What a tile quantizes with: q = E4M3(v * multiplier), dequantized as q * scale.
  struct Tile {
    float multiplier, scale;
  };

  Tile of(const std::vector<float>& tile) const {
    double amax = 0;
    for (float v : tile) {
      if (!std::isfinite(v)) return {kNan, kNan};
      amax = std::max(amax, std::fabs(double(v)));
    }
    amax = std::max(amax, double(recipe.amax_epsilon));
    if (amax == 0) return {1.f, 1.f};
    // A float quotient: the division rounded to double, then to float, equals the float division.
    // Clamped to 2^126 before the rounding (the same float: rounding is monotone, 2^126 exact).
    double m = float(std::min(448.0 / amax, std::ldexp(1.0, 126)));
    if (recipe.pow2_scales) {
      int e = 0;
      std::frexp(m, &e);  // m = f 2^e, f in [0.5, 1)
      m = std::ldexp(1.0, e - 1);
    }
    return {float(m), float(1.0 / m)};
  }
  // The float product (exact in double, rounded once), then the nearest E4M3.
  static uint8_t quantize(float v, float multiplier) {
    return std::isnan(multiplier) ? uint8_t(0x7f)
                                  : oracle::e4m3_nearest(double(float(double(v) * double(multiplier))));
  }
};

bool same_scale(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }

// x's values as floats (exact for every input dtype), row-major.
std::vector<float> values_of(const TensorView& x) {
  const oracle::Matrix m = oracle::to_matrix(x);
  return std::vector<float>(m.data.begin(), m.data.end());
}

uint8_t byte_at(const Tensor& t, int64_t i) { return t.data_as<uint8_t>()[i]; }
float float_at(const Tensor& t, int64_t i) { return t.data_as<float>()[i]; }
bool is_poison(const Tensor& t, int64_t element) {
  const auto* p = static_cast<const uint8_t*>(t.data()) + element * int64_t(t.view().element_size());
  for (size_t b = 0; b < t.view().element_size(); ++b)
    if (p[b] != kPoison) return false;
  return true;
}

// Counts mismatches and keeps the first few as text: a failing layout check prints a handful of
// lines, not a million.
struct Mismatches {
  int64_t count = 0;
  std::string first;
  template <class... Parts>
  void add(Parts&&... parts) {
    if (count++ < 5) first += detail::str_cat(std::forward<Parts>(parts)...) + "\n";
  }
};
#define EXPECT_NO_MISMATCH(m) EXPECT_EQ((m).count, 0) << (m).first

std::vector<int64_t> expected_column_offsets(const std::vector<int64_t>& splits) {
  std::vector<int64_t> first{0};
  for (int64_t s : splits) first.push_back(first.back() + (s + 127) / 128 * 128);
  return first;
}

// The rows of x against the rule, and the untouched bytes past the routed rows and the pitch.
void expect_rows_follow_rule(const TensorView& x, const Routing& r, const OwnedRows& rows, const Rule& rule) {
  const int64_t K = x.size(1), T = x.size(0), pitch = rows.scales.size(1);
  const std::vector<float> v = values_of(x);
  Mismatches m;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k0 = 0; k0 < K; k0 += 128) {
      const int64_t b = k0 / 128, n = std::min<int64_t>(128, K - k0);
      const float got_s = float_at(rows.scales, b * pitch + t);
      if (t >= r.rows()) {
        if (!is_poison(rows.scales, b * pitch + t)) m.add("scale of unrouted row ", t, " written");
        for (int64_t k = k0; k < k0 + n; ++k)
          if (byte_at(rows.data, t * K + k) != kPoison) m.add("byte of unrouted row ", t, " written");
        continue;
      }
      const std::vector<float> tile(v.begin() + t * K + k0, v.begin() + t * K + k0 + n);
      const Rule::Tile s = rule.of(tile);
      if (!same_scale(got_s, s.scale)) m.add("row ", t, " block ", b, ": scale ", got_s, ", expected ", s.scale);
      for (int64_t k = k0; k < k0 + n; ++k)
        if (byte_at(rows.data, t * K + k) != Rule::quantize(v[size_t(t * K + k)], s.multiplier))
          m.add("row ", t, " feature ", k, ": byte ", int(byte_at(rows.data, t * K + k)), ", expected ",
                int(Rule::quantize(v[size_t(t * K + k)], s.multiplier)));
    }
  for (int64_t b = 0; b < blocks_of(K); ++b)
    for (int64_t t = T; t < pitch; ++t)
      if (!is_poison(rows.scales, b * pitch + t)) m.add("scale pitch entry ", t, " written");
  EXPECT_NO_MISMATCH(m);
}

// The columns of x against the rule: offsets, scales, bytes, zero padding, untouched columns past
// the last expert.
void expect_columns_follow_rule(const TensorView& x, const Routing& r, const OwnedColumns& cols, const Rule& rule) {
  const int64_t K = x.size(1), C = cols.data.size(1);
  const std::vector<float> v = values_of(x);
  const std::vector<int64_t> first = expected_column_offsets(r.splits);
  for (size_t g = 0; g < first.size(); ++g)
    EXPECT_EQ(cols.offsets.data_as<int64_t>()[g], first[g]) << "columns.offsets[" << g << "]";
  Mismatches m;
  int64_t row = 0;
  for (size_t g = 0; g < r.splits.size(); ++g) {
    const int64_t count = r.splits[g];
    for (int64_t j = 0; j < count; j += 128) {
      const int64_t n = std::min<int64_t>(128, count - j), c0 = first[g] + j;
      for (int64_t k = 0; k < K; ++k) {
        std::vector<float> tile;
        for (int64_t i = 0; i < n; ++i) tile.push_back(v[size_t((row + j + i) * K + k)]);
        const Rule::Tile s = rule.of(tile);
        const float got_s = float_at(cols.scales, c0 / 128 * K + k);
        if (!same_scale(got_s, s.scale))
          m.add("expert ", g, " block ", j / 128, " feature ", k, ": scale ", got_s, ", expected ", s.scale);
        for (int64_t i = 0; i < 128; ++i) {
          const uint8_t want = i < n ? Rule::quantize(tile[size_t(i)], s.multiplier) : uint8_t(0);
          if (byte_at(cols.data, k * C + c0 + i) != want)
            m.add("expert ", g, " token ", j + i, " feature ", k, ": byte ", int(byte_at(cols.data, k * C + c0 + i)),
                  ", expected ", int(want), i < n ? "" : " (padding)");
        }
      }
    }
    row += count;
  }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t c = first.back(); c < C; ++c)
      if (byte_at(cols.data, k * C + c) != kPoison) m.add("column ", c, " past the last expert written");
  for (int64_t i = first.back() / 128 * K; i < cols.scales.numel(); ++i)
    if (!is_poison(cols.scales, i)) m.add("scale of column block ", i / K, " past the last expert written");
  EXPECT_NO_MISMATCH(m);
}

// A [T, K] tensor whose rows and features span many magnitudes (1e-6 .. 1e3) and some zero rows,
// so that tiles get very different scales, some below an epsilon.
Tensor spread_tensor(int64_t T, int64_t K, DType dtype, Rng& rng) {
  Tensor t = Tensor::empty({T, K}, dtype);
  oracle::Vector v(size_t(T * K));
  for (int64_t r = 0; r < T; ++r) {
    const double row_scale = r % 11 == 3 ? 0.0 : std::pow(10.0, rng.uniform(-6, 3));
    for (int64_t k = 0; k < K; ++k)
      v[size_t(r * K + k)] = rng.normal(row_scale) * (k % 37 == 5 ? 30.0 : 1.0);
  }
  oracle::assign(t, v);
  return t;
}

struct QuantCase {
  const char* name;
  std::vector<int64_t> splits;
  int64_t capacity, k;
};

// Empty and 1-row experts, one expert with every token, exact multiples of 128, G = 1 and G = 256,
// capacity > sum(splits), K a multiple of 16 but not of 128.
std::vector<QuantCase> quant_cases() {
  Rng rng;
  std::vector<int64_t> many = random_splits(rng, 256, 4);
  const int64_t many_rows = std::accumulate(many.begin(), many.end(), int64_t(0));
  return {
      {"single_expert", {50}, 64, 144},
      {"empty_and_one_row", {0, 1, 37, 0}, 40, 32},
      {"one_expert_takes_all", {0, 0, 300, 0, 0}, 310, 160},
      {"off_tile_sizes", {129, 3, 200}, 400, 272},
      {"exact_blocks", {128, 256}, 384, 128},
      {"g256", many, many_rows + 7, 16},
  };
}

const Fp8Recipe kRecipes[] = {{}, {true, 0.f}, {false, 1e-4f}};
const char* recipe_name(const Fp8Recipe& r) {
  return r.pow2_scales ? "pow2" : r.amax_epsilon > 0 ? "epsilon 1e-4" : "default";
}

class QuantizeFp8 : public ::testing::TestWithParam<DType> {};

TEST_P(QuantizeFp8, RowsAndColumnsFollowTheRuleOnOddRoutings) {
  const DType dt = GetParam();
  Rng rng;
  for (const QuantCase& c : quant_cases())
    for (const Fp8Recipe& recipe : kRecipes) {
      SCOPED_TRACE(std::string(c.name) + ", " + recipe_name(recipe));
      Routing r(c.splits, c.capacity);
      const int64_t T = c.capacity, G = r.num_groups();
      Tensor x = spread_tensor(T, c.k, dt, rng);
      OwnedRows rows(T, c.k);
      OwnedColumns cols(T, G, c.k);
      quantize_fp8(x, r.layout, rows.view(), cols.view(), recipe);
      expect_rows_follow_rule(x, r, rows, Rule{recipe});
      expect_columns_follow_rule(x, r, cols, Rule{recipe});
      // Rows only and columns only give the same bytes as both at once.
      OwnedRows rows_only(T, c.k);
      OwnedColumns cols_only(T, G, c.k);
      quantize_fp8(x, r.layout, rows_only.view(), {}, recipe);
      quantize_fp8(x, r.layout, {}, cols_only.view(), recipe);
      EXPECT_TRUE(bitwise_equal(rows_only.data, rows.data) && bitwise_equal(rows_only.scales, rows.scales));
      EXPECT_TRUE(bitwise_equal(cols_only.data, cols.data) && bitwise_equal(cols_only.scales, cols.scales) &&
                  bitwise_equal(cols_only.offsets, cols.offsets));
    }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizeFp8, ::testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Tiles the rule treats specially, each checked against the rule and against the value it must have.
TEST(QuantizeFp8Rule, ZeroDenormalNonFiniteSaturatingPow2AndEpsilonTiles) {
  const int64_t T = 260, K = 256;
  Routing r({130, 126}, T);  // expert 0's second column block holds 2 tokens and 126 padding columns
  Tensor x = Tensor::zeros({T, K}, DType::kFloat32);
  float* v = x.data_as<float>();
  Rng rng;
  for (int64_t i = 0; i < T * K; ++i) v[i] = float(rng.normal());
  auto row = [&](int64_t t, int64_t block) { return v + t * K + block * 128; };
  for (int k = 0; k < 128; ++k) {
    row(0, 0)[k] = 0.f;                                           // all zero
    row(1, 0)[k] = (k % 3 - 1) * 1e-40f;                          // float denormals
    row(2, 0)[k] = (k % 5) * 1e-37f;                              // amax / 448 below 2^-126
    row(6, 0)[k] = float(k) / 127.f * 3.f;                        // amax 3: pow2 scale 2^-7
    row(7, 0)[k] = float(k) * 1e-8f;                              // amax 1.27e-6, below epsilon 1e-3
    row(8, 0)[k] = k == 9 ? -1000.f : float(k);                   // saturation at the amax
  }
  row(3, 1)[17] = kInf;   // row 3's second block: infinity
  row(4, 1)[100] = -kNan;  // row 4's second block: NaN
  v[129 * K + 7] = kNan;   // feature 7 of expert 0's second column block (token 129)
  for (const Fp8Recipe& recipe : {Fp8Recipe{}, Fp8Recipe{true, 0.f}, Fp8Recipe{false, 1e-3f}}) {
    SCOPED_TRACE(recipe_name(recipe));
    OwnedRows rows(T, K);
    OwnedColumns cols(T, 2, K);
    quantize_fp8(x, r.layout, rows.view(), cols.view(), recipe);
    expect_rows_follow_rule(x, r, rows, Rule{recipe});
    expect_columns_follow_rule(x, r, cols, Rule{recipe});
    const int64_t pitch = rows.scales.size(1);
    auto row_scale = [&](int64_t t, int64_t b) { return float_at(rows.scales, b * pitch + t); };
    const bool eps = recipe.amax_epsilon > 0;
    // The scale of amax a: 1 / (448 / a), two float divisions (448 / a is 448000-ish for epsilon).
    const auto scale_of = [](float a) { return 1.f / (448.f / a); };
    const float eps_scale = scale_of(1e-3f);
    EXPECT_EQ(row_scale(0, 0), eps ? eps_scale : 1.f) << "zero tile";
    for (int k = 0; k < 128; ++k) EXPECT_EQ(byte_at(rows.data, 0 * K + k) & 0x7f, 0) << "zero tile";
    // 448 / 1e-40 overflows: the multiplier stops at 2^126, the scale at 2^-126.
    EXPECT_EQ(row_scale(1, 0), eps ? eps_scale : std::numeric_limits<float>::min()) << "denormal tile";
    EXPECT_EQ(byte_at(rows.data, 1 * K + 2), eps ? 0 : 0x04) << "1e-40 x 2^126 = 0.0085 ~ 4 x 2^-9";
    EXPECT_EQ(row_scale(2, 0), eps ? eps_scale : std::numeric_limits<float>::min()) << "multiplier ceiling";
    EXPECT_TRUE(std::isnan(row_scale(3, 1)) && std::isnan(row_scale(4, 1))) << "non-finite tiles";
    EXPECT_FALSE(std::isnan(row_scale(3, 0)) || std::isnan(row_scale(4, 0))) << "their neighbours";
    for (int64_t t : {3, 4})
      for (int k = 128; k < 256; ++k) EXPECT_EQ(byte_at(rows.data, t * K + k), 0x7f) << "row " << t;
    // pow2: 448 / 3 = 149.3 rounded down to 128, the scale 2^-7 exact.
    EXPECT_EQ(row_scale(6, 0), recipe.pow2_scales ? 0.0078125f : scale_of(3.f)) << "amax 3";
    if (recipe.pow2_scales) EXPECT_EQ(byte_at(rows.data, 6 * K + 127), 0x7c) << "3 x 128 = 384: code 0x7c";
    if (!recipe.pow2_scales) {
      EXPECT_EQ(row_scale(7, 0), eps ? eps_scale : scale_of(127.f * 1e-8f)) << "epsilon";
      EXPECT_EQ(byte_at(rows.data, 8 * K + 9), 0xfe) << "the amax saturates to -448";
    }
    // The NaN column block: NaN scale, 0x7f for both tokens, zero padding.
    EXPECT_TRUE(std::isnan(float_at(cols.scales, 1 * K + 7)));
    const int64_t C = cols.data.size(1);
    EXPECT_EQ(byte_at(cols.data, 7 * C + 128), 0x7f);
    EXPECT_EQ(byte_at(cols.data, 7 * C + 129), 0x7f);
    for (int64_t c = 130; c < 256; ++c) ASSERT_EQ(byte_at(cols.data, 7 * C + c), 0) << "padding column " << c;
  }
}

// A scale pitch larger than T: the quantizer writes entries [0, offsets[G]) of each block row only.
TEST(QuantizeFp8Rule, WiderPitchAndStridedInput) {
  Rng rng;
  Routing r({5, 20, 0, 9}, 40);
  Tensor wide = random_tensor({40, 80}, DType::kBFloat16, rng);
  const TensorView x(wide.data(), {40, 48}, {80, 1}, DType::kBFloat16, Device::cpu());
  OwnedRows rows(40, 48, Device::cpu(), 64);
  quantize_fp8(x, r.layout, rows.view(), {});
  expect_rows_follow_rule(x, r, rows, Rule{});
}

TEST(QuantizeFp8Weight, BlocksAndTransposeFollowTheRule) {
  Rng rng;
  const int64_t G = 3, N = 144, K = 272;
  for (DType dt : {DType::kBFloat16, DType::kFloat32})
    for (const Fp8Recipe& recipe : kRecipes)
      for (bool per_expert : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + ", " + recipe_name(recipe) + (per_expert ? ", per-expert" : ", packed"));
        Tensor w = spread_tensor(G * N, K, dt, rng);
        Tensor w3 = Tensor::empty({G, N, K}, dt);
        std::memcpy(w3.data(), w.data(), w.nbytes());
        OwnedParam param(w3, per_expert);
        OwnedWeight out(G, N, K);
        quantize_fp8_weight(param.param, out.view(), recipe);
        const std::vector<float> v = values_of(w);
        Mismatches m;
        const Rule rule{recipe};
        for (int64_t g = 0; g < G; ++g)
          for (int64_t n0 = 0; n0 < N; n0 += 128)
            for (int64_t k0 = 0; k0 < K; k0 += 128) {
              std::vector<float> tile;
              for (int64_t n = n0; n < std::min(N, n0 + 128); ++n)
                for (int64_t k = k0; k < std::min(K, k0 + 128); ++k) tile.push_back(v[size_t((g * N + n) * K + k)]);
              const Rule::Tile s = rule.of(tile);
              const float got = float_at(out.scales, (g * blocks_of(N) + n0 / 128) * blocks_of(K) + k0 / 128);
              const float got_t = float_at(out.scales_t, (g * blocks_of(K) + k0 / 128) * blocks_of(N) + n0 / 128);
              if (!same_scale(got, s.scale) || !same_scale(got_t, s.scale))
                m.add("expert ", g, " block ", n0, ",", k0, ": scale");
              for (int64_t n = n0; n < std::min(N, n0 + 128); ++n)
                for (int64_t k = k0; k < std::min(K, k0 + 128); ++k) {
                  const uint8_t want = Rule::quantize(v[size_t((g * N + n) * K + k)], s.multiplier);
                  if (byte_at(out.data, (g * N + n) * K + k) != want) m.add("data ", g, ",", n, ",", k);
                  if (byte_at(out.data_t, (g * K + k) * N + n) != want) m.add("data_t ", g, ",", k, ",", n);
                }
            }
        EXPECT_NO_MISMATCH(m);
        // One pair requested: the other stays untouched.
        OwnedWeight only_data(G, N, K), only_t(G, N, K);
        quantize_fp8_weight(param.param, {only_data.data, only_data.scales, {}, {}}, recipe);
        quantize_fp8_weight(param.param, {{}, {}, only_t.data_t, only_t.scales_t}, recipe);
        EXPECT_TRUE(bitwise_equal(only_data.data, out.data) && bitwise_equal(only_data.scales, out.scales));
        EXPECT_TRUE(bitwise_equal(only_t.data_t, out.data_t) && bitwise_equal(only_t.scales_t, out.scales_t));
        EXPECT_TRUE(tail_untouched(only_data.data_t, 0) && tail_untouched(only_data.scales_t, 0));
        EXPECT_TRUE(tail_untouched(only_t.data, 0) && tail_untouched(only_t.scales, 0));
      }
}

// ---- the dequantizer ----

// What dequantize_fp8 writes for one code and scale, as the bits of out's dtype: the float product
// of the E4M3 value and the scale (exact in double, 4 x 24 significant bits, then rounded once to
// float), rounded to the dtype; a NaN as the canonical NaN (0x7fffffff, 0x7fff in 16 bits).
uint32_t dequantized_bits(uint8_t code, float scale, DType dtype) {
  const double exact = oracle::e4m3_value(code) * double(scale);
  if (std::isnan(exact)) return dtype == DType::kFloat32 ? 0x7fffffffu : 0x7fffu;
  const float product = float(exact);
  switch (dtype) {
    case DType::kBFloat16:
      return BFloat16(product).bits;
    case DType::kFloat16:
      return Float16(product).bits;
    default:
      return bits_of(product);
  }
}

uint32_t bits_at(const uint8_t* p, size_t bytes) {
  if (bytes == 4) return bits_of(*reinterpret_cast<const float*>(p));
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return h;
}

// out [T, K] (any row stride) against the rule for rows < routed; rows from `routed` on, and the
// bytes between a row's end and the next row, still poison.
void expect_dequantized(const Fp8Rows& rows, int64_t routed, const TensorView& out) {
  const int64_t T = out.size(0), K = out.size(1), ld = out.stride(0);
  const size_t bytes = out.element_size();
  const auto* o = static_cast<const uint8_t*>(out.data());
  const auto* q = static_cast<const uint8_t*>(rows.data.data());
  const auto* s = static_cast<const float*>(rows.scales.data());
  Mismatches m;
  for (int64_t r = 0; r < T; ++r)
    for (int64_t k = 0; k < (r + 1 < T ? ld : K); ++k) {
      const uint8_t* e = o + size_t(r * ld + k) * bytes;
      if (r >= routed || k >= K) {
        for (size_t b = 0; b < bytes; ++b)
          if (e[b] != kPoison) {
            m.add(k >= K ? "the gap after row " : "unrouted row ", r, " written at ", k);
            break;
          }
        continue;
      }
      const uint8_t code = q[r * rows.data.stride(0) + k];
      const float scale = s[k / 128 * rows.scales.stride(0) + r];
      const uint32_t want = dequantized_bits(code, scale, out.dtype()), got = bits_at(e, bytes);
      if (got != want)
        m.add("row ", r, " feature ", k, ": code 0x", std::hex, int(code), " x scale ",
              std::defaultfloat, scale, " gave bits 0x", std::hex, got, ", expected 0x", want,
              std::dec);
    }
  EXPECT_NO_MISMATCH(m);
}

const DType kOutDtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};

class DequantizeFp8 : public ::testing::TestWithParam<DType> {};

// quantize_fp8 then dequantize_fp8: q * s exactly, rounded to out's dtype, on the routings of the
// quantizer's tests (G = 1, empty and 1-row experts, K off a multiple of 128, capacity past the
// routed rows, G = 256); within E4M3's precision of x (half a step of 3 mantissa bits, or of the
// subnormal step 2^-9 / m).
TEST_P(DequantizeFp8, RoundTripIsQTimesScaleOnOddRoutings) {
  const DType out_dtype = GetParam();
  Rng rng;
  int index = 0;
  for (const QuantCase& c : quant_cases()) {
    const DType x_dtype = kOutDtypes[index++ % 3];
    SCOPED_TRACE(std::string(c.name) + ", x " + dtype_name(x_dtype));
    Routing r(c.splits, c.capacity);
    const int64_t T = c.capacity, K = c.k;
    const Tensor x = spread_tensor(T, K, x_dtype, rng);
    OwnedRows rows(T, K);
    quantize_fp8(x, r.layout, rows.view(), {});
    Tensor out = poisoned({T, K}, out_dtype);
    dequantize_fp8(rows.view(), r.layout, out);
    expect_dequantized(rows.view(), r.rows(), out);
    if (out_dtype != DType::kFloat32) continue;
    const std::vector<float> v = values_of(x);
    const int64_t pitch = rows.scales.size(1);
    Mismatches far;
    for (int64_t t = 0; t < r.rows(); ++t)
      for (int64_t k = 0; k < K; ++k) {
        const double want = v[size_t(t * K + k)], got = out.data_as<float>()[t * K + k];
        const double scale = float_at(rows.scales, k / 128 * pitch + t);
        if (std::fabs(got - want) >
            (std::ldexp(std::fabs(want), -4) + std::ldexp(scale, -10)) * 1.001)
          far.add("row ", t, " feature ", k, ": ", got, " for ", want);
      }
    EXPECT_NO_MISMATCH(far);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DequantizeFp8, ::testing::ValuesIn(kOutDtypes),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Rows made by hand: every code, scales of every kind (zero, denormal, the extremes, infinity, NaN,
// negative), K = 200 (not a multiple of 16: data rows 208 bytes apart), a scale pitch past
// fp8_scales_pitch(T), out rows strided past K.
TEST(DequantizeFp8Rule, EveryCodeAndScaleWithRaggedKAndStridedRows) {
  const int64_t T = 40, K = 200, data_ld = 208, pitch = 44, out_ld = K + 5;
  Routing r({7, 0, 20, 1}, T);
  Tensor data_buffer = poisoned({T * data_ld}, DType::kFloat8E4M3);
  Tensor scales = poisoned({2, pitch}, DType::kFloat32);
  auto* q = data_buffer.data_as<uint8_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k)
      q[t * data_ld + k] = uint8_t((t * K + k) * 37 % 256);  // every code
  const float specials[] = {0.f,
                            -0.f,
                            1.f,
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::min(),
                            1e-30f,
                            3.5e35f,
                            std::numeric_limits<float>::max(),
                            kInf,
                            kNan,
                            -1.5f,
                            -kInf};
  Rng rng;
  for (int64_t i = 0; i < 2 * pitch; ++i)
    scales.data_as<float>()[i] =
        i % 3 == 0 ? specials[size_t(i / 3) % std::size(specials)] : float(rng.uniform(-4, 4));
  const Fp8Rows rows{
      TensorView(data_buffer.data(), {T, K}, {data_ld, 1}, DType::kFloat8E4M3, Device::cpu()),
      scales};
  for (DType dt : kOutDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor buffer = poisoned({T * out_ld}, dt);
    const TensorView out(buffer.data(), {T, K}, {out_ld, 1}, dt, Device::cpu());
    dequantize_fp8(rows, r.layout, out);
    expect_dequantized(rows, r.rows(), out);
    EXPECT_TRUE(tail_untouched(buffer, (T - 1) * out_ld + K)) << "past the last row";
  }
}

// A tile holding an infinity or a NaN quantizes to NaN codes with a NaN scale: it dequantizes to
// NaN (the canonical one), and only it.
TEST(DequantizeFp8Rule, NonFiniteTilesDequantizeToNanAndOnlyThey) {
  const int64_t T = 64, K = 256;
  Routing r({20, 30}, T);
  Rng rng;
  Tensor x = random_tensor({T, K}, DType::kFloat32, rng);
  x.data_as<float>()[3 * K + 10] = kInf;    // row 3, block 0
  x.data_as<float>()[25 * K + 200] = kNan;  // row 25, block 1
  OwnedRows rows(T, K);
  quantize_fp8(x, r.layout, rows.view(), {});
  for (DType dt : kOutDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor out = poisoned({T, K}, dt);
    dequantize_fp8(rows.view(), r.layout, out);
    expect_dequantized(rows.view(), r.rows(), out);
    const oracle::Matrix m = oracle::to_matrix(out);
    for (int64_t t = 0; t < r.rows(); ++t)
      for (int64_t k = 0; k < K; ++k) {
        const bool nan_tile = (t == 3 && k < 128) || (t == 25 && k >= 128);
        ASSERT_EQ(std::isnan(m(t, k)), nan_tile) << "row " << t << " feature " << k;
      }
    EXPECT_TRUE(tail_untouched(out, r.rows()));
  }
}

// Nothing routed, no features, no rows: nothing written, no error (as the quantizers).
TEST(DequantizeFp8Rule, EmptyRoutingAndEmptyShapesWriteNothing) {
  Routing none({0, 0, 0}, 20);
  OwnedRows rows(20, 48);
  std::memset(rows.data.data(), 0x38, rows.data.nbytes());  // 1.0
  Tensor out = poisoned({20, 48}, DType::kBFloat16);
  dequantize_fp8(rows.view(), none.layout, out);
  EXPECT_TRUE(tail_untouched(out, 0));
  Routing some({3, 4}, 20);
  OwnedRows no_features(20, 0);
  Tensor empty_out = poisoned({20, 0}, DType::kFloat32);
  EXPECT_NO_THROW(dequantize_fp8(no_features.view(), some.layout, empty_out));
  Routing no_rows({0, 0}, 0);
  OwnedRows zero_rows(0, 48);
  Tensor zero_out = poisoned({0, 48}, DType::kFloat32);
  EXPECT_NO_THROW(dequantize_fp8(zero_rows.view(), no_rows.layout, zero_out));
}

TEST(Fp8Sizes, ColumnsCapacityAndScalesPitch) {
  EXPECT_EQ(fp8_columns_capacity(0, 1), 128);
  EXPECT_EQ(fp8_columns_capacity(0, 0), 0);
  EXPECT_EQ(fp8_columns_capacity(1, 1), 128);
  EXPECT_EQ(fp8_columns_capacity(2, 1), 256);  // 2 + 127 = 129
  EXPECT_EQ(fp8_columns_capacity(1000, 8), 2048);  // 1000 + 1016 = 2016
  EXPECT_EQ(fp8_columns_capacity(4096, 32), 8192);  // 4096 + 4064 = 8160
  EXPECT_EQ(fp8_scales_pitch(0), 4);
  EXPECT_EQ(fp8_scales_pitch(1), 4);
  EXPECT_EQ(fp8_scales_pitch(4), 4);
  EXPECT_EQ(fp8_scales_pitch(5), 8);
  EXPECT_EQ(fp8_scales_pitch(1001), 1004);
  EXPECT_MOE_ERROR(fp8_columns_capacity(-1, 4), ErrorCode::kInvalidArgument,
                   "fp8_columns_capacity: capacity: expected T >= 0, got -1");
  EXPECT_MOE_ERROR(fp8_columns_capacity(10, -2), ErrorCode::kInvalidArgument,
                   "fp8_columns_capacity: num_groups: expected G >= 0, got -2");
  EXPECT_MOE_ERROR(fp8_scales_pitch(-3), ErrorCode::kInvalidArgument,
                   "fp8_scales_pitch: capacity: expected T >= 0, got -3");
}

// ---- the GEMMs ----

struct GemmCase {
  const char* name;
  std::vector<int64_t> splits;
  int64_t capacity, n, k;
};

// N and K multiples of 16, some not of 128; odd routings as above.
std::vector<GemmCase> gemm_cases() {
  Rng rng;
  std::vector<int64_t> many = random_splits(rng, 256, 4);
  const int64_t many_rows = std::accumulate(many.begin(), many.end(), int64_t(0));
  return {
      {"single_expert", {50}, 64, 48, 160},
      {"empty_and_one_row", {0, 1, 37, 0}, 40, 32, 144},
      {"one_expert_takes_all", {0, 0, 300, 0, 0}, 310, 272, 128},
      {"off_tile_sizes", {129, 3, 200}, 400, 144, 400},
      {"g256", many, many_rows + 7, 16, 32},
  };
}

// One problem quantized on the CPU: x [T, K], w G x [N, K], dy [T, N], their FP8 forms.
struct Fp8Problem {
  Routing routing;
  Tensor x, w, dy;
  OwnedRows x_rows, dy_rows;
  OwnedColumns x_cols, dy_cols;
  OwnedWeight weight;

  Fp8Problem(const GemmCase& c, Rng& rng, DType dt = DType::kBFloat16)
      : routing(c.splits, c.capacity),
        x(random_tensor({c.capacity, c.k}, dt, rng)),
        w(random_tensor({int64_t(c.splits.size()), c.n, c.k}, dt, rng, 1.0 / std::sqrt(double(c.k)))),
        dy(random_tensor({c.capacity, c.n}, dt, rng)),
        x_rows(c.capacity, c.k),
        dy_rows(c.capacity, c.n),
        x_cols(c.capacity, int64_t(c.splits.size()), c.k),
        dy_cols(c.capacity, int64_t(c.splits.size()), c.n),
        weight(int64_t(c.splits.size()), c.n, c.k) {
    quantize_fp8(x, routing.layout, x_rows.view(), x_cols.view());
    quantize_fp8(dy, routing.layout, dy_rows.view(), dy_cols.view());
    quantize_fp8_weight(GroupedParam::packed(w), weight.view());
  }
};

// The oracle's tight bound: the CPU sums each 128-block in float32 over exactly representable
// products, so the error is float32 rounding, far below 1e-5 of the output's scale.
constexpr double kOracleBound = 1e-5;
// DeepGEMM's bound on the similarity to the 16-bit GEMM of the unquantized inputs.
constexpr double kSimilarityBound = 1e-3;

// float32 results: max error within kOracleBound of the output's RMS; bfloat16 results add their
// own rounding (the 16-bit ops' tolerance, as a relative norm).
void expect_matches_oracle(const oracle::Matrix& got, const oracle::Matrix& ref, DType out, const char* what) {
  if (out == DType::kFloat32)
    EXPECT_LE(max_error_vs_rms(got, ref), kOracleBound) << what << " vs the oracle of the dequantized operands";
  else
    EXPECT_LE(oracle::rel_error(got, ref), tolerance(out)) << what << " vs the oracle of the dequantized operands";
}

TEST(Fp8Gemm, ForwardMatchesOracleAnd16BitGemmWithEveryBiasMode) {
  Rng rng;
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(c.name);
    Fp8Problem p(c, rng);
    const int64_t T = c.capacity, G = p.routing.num_groups(), rows = p.routing.rows();
    Tensor b = random_tensor({G, c.n}, DType::kBFloat16, rng);
    Tensor prob = uniform_tensor({T}, DType::kFloat32, rng, 0, 1);
    for (int mode = 0; mode < 3; ++mode)
      for (DType out : {DType::kFloat32, DType::kBFloat16}) {
        SCOPED_TRACE(std::string(mode == 0 ? "no bias" : mode == 1 ? "bias" : "scale_bias") + ", y " + dtype_name(out));
        BiasEpilogue epi;
        if (mode > 0) epi.bias = GroupedParam::packed(b);
        if (mode == 2) epi.row_scale = prob;
        Tensor y = poisoned({T, c.n}, out);
        grouped_linear_forward(p.x_rows.view(), p.weight.view(), p.routing.layout, y, epi);
        const oracle::Matrix got = head(oracle::to_matrix(y), rows);
        const oracle::Matrix ref =
            oracle::fp8_linear_forward(p.x_rows.view(), p.weight.view(), p.routing.splits,
                                       mode ? oracle::to_matrix(b) : oracle::Matrix{},
                                       mode == 2 ? oracle::to_vector(prob) : oracle::Vector{});
        expect_matches_oracle(got, ref, out, "y");
        Tensor y16 = poisoned({T, c.n}, DType::kFloat32);
        grouped_linear_forward(p.x, GroupedParam::packed(p.w), p.routing.layout, y16, epi);
        EXPECT_LT(similarity_diff(got, head(oracle::to_matrix(y16), rows)), kSimilarityBound) << "vs the bf16 GEMM";
        EXPECT_TRUE(tail_untouched(y, rows)) << "rows past sum(splits) were written";
      }
  }
}

TEST(Fp8Gemm, DgradMatchesOracleAnd16BitGemm) {
  Rng rng;
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(c.name);
    Fp8Problem p(c, rng);
    const int64_t T = c.capacity, rows = p.routing.rows();
    for (DType out : {DType::kFloat32, DType::kBFloat16}) {
      Tensor dx = poisoned({T, c.k}, out);
      grouped_linear_dgrad(p.dy_rows.view(), p.weight.view(), p.routing.layout, dx);
      const oracle::Matrix got = head(oracle::to_matrix(dx), rows);
      const oracle::Matrix ref = oracle::fp8_linear_dgrad(p.dy_rows.view(), p.weight.view(), p.routing.splits);
      expect_matches_oracle(got, ref, out, "dx");
      Tensor dx16 = poisoned({T, c.k}, DType::kFloat32);
      grouped_linear_dgrad(p.dy, GroupedParam::packed(p.w), p.routing.layout, dx16);
      EXPECT_LT(similarity_diff(got, head(oracle::to_matrix(dx16), rows)), kSimilarityBound);
      EXPECT_TRUE(tail_untouched(dx, rows));
    }
  }
}

TEST(Fp8Gemm, WgradWriteAccumulateOverwrite) {
  Rng rng;
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(c.name);
    Fp8Problem p(c, rng);
    const int64_t G = p.routing.num_groups();
    const auto ref = oracle::fp8_linear_wgrad(p.dy_cols.view(), p.x_cols.view(), p.routing.splits);
    Tensor dw16 = poisoned({G, c.n, c.k}, DType::kFloat32);
    grouped_linear_wgrad(p.dy, p.x, p.routing.layout, GroupedParam::packed(dw16), GradMode::kWrite);
    for (bool per_expert : {false, true}) {
      SCOPED_TRACE(per_expert ? "per-expert" : "packed");
      // write (float32 and bfloat16): empty experts get zeros
      for (DType out : {DType::kFloat32, DType::kBFloat16}) {
        OwnedParam dw(poisoned({G, c.n, c.k}, out), per_expert);
        grouped_linear_wgrad(p.dy_cols.view(), p.x_cols.view(), p.routing.layout, dw.param, GradMode::kWrite);
        const auto got = oracle::to_matrices(dw.param);
        expect_matches_oracle(stacked(got), stacked(ref), out, "dW (write)");
        if (out == DType::kFloat32)
          EXPECT_LT(similarity_diff(stacked(got), stacked(oracle::to_matrices(GroupedParam::packed(dw16)))),
                    kSimilarityBound);
        for (int64_t g = 0; g < G; ++g)
          if (c.splits[size_t(g)] == 0)
            for (double v : got[size_t(g)].data) ASSERT_EQ(v, 0.0) << "empty expert " << g;
      }
      // accumulate: += ; empty experts untouched bit for bit
      Tensor start = random_tensor({G, c.n, c.k}, DType::kFloat32, rng);
      OwnedParam main_grad(start.to(Device::cpu()), per_expert);
      grouped_linear_wgrad(p.dy_cols.view(), p.x_cols.view(), p.routing.layout, main_grad.param, GradMode::kAccumulate);
      auto expected = oracle::to_matrices(GroupedParam::packed(start));
      for (size_t g = 0; g < expected.size(); ++g)
        for (size_t i = 0; i < expected[g].data.size(); ++i) expected[g].data[i] += ref[g].data[i];
      EXPECT_LE(max_error_vs_rms(stacked(oracle::to_matrices(main_grad.param)), stacked(expected)), kOracleBound);
      for (int64_t g = 0; g < G; ++g)
        if (c.splits[size_t(g)] == 0)
          EXPECT_TRUE(bitwise_equal(main_grad.param.expert(g), start.view().select(g))) << "empty expert " << g;
      // overwrite: = ; empty experts get zeros
      OwnedParam over(random_tensor({G, c.n, c.k}, DType::kFloat32, rng), per_expert);
      grouped_linear_wgrad(p.dy_cols.view(), p.x_cols.view(), p.routing.layout, over.param, GradMode::kOverwrite);
      EXPECT_LE(max_error_vs_rms(stacked(oracle::to_matrices(over.param)), stacked(ref)), kOracleBound);
      for (int64_t g = 0; g < G; ++g)
        if (c.splits[size_t(g)] == 0)
          for (double v : oracle::to_matrix(over.param.expert(g)).data) ASSERT_EQ(v, 0.0);
    }
  }
}

// A NaN in a tile of x makes exactly the outputs that read that tile NaN.
TEST(Fp8Gemm, NonFiniteTilesReachOnlyTheOutputsThatReadThem) {
  Rng rng;
  Fp8Problem p({"nan", {20, 30}, 64, 32, 256}, rng, DType::kFloat32);
  p.x.data_as<float>()[25 * 256 + 200] = kNan;  // row 25 (expert 1), K block 1
  quantize_fp8(p.x, p.routing.layout, p.x_rows.view(), p.x_cols.view());
  Tensor y = poisoned({64, 32}, DType::kFloat32);
  grouped_linear_forward(p.x_rows.view(), p.weight.view(), p.routing.layout, y);
  for (int64_t r = 0; r < 50; ++r)
    for (int64_t n = 0; n < 32; ++n) ASSERT_EQ(std::isnan(y.data_as<float>()[r * 32 + n]), r == 25) << r << "," << n;
  Tensor dw = poisoned({2, 32, 256}, DType::kFloat32);
  grouped_linear_wgrad(p.dy_cols.view(), p.x_cols.view(), p.routing.layout, GroupedParam::packed(dw), GradMode::kWrite);
  for (int64_t g = 0; g < 2; ++g)
    for (int64_t n = 0; n < 32; ++n)
      for (int64_t k = 0; k < 256; ++k)
        ASSERT_EQ(std::isnan(dw.data_as<float>()[(g * 32 + n) * 256 + k]), g == 1 && k == 200) << g << "," << n << "," << k;
}

TEST(Fp8Gemm, Deterministic) {
  Rng rng;
  Fp8Problem p({"det", random_splits(rng, 16, 40), 700, 80, 96}, rng);
  Tensor y1 = poisoned({700, 80}, DType::kBFloat16), y2 = poisoned({700, 80}, DType::kBFloat16);
  grouped_linear_forward(p.x_rows.view(), p.weight.view(), p.routing.layout, y1);
  grouped_linear_forward(p.x_rows.view(), p.weight.view(), p.routing.layout, y2);
  EXPECT_TRUE(bitwise_equal(y1, y2));
  Tensor d1 = poisoned({16, 80, 96}, DType::kFloat32), d2 = poisoned({16, 80, 96}, DType::kFloat32);
  grouped_linear_wgrad(p.dy_cols.view(), p.x_cols.view(), p.routing.layout, GroupedParam::packed(d1), GradMode::kWrite);
  grouped_linear_wgrad(p.dy_cols.view(), p.x_cols.view(), p.routing.layout, GroupedParam::packed(d2), GradMode::kWrite);
  EXPECT_TRUE(bitwise_equal(d1, d2));
}

// ---- validation: every bad argument names the op, the argument, what was expected and got ----

class Fp8Validation : public ::testing::Test {
 protected:
  static constexpr int64_t T = 10, G = 3, N = 32, K = 48;
  Rng rng;
  Routing r{{3, 0, 5}, T};
  Tensor x = random_tensor({T, K}, DType::kBFloat16, rng);
  Tensor w = random_tensor({G, N, K}, DType::kBFloat16, rng);
  OwnedRows rows{T, K}, dy_rows{T, N};
  OwnedColumns cols{T, G, K}, dy_cols{T, G, N};
  OwnedWeight weight{G, N, K};
  Tensor y = Tensor::empty({T, N}, DType::kBFloat16);
  Tensor dw = Tensor::empty({G, N, K}, DType::kFloat32);

  void quantize(const Fp8Rows& r8, const Fp8Columns& c8 = {}, const Fp8Recipe& recipe = {}) {
    quantize_fp8(x, r.layout, r8, c8, recipe);
  }
  static Tensor f8(Shape shape) { return Tensor::zeros(shape, DType::kFloat8E4M3); }
  static Tensor f32(Shape shape) { return Tensor::zeros(shape, DType::kFloat32); }
};

TEST_F(Fp8Validation, QuantizeFp8) {
  EXPECT_MOE_ERROR(quantize({}), ErrorCode::kInvalidArgument,
                   "quantize_fp8: neither rows nor columns are requested (rows.data and columns.data are undefined): "
                   "the call would do nothing");
  EXPECT_MOE_ERROR(quantize({Tensor::zeros({T, K}, DType::kBFloat16), rows.scales}), ErrorCode::kDType,
                   "quantize_fp8: rows.data: expected float8_e4m3, got bfloat16");
  EXPECT_MOE_ERROR(quantize({Tensor::zeros({T, K}, DType::kFloat8E5M2), rows.scales}), ErrorCode::kDType,
                   "rows.data: expected float8_e4m3, got float8_e5m2");
  EXPECT_MOE_ERROR(quantize({rows.data, Tensor::zeros({1, 12}, DType::kBFloat16)}), ErrorCode::kDType,
                   "quantize_fp8: rows.scales: expected float32, got bfloat16");
  EXPECT_MOE_ERROR(quantize({rows.data, f32({1, 8})}), ErrorCode::kShape,
                   "quantize_fp8: rows.scales: expected a pitch S >= T = 10 and a multiple of 4 "
                   "(fp8_scales_pitch(T) = 12), got float32[1, 8]");
  EXPECT_MOE_ERROR(quantize({rows.data, f32({1, 14})}), ErrorCode::kShape,
                   "expected a pitch S >= T = 10 and a multiple of 4 (fp8_scales_pitch(T) = 12), got float32[1, 14]");
  EXPECT_MOE_ERROR(quantize({rows.data, f32({2, 12})}), ErrorCode::kShape,
                   "rows.scales: expected [ceil(K/128), S] = [1, *], got float32[2, 12]");
  EXPECT_MOE_ERROR(quantize({f8({T, 32}), rows.scales}), ErrorCode::kShape,
                   "rows.data: expected [T, K] = [10, 48], got float8_e4m3[10, 32]");
  EXPECT_MOE_ERROR(quantize({rows.data, {}}), ErrorCode::kInvalidArgument,
                   "rows.scales: required with rows.data, got an undefined tensor");
  // Row strides and addresses: TMA's 16 bytes.
  Tensor buffer = f8({T * 64 + 16});
  const TensorView strided(buffer.data(), {T, K}, {56, 1}, DType::kFloat8E4M3, Device::cpu());
  EXPECT_MOE_ERROR(quantize({strided, rows.scales}), ErrorCode::kAlignment,
                   "rows.data: row stride 56 elements (56 bytes) must be >= 48 and a multiple of 16 bytes");
  const TensorView shifted(static_cast<char*>(buffer.data()) + 1, {T, K}, DType::kFloat8E4M3, Device::cpu());
  EXPECT_MOE_ERROR(quantize({shifted, rows.scales}), ErrorCode::kAlignment, "is not 16-byte aligned");
  Tensor scale_buffer = f32({2 * 16});
  const TensorView scale_rows(scale_buffer.data(), {2, 12}, {14, 1}, DType::kFloat32, Device::cpu());
  Tensor x_wide = random_tensor({T, 256}, DType::kBFloat16, rng);
  EXPECT_MOE_ERROR(quantize_fp8(x_wide, r.layout, {f8({T, 256}), scale_rows}, {}), ErrorCode::kAlignment,
                   "rows.scales: row stride 14 elements (56 bytes) must be >= 12 and a multiple of 16 bytes");
  // x
  EXPECT_MOE_ERROR(quantize_fp8(random_tensor({T, 40}, DType::kBFloat16, rng), r.layout, {f8({T, 40}), rows.scales}, {}),
                   ErrorCode::kShape, "quantize_fp8: K = 40 (x's features) is not a multiple of 16");
  EXPECT_MOE_ERROR(quantize_fp8(random_tensor({T, K}, DType::kFloat64, rng), r.layout, rows.view(), {}),
                   ErrorCode::kDType, "quantize_fp8: x: expected bfloat16, float16 or float32, got float64");
  EXPECT_MOE_ERROR(quantize_fp8(random_tensor({T + 1, K}, DType::kBFloat16, rng), r.layout, rows.view(), {}),
                   ErrorCode::kShape, "quantize_fp8: x: expected [T, K] = [10, *], got bfloat16[11, 48]");
  EXPECT_MOE_ERROR(quantize_fp8(f8({T, K}), r.layout, rows.view(), {}), ErrorCode::kDType,
                   "x: float8_e4m3 operands go to the FP8 ops");
  // devices, overlaps
  const TensorView on_gpu(reinterpret_cast<void*>(0x10000), {T, K}, DType::kFloat8E4M3, Device::cuda(0));
  EXPECT_MOE_ERROR(quantize({on_gpu, rows.scales}), ErrorCode::kDevice,
                   "quantize_fp8: rows.data is on cuda:0; expected the group layout's device cpu");
  const TensorView in_x(x.data(), {T, K}, DType::kFloat8E4M3, Device::cpu());
  EXPECT_MOE_ERROR(quantize({in_x, rows.scales}), ErrorCode::kInvalidArgument,
                   "quantize_fp8: output rows.data overlaps input x in memory; expected separate buffers");
  Tensor big = f8({K * 512});
  const TensorView rows_in_big(big.data(), {T, K}, DType::kFloat8E4M3, Device::cpu());
  const TensorView cols_in_big(big.data(), {K, 512}, DType::kFloat8E4M3, Device::cpu());
  EXPECT_MOE_ERROR(quantize({rows_in_big, rows.scales}, {cols_in_big, cols.scales, cols.offsets}),
                   ErrorCode::kInvalidArgument,
                   "quantize_fp8: outputs rows.data and columns.data overlap in memory; expected separate buffers");
  EXPECT_MOE_ERROR(quantize({}, {cols.data, cols.scales, r.offsets_tensor}), ErrorCode::kInvalidArgument,
                   "output columns.offsets overlaps input the routing's offsets");
  // columns
  EXPECT_MOE_ERROR(quantize({}, {f8({K, 256}), cols.scales, cols.offsets}), ErrorCode::kShape,
                   "quantize_fp8: columns.data: expected [K, C] = [48, 512], got float8_e4m3[48, 256]");
  EXPECT_MOE_ERROR(quantize({}, {cols.data, f32({4, 40}), cols.offsets}), ErrorCode::kShape,
                   "columns.scales: expected [C/128, K] = [4, 48], got float32[4, 40]");
  EXPECT_MOE_ERROR(quantize({}, {cols.data, cols.scales, Tensor::zeros({G + 1}, DType::kInt32)}), ErrorCode::kDType,
                   "quantize_fp8: columns.offsets: expected int64, got int32");
  EXPECT_MOE_ERROR(quantize({}, {cols.data, cols.scales, Tensor::zeros({G}, DType::kInt64)}), ErrorCode::kShape,
                   "columns.offsets: expected a 1-D [G + 1] = [4] tensor, got int64[3]");
  EXPECT_MOE_ERROR(quantize({}, {cols.data, cols.scales, {}}), ErrorCode::kInvalidArgument,
                   "columns.offsets: required with columns.data, got an undefined tensor");
  // the recipe
  EXPECT_MOE_ERROR(quantize(rows.view(), {}, {false, -1.f}), ErrorCode::kInvalidArgument,
                   "quantize_fp8: recipe.amax_epsilon: expected a finite value >= 0, got -1");
  EXPECT_MOE_ERROR(quantize(rows.view(), {}, {false, kNan}), ErrorCode::kInvalidArgument,
                   "recipe.amax_epsilon: expected a finite value >= 0, got nan");
  EXPECT_MOE_ERROR(quantize_fp8(x, GroupLayout{}, rows.view(), {}), ErrorCode::kInvalidArgument,
                   "quantize_fp8: the group layout is undefined");
}

TEST_F(Fp8Validation, DequantizeFp8) {
  Tensor out = Tensor::empty({T, K}, DType::kBFloat16);
  const Fp8Rows rv = rows.view();
  EXPECT_MOE_ERROR(dequantize_fp8(rv, GroupLayout{}, out), ErrorCode::kInvalidArgument,
                   "dequantize_fp8: the group layout is undefined");
  // rows
  EXPECT_MOE_ERROR(dequantize_fp8({{}, rows.scales}, r.layout, out), ErrorCode::kInvalidArgument,
                   "dequantize_fp8: rows.data: required tensor [T, K] is undefined");
  EXPECT_MOE_ERROR(
      dequantize_fp8({Tensor::zeros({T, K}, DType::kBFloat16), rows.scales}, r.layout, out),
      ErrorCode::kDType, "dequantize_fp8: rows.data: expected float8_e4m3, got bfloat16");
  EXPECT_MOE_ERROR(
      dequantize_fp8({Tensor::zeros({T, K}, DType::kFloat8E5M2), rows.scales}, r.layout, out),
      ErrorCode::kDType, "dequantize_fp8: rows.data: expected float8_e4m3, got float8_e5m2");
  EXPECT_MOE_ERROR(dequantize_fp8({f8({T + 1, K}), rows.scales}, r.layout, out), ErrorCode::kShape,
                   "dequantize_fp8: rows.data: expected [T, K] = [10, *], got float8_e4m3[11, 48]");
  EXPECT_MOE_ERROR(
      dequantize_fp8({f8({T, K, 1}), rows.scales}, r.layout, out), ErrorCode::kShape,
      "dequantize_fp8: rows.data: expected [T, K] = [10, *], got float8_e4m3[10, 48, 1]");
  EXPECT_MOE_ERROR(dequantize_fp8({rows.data, {}}, r.layout, out), ErrorCode::kInvalidArgument,
                   "dequantize_fp8: rows.scales: required tensor [ceil(K/128), S] is undefined");
  EXPECT_MOE_ERROR(
      dequantize_fp8({rows.data, Tensor::zeros({1, 12}, DType::kBFloat16)}, r.layout, out),
      ErrorCode::kDType, "dequantize_fp8: rows.scales: expected float32, got bfloat16");
  EXPECT_MOE_ERROR(
      dequantize_fp8({rows.data, f32({2, 12})}, r.layout, out), ErrorCode::kShape,
      "dequantize_fp8: rows.scales: expected [ceil(K/128), S] = [1, *], got float32[2, 12]");
  EXPECT_MOE_ERROR(dequantize_fp8({rows.data, f32({1, 8})}, r.layout, out), ErrorCode::kShape,
                   "dequantize_fp8: rows.scales: expected a pitch S >= T = 10 and a multiple of 4 "
                   "(fp8_scales_pitch(T) = 12), got float32[1, 8]");
  Tensor buffer = f8({T * 64 + 16});
  const TensorView strided(buffer.data(), {T, K}, {56, 1}, DType::kFloat8E4M3, Device::cpu());
  EXPECT_MOE_ERROR(dequantize_fp8({strided, rows.scales}, r.layout, out), ErrorCode::kAlignment,
                   "dequantize_fp8: rows.data: row stride 56 elements (56 bytes) must be >= 48 and "
                   "a multiple of 16");
  const TensorView shifted(static_cast<char*>(buffer.data()) + 1, {T, K}, DType::kFloat8E4M3,
                           Device::cpu());
  EXPECT_MOE_ERROR(dequantize_fp8({shifted, rows.scales}, r.layout, out), ErrorCode::kAlignment,
                   "dequantize_fp8: rows.data: data pointer");
  // out
  EXPECT_MOE_ERROR(dequantize_fp8(rv, r.layout, TensorView{}), ErrorCode::kInvalidArgument,
                   "dequantize_fp8: out: required tensor [T, K] is undefined");
  for (DType bad : {DType::kFloat64, DType::kFloat8E4M3, DType::kInt64})
    EXPECT_MOE_ERROR(
        dequantize_fp8(rv, r.layout, Tensor::zeros({T, K}, bad)), ErrorCode::kDType,
        std::string("dequantize_fp8: out: expected bfloat16, float16 or float32, got ") +
            dtype_name(bad));
  EXPECT_MOE_ERROR(dequantize_fp8(rv, r.layout, Tensor::empty({T, 32}, DType::kFloat16)),
                   ErrorCode::kShape,
                   "dequantize_fp8: out: expected [T, K] = [10, 48], got float16[10, 32]");
  EXPECT_MOE_ERROR(dequantize_fp8(rv, r.layout, Tensor::empty({T + 1, K}, DType::kFloat32)),
                   ErrorCode::kShape,
                   "dequantize_fp8: out: expected [T, K] = [10, 48], got float32[11, 48]");
  Tensor wide = Tensor::empty({T, 2 * K}, DType::kBFloat16);
  const TensorView every_other(wide.data(), {T, K}, {2 * K, 2}, DType::kBFloat16, Device::cpu());
  EXPECT_MOE_ERROR(dequantize_fp8(rv, r.layout, every_other), ErrorCode::kShape,
                   "dequantize_fp8: out: expected unit column stride");
  // devices, overlaps
  const TensorView out_on_gpu(reinterpret_cast<void*>(0x10000), {T, K}, DType::kBFloat16,
                              Device::cuda(0));
  EXPECT_MOE_ERROR(dequantize_fp8(rv, r.layout, out_on_gpu), ErrorCode::kDevice,
                   "dequantize_fp8: out is on cuda:0; expected the group layout's device cpu");
  const TensorView data_on_gpu(reinterpret_cast<void*>(0x10000), {T, K}, DType::kFloat8E4M3,
                               Device::cuda(0));
  EXPECT_MOE_ERROR(
      dequantize_fp8({data_on_gpu, rows.scales}, r.layout, out), ErrorCode::kDevice,
      "dequantize_fp8: rows.data is on cuda:0; expected the group layout's device cpu");
  Tensor big = f8({T * K * 4});
  const Fp8Rows rows_in_big{TensorView(big.data(), {T, K}, DType::kFloat8E4M3, Device::cpu()),
                            rows.scales};
  EXPECT_MOE_ERROR(
      dequantize_fp8(rows_in_big, r.layout,
                     TensorView(big.data(), {T, K}, DType::kBFloat16, Device::cpu())),
      ErrorCode::kInvalidArgument,
      "dequantize_fp8: output out overlaps input rows.data in memory; expected separate buffers");
  Tensor scales_room = f32({T * K});
  const Fp8Rows scales_in_out{
      rows.data, TensorView(scales_room.data(), {1, 12}, DType::kFloat32, Device::cpu())};
  EXPECT_MOE_ERROR(
      dequantize_fp8(scales_in_out, r.layout,
                     TensorView(scales_room.data(), {T, K}, DType::kFloat32, Device::cpu())),
      ErrorCode::kInvalidArgument, "dequantize_fp8: output out overlaps input rows.scales");
  Tensor offsets_room = Tensor::zeros({T * K}, DType::kInt64);
  Tensor splits = splits_tensor_for({3, 0, 5});
  const TensorView offsets_view(offsets_room.data(), {G + 1}, DType::kInt64, Device::cpu());
  const GroupLayout in_out = GroupLayout::compute(splits, T, offsets_view);
  EXPECT_MOE_ERROR(
      dequantize_fp8(rv, in_out,
                     TensorView(offsets_room.data(), {T, K}, DType::kFloat32, Device::cpu())),
      ErrorCode::kInvalidArgument,
      "dequantize_fp8: output out overlaps input the routing's offsets");
}

TEST_F(Fp8Validation, QuantizeFp8Weight) {
  const auto W = GroupedParam::packed(w);
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {}), ErrorCode::kInvalidArgument,
                   "quantize_fp8_weight: neither out.data nor out.data_t is requested (both undefined): the call "
                   "would do nothing");
  EXPECT_MOE_ERROR(quantize_fp8_weight(GroupedParam{}, weight.view()), ErrorCode::kInvalidArgument,
                   "quantize_fp8_weight: weight: required per-expert tensor [N, K] is undefined");
  EXPECT_MOE_ERROR(quantize_fp8_weight(GroupedParam::packed(random_tensor({G, 40, K}, DType::kBFloat16, rng)),
                                       weight.view()),
                   ErrorCode::kShape, "quantize_fp8_weight: N = 40 (the weight's rows) is not a multiple of 16");
  EXPECT_MOE_ERROR(quantize_fp8_weight(GroupedParam::packed(random_tensor({G, N, 24}, DType::kBFloat16, rng)),
                                       weight.view()),
                   ErrorCode::kShape, "K = 24 (the weight's columns) is not a multiple of 16");
  EXPECT_MOE_ERROR(quantize_fp8_weight(GroupedParam::packed(random_tensor({G, N, K}, DType::kFloat64, rng)),
                                       weight.view()),
                   ErrorCode::kDType, "quantize_fp8_weight: weight: expected bfloat16, float16 or float32, got float64");
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {f8({G, N, 32}), weight.scales, {}, {}}), ErrorCode::kShape,
                   "quantize_fp8_weight: out.data: expected [G, N, K] = [3, 32, 48], got float8_e4m3[3, 32, 32]");
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {weight.data, f32({G, 1, 2}), {}, {}}), ErrorCode::kShape,
                   "out.scales: expected [G, ceil(N/128), ceil(K/128)] = [3, 1, 1], got float32[3, 1, 2]");
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {{}, {}, weight.data_t, Tensor::zeros({G, 1, 1}, DType::kBFloat16)}),
                   ErrorCode::kDType, "out.scales_t: expected float32, got bfloat16");
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {{}, {}, weight.data, weight.scales_t}), ErrorCode::kShape,
                   "out.data_t: expected [G, K, N] = [3, 48, 32], got float8_e4m3[3, 32, 48]");
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {weight.data, {}, {}, {}}), ErrorCode::kInvalidArgument,
                   "out.scales: required with out.data, got an undefined tensor");
  Tensor wide = f8({G, N, 2 * K});
  const TensorView strided(wide.data(), {G, N, K}, {N * 2 * K, 2 * K, 1}, DType::kFloat8E4M3, Device::cpu());
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {strided, weight.scales, {}, {}}), ErrorCode::kShape,
                   "out.data: expected a contiguous tensor");
  const TensorView data_t_in_data(weight.data.data(), {G, K, N}, DType::kFloat8E4M3, Device::cpu());
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {weight.data, weight.scales, data_t_in_data, weight.scales_t}),
                   ErrorCode::kInvalidArgument, "outputs out.data and out.data_t overlap in memory");
  const TensorView in_w(w.data(), {G, N, K}, DType::kFloat8E4M3, Device::cpu());
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {in_w, weight.scales, {}, {}}), ErrorCode::kInvalidArgument,
                   "output out.data overlaps input weight");
  const TensorView on_gpu(reinterpret_cast<void*>(0x10000), {G, N, K}, DType::kFloat8E4M3, Device::cuda(0));
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, {on_gpu, weight.scales, {}, {}}), ErrorCode::kDevice,
                   "out.data is on cuda:0; expected the group layout's device cpu");
  EXPECT_MOE_ERROR(quantize_fp8_weight(W, weight.view(), {true, -0.5f}), ErrorCode::kInvalidArgument,
                   "quantize_fp8_weight: recipe.amax_epsilon: expected a finite value >= 0, got -0.5");
}

TEST_F(Fp8Validation, Gemms) {
  const Fp8Weight wv = weight.view();
  EXPECT_MOE_ERROR(grouped_linear_forward(rows.view(), Fp8Weight{}, r.layout, y), ErrorCode::kInvalidArgument,
                   "grouped_linear_forward: weight.data: required tensor [G, N, K] is undefined");
  OwnedWeight four(4, N, K);
  EXPECT_MOE_ERROR(grouped_linear_forward(rows.view(), four.view(), r.layout, y), ErrorCode::kGroupMismatch,
                   "grouped_linear_forward: weight.data has G = 4 experts but the group layout has G = 3");
  EXPECT_MOE_ERROR(grouped_linear_forward(OwnedRows(T, 32).view(), wv, r.layout, y), ErrorCode::kShape,
                   "grouped_linear_forward: x.data: expected [T, K] = [10, 48], got float8_e4m3[10, 32]");
  EXPECT_MOE_ERROR(grouped_linear_forward(rows.view(), wv, r.layout, Tensor::empty({T, N}, DType::kFloat16)),
                   ErrorCode::kDType, "grouped_linear_forward: y: expected bfloat16 or float32, got float16");
  EXPECT_MOE_ERROR(grouped_linear_forward(rows.view(), wv, r.layout, Tensor::empty({T, 16}, DType::kBFloat16)),
                   ErrorCode::kShape, "y: expected [T, N] = [10, 32], got bfloat16[10, 16]");
  EXPECT_MOE_ERROR(grouped_linear_forward(rows.view(), {weight.data, f32({G, 1, 2}), {}, {}}, r.layout, y),
                   ErrorCode::kShape,
                   "weight.scales: expected [G, ceil(N/128), ceil(K/128)] = [3, 1, 1], got float32[3, 1, 2]");
  OwnedWeight odd(G, 40, K);
  EXPECT_MOE_ERROR(grouped_linear_forward(rows.view(), odd.view(), r.layout, y), ErrorCode::kShape,
                   "grouped_linear_forward: N = 40 (the weight's rows) is not a multiple of 16");
  EXPECT_MOE_ERROR(grouped_linear_forward(rows.view(), wv, r.layout,
                                          TensorView(rows.data.data(), {T, N}, DType::kBFloat16, Device::cpu())),
                   ErrorCode::kInvalidArgument, "grouped_linear_forward: output y overlaps input x.data");
  Tensor p = uniform_tensor({T}, DType::kFloat32, rng, 0, 1);
  EXPECT_MOE_ERROR(grouped_linear_forward(rows.view(), wv, r.layout, y, {{}, p}), ErrorCode::kInvalidArgument,
                   "row_scale (scale_bias) is given but there is no bias to scale");
  EXPECT_MOE_ERROR(grouped_linear_forward(rows.view(), wv, r.layout, y,
                                          {GroupedParam::packed(random_tensor({G, 16}, DType::kBFloat16, rng)), {}}),
                   ErrorCode::kShape, "bias: expected G x [N] = 3 x [32]");
  // dgrad
  EXPECT_MOE_ERROR(grouped_linear_dgrad(dy_rows.view(), {weight.data, weight.scales, {}, {}}, r.layout,
                                        Tensor::empty({T, K}, DType::kBFloat16)),
                   ErrorCode::kInvalidArgument,
                   "grouped_linear_dgrad: weight.data_t: required tensor [G, K, N] is undefined");
  EXPECT_MOE_ERROR(grouped_linear_dgrad(dy_rows.view(), wv, r.layout, Tensor::empty({T, K}, DType::kFloat16)),
                   ErrorCode::kDType, "grouped_linear_dgrad: dx: expected bfloat16 or float32, got float16");
  EXPECT_MOE_ERROR(grouped_linear_dgrad(rows.view(), wv, r.layout, Tensor::empty({T, K}, DType::kBFloat16)),
                   ErrorCode::kShape, "grouped_linear_dgrad: dy.data: expected [T, N] = [10, 32], got float8_e4m3[10, 48]");
  EXPECT_MOE_ERROR(grouped_linear_dgrad(dy_rows.view(), {{}, {}, weight.data_t, f32({G, 2, 1})}, r.layout,
                                        Tensor::empty({T, K}, DType::kBFloat16)),
                   ErrorCode::kShape,
                   "weight.scales_t: expected [G, ceil(K/128), ceil(N/128)] = [3, 1, 1], got float32[3, 2, 1]");
  // wgrad
  const auto DW = GroupedParam::packed(dw);
  EXPECT_MOE_ERROR(grouped_linear_wgrad(dy_cols.view(), cols.view(), r.layout,
                                        GroupedParam::packed(Tensor::zeros({G, N, K}, DType::kBFloat16)),
                                        GradMode::kAccumulate),
                   ErrorCode::kDType, "grouped_linear_wgrad: dweight: accumulate mode writes a float32 main_grad, got bfloat16");
  EXPECT_MOE_ERROR(grouped_linear_wgrad({dy_cols.data, dy_cols.scales, Tensor::zeros({G + 1}, DType::kInt32)},
                                        cols.view(), r.layout, DW, GradMode::kWrite),
                   ErrorCode::kDType, "grouped_linear_wgrad: dy.offsets: expected int64, got int32");
  EXPECT_MOE_ERROR(grouped_linear_wgrad(dy_cols.view(), dy_cols.view(), r.layout, DW, GradMode::kWrite),
                   ErrorCode::kShape, "grouped_linear_wgrad: x.data: expected [K, C] = [48, 512], got float8_e4m3[32, 512]");
  EXPECT_MOE_ERROR(grouped_linear_wgrad(dy_cols.view(), cols.view(), r.layout,
                                        GroupedParam::packed(Tensor::zeros({G, N, 40}, DType::kFloat32)), GradMode::kWrite),
                   ErrorCode::kShape, "grouped_linear_wgrad: K = 40 (dweight's columns) is not a multiple of 16");
  const TensorView dw_in_x(cols.data.data(), {G, N, K}, DType::kFloat32, Device::cpu());
  EXPECT_MOE_ERROR(grouped_linear_wgrad(dy_cols.view(), cols.view(), r.layout, GroupedParam::packed(dw_in_x),
                                        GradMode::kWrite),
                   ErrorCode::kInvalidArgument, "grouped_linear_wgrad: output dweight overlaps input x.data");
  EXPECT_MOE_ERROR(grouped_linear_wgrad(dy_cols.view(), cols.view(), r.layout,
                                        GroupedParam::packed(Tensor::zeros({2, N, K}, DType::kFloat32)), GradMode::kWrite),
                   ErrorCode::kGroupMismatch, "dweight has G = 2 experts but the group layout has G = 3");
}

}  // namespace
}  // namespace moe::test
