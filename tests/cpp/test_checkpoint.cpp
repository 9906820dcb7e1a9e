// Checkpoint layout conversion: per-expert <-> packed round trips (byte-identical tensor data) on a
// file written by an independent writer (tests/data, Python json + struct), GLU row permutations,
// the flattened [G*N, K] form, and every inconsistency the converter must refuse.
#include <cstring>

#include "test_support.hpp"

#ifndef MOE_ENGINE_TEST_DATA_DIR
#error "MOE_ENGINE_TEST_DATA_DIR must point at tests/data"
#endif

namespace moe::test {
namespace {

SafetensorsFile reload(const ConvertedCheckpoint& c) {
  std::vector<SafetensorsRecord> records;
  for (const OwnedTensorRecord& t : c.tensors) records.push_back({t.name, t.dtype, t.shape, t.data});
  return SafetensorsFile::parse(serialize_safetensors(records, c.metadata), "converted");
}

std::vector<uint8_t> data_of(const SafetensorsFile& f, const std::string& name) {
  const auto b = f.bytes(f.at(name));
  return {b.begin(), b.end()};
}

CheckpointConversion to(ExpertLayout layout, int64_t experts, std::string prefix = {}) {
  CheckpointConversion c;
  c.experts = experts;
  c.to = layout;
  c.prefix = std::move(prefix);
  return c;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.view().nbytes()};
}

void expect_io_error(const SafetensorsFile& f, const CheckpointConversion& c, const std::string& phrase) {
  try {
    convert_checkpoint(f, c);
    ADD_FAILURE() << "converted an inconsistent checkpoint; expected: " << phrase;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
    EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, PerExpertToPackedAndBackIsByteIdentical) {
  const SafetensorsFile original = SafetensorsFile::load(MOE_ENGINE_TEST_DATA_DIR "/three_experts.safetensors");
  const ConvertedCheckpoint packed = convert_checkpoint(original, to(ExpertLayout::kPacked, 3));
  EXPECT_EQ(packed.converted, (std::vector<std::string>{"experts.linear_fc1.weight"}));
  const SafetensorsFile p = reload(packed);
  EXPECT_EQ(p.metadata(), original.metadata());
  EXPECT_EQ(p.at("experts.linear_fc1.weight").shape, (std::vector<int64_t>{3, 2, 3}));
  EXPECT_EQ(data_of(p, "router.weight"), data_of(original, "router.weight")) << "other tensors copied";
  std::vector<uint8_t> stacked;
  for (int g = 0; g < 3; ++g) {
    const auto b = data_of(original, "experts.linear_fc1.weight" + std::to_string(g));
    stacked.insert(stacked.end(), b.begin(), b.end());
  }
  EXPECT_EQ(data_of(p, "experts.linear_fc1.weight"), stacked);
  // The values the independent writer put in: expert g, element i = g + 0.5 i.
  EXPECT_EQ(p.tensor("experts.linear_fc1.weight").data_as<float>()[6 + 5], 1.0f + 2.5f);

  const SafetensorsFile back = reload(convert_checkpoint(p, to(ExpertLayout::kPerExpert, 3)));
  ASSERT_EQ(back.entries().size(), original.entries().size());
  for (const SafetensorsEntry& e : original.entries()) {
    EXPECT_EQ(back.at(e.name).dtype, e.dtype) << e.name;
    EXPECT_EQ(back.at(e.name).shape, e.shape) << e.name;
    EXPECT_EQ(data_of(back, e.name), data_of(original, e.name)) << e.name;
  }
  // Converting to the layout a group already has changes nothing.
  const SafetensorsFile same = reload(convert_checkpoint(original, to(ExpertLayout::kPerExpert, 3)));
  EXPECT_EQ(data_of(same, "experts.linear_fc1.weight1"), data_of(original, "experts.linear_fc1.weight1"));
}

TEST(Checkpoint, GluLayoutsPermuteRowsAndRoundTrip) {
  Rng rng;
  const int64_t G = 2, F = 6, K = 5;
  Tensor w = random_tensor({G, 2 * F, K}, DType::kBFloat16, rng);
  Tensor b = random_tensor({G, 2 * F}, DType::kFloat32, rng);
  const SafetensorsFile f = SafetensorsFile::parse(serialize_safetensors(
      {safetensors_record("mlp.fc1.weight", w), safetensors_record("mlp.fc1.bias", b)}));
  for (const char* layout : {"pairs", "blocks:3", "blocks:2"}) {
    CheckpointConversion c = to(ExpertLayout::kPerExpert, G, "mlp.fc1.");
    c.glu_from = GluLayout::halves();
    c.glu_to = GluLayout::parse(layout);
    const SafetensorsFile per = reload(convert_checkpoint(f, c));
    // Row j of the gate half lands where the target layout puts gate column j (and so on).
    const size_t row = size_t(K) * 2;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < F; ++j) {
        const auto out = data_of(per, "mlp.fc1.weight" + std::to_string(g));
        const auto* in = static_cast<const uint8_t*>(w.data()) + size_t(g * 2 * F) * row;
        EXPECT_EQ(std::memcmp(out.data() + size_t(c.glu_to->gate_column(j, F)) * row, in + size_t(j) * row, row), 0);
        EXPECT_EQ(std::memcmp(out.data() + size_t(c.glu_to->linear_column(j, F)) * row, in + size_t(F + j) * row, row), 0);
      }
    std::swap(c.glu_from, c.glu_to);
    c.to = ExpertLayout::kPacked;
    const SafetensorsFile back = reload(convert_checkpoint(per, c));
    EXPECT_EQ(data_of(back, "mlp.fc1.weight"), bytes_of(w)) << layout;
    EXPECT_EQ(data_of(back, "mlp.fc1.bias"), bytes_of(b)) << layout;
  }
}

TEST(Checkpoint, SplitsTheFlattenedPackedFormUnderAPrefix) {
  Rng rng;
  Tensor w = random_tensor({3 * 4, 5}, DType::kFloat16, rng);  // TransformerEngine's [G*N, K]
  Tensor router = random_tensor({3, 5}, DType::kFloat32, rng);
  const SafetensorsFile f = SafetensorsFile::parse(
      serialize_safetensors({safetensors_record("moe.experts.weight", w), safetensors_record("moe.router.weight", router)}));
  const SafetensorsFile per = reload(convert_checkpoint(f, to(ExpertLayout::kPerExpert, 3, "moe.experts.")));
  EXPECT_EQ(per.at("moe.experts.weight2").shape, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(data_of(per, "moe.router.weight"), bytes_of(router));
  // Without a prefix only [G, N, K] counts as packed: the router ([3, 5], 3 | 3) is left alone.
  const SafetensorsFile unprefixed = reload(convert_checkpoint(f, to(ExpertLayout::kPerExpert, 3)));
  EXPECT_NE(unprefixed.find("moe.router.weight"), nullptr);
  EXPECT_NE(unprefixed.find("moe.experts.weight"), nullptr);
}

TEST(Checkpoint, RefusesInconsistentGroups) {
  Tensor a = Tensor::zeros({2, 3}, DType::kFloat32), h = Tensor::zeros({2, 3}, DType::kFloat16),
         wide = Tensor::zeros({2, 4}, DType::kFloat32), odd = Tensor::zeros({3, 3}, DType::kFloat32);
  auto file = [](std::vector<SafetensorsRecord> r) { return SafetensorsFile::parse(serialize_safetensors(r)); };
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight2", a)}),
                  to(ExpertLayout::kPacked, 3), "has no expert 1");
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight1", a),
                        safetensors_record("x.weight2", a)}),
                  to(ExpertLayout::kPacked, 2), "expected 2");
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight1", wide)}),
                  to(ExpertLayout::kPacked, 2), "expert 0 has");
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight1", h)}),
                  to(ExpertLayout::kPacked, 2), "expert 0 has");
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight1", a),
                        safetensors_record("x.weight", Tensor::zeros({2, 2, 3}, DType::kFloat32))}),
                  to(ExpertLayout::kPacked, 2), "both");
  expect_io_error(file({safetensors_record("x.weight", Tensor::zeros({5, 3}, DType::kFloat32))}),
                  to(ExpertLayout::kPerExpert, 2, "x."), "does not split into 2 experts");
  CheckpointConversion glu = to(ExpertLayout::kPacked, 2);
  glu.glu_from = GluLayout::halves();
  glu.glu_to = GluLayout::pairs();
  expect_io_error(file({safetensors_record("x.weight0", odd), safetensors_record("x.weight1", odd)}), glu, "odd");
  // 6 rows: F = 3 pairs, which blocks:2 cannot hold (its gate columns would run past the rows).
  const Tensor six = Tensor::zeros({6, 3}, DType::kFloat32);
  glu.glu_to = GluLayout::blocks(2);
  expect_io_error(file({safetensors_record("x.weight0", six), safetensors_record("x.weight1", six)}), glu,
                  "do not fit GLU layout blocks:2");
  EXPECT_THROW(parse_expert_layout("stacked"), Error);
  glu.glu_to.reset();
  EXPECT_THROW(convert_checkpoint(file({}), glu), Error);  // one GLU layout without the other
}

}  // namespace
}  // namespace moe::test
