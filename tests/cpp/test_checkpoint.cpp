// Checkpoint layout conversion: per-expert <-> packed round trips (byte-identical tensor data) on a
// file written by an independent writer (tests/data, Python json + struct), GLU row permutations,
// the flattened [G*N, K] form, and every inconsistency the converter must refuse.
#include <algorithm>
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

CheckpointConversion to_layout(ExpertLayout layout, int64_t experts, std::string prefix = {}) {
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
  const ConvertedCheckpoint packed = convert_checkpoint(original, to_layout(ExpertLayout::kPacked, 3));
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

  const SafetensorsFile back = reload(convert_checkpoint(p, to_layout(ExpertLayout::kPerExpert, 3)));
  ASSERT_EQ(back.entries().size(), original.entries().size());
  for (const SafetensorsEntry& e : original.entries()) {
    EXPECT_EQ(back.at(e.name).dtype, e.dtype) << e.name;
    EXPECT_EQ(back.at(e.name).shape, e.shape) << e.name;
    EXPECT_EQ(data_of(back, e.name), data_of(original, e.name)) << e.name;
  }
  // Converting to the layout a group already has changes nothing.
  const SafetensorsFile same = reload(convert_checkpoint(original, to_layout(ExpertLayout::kPerExpert, 3)));
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
    CheckpointConversion c = to_layout(ExpertLayout::kPerExpert, G, "mlp.fc1.");
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
  const SafetensorsFile per = reload(convert_checkpoint(f, to_layout(ExpertLayout::kPerExpert, 3, "moe.experts.")));
  EXPECT_EQ(per.at("moe.experts.weight2").shape, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(data_of(per, "moe.router.weight"), bytes_of(router));
  // Without a prefix only [G, N, K] counts as packed: the router ([3, 5], 3 | 3) is left alone.
  const SafetensorsFile unprefixed = reload(convert_checkpoint(f, to_layout(ExpertLayout::kPerExpert, 3)));
  EXPECT_NE(unprefixed.find("moe.router.weight"), nullptr);
  EXPECT_NE(unprefixed.find("moe.experts.weight"), nullptr);
}

TEST(Checkpoint, RefusesInconsistentGroups) {
  Tensor a = Tensor::zeros({2, 3}, DType::kFloat32), h = Tensor::zeros({2, 3}, DType::kFloat16),
         wide = Tensor::zeros({2, 4}, DType::kFloat32), odd = Tensor::zeros({3, 3}, DType::kFloat32);
  auto file = [](std::vector<SafetensorsRecord> r) { return SafetensorsFile::parse(serialize_safetensors(r)); };
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight2", a)}),
                  to_layout(ExpertLayout::kPacked, 3), "has no expert 1");
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight1", a),
                        safetensors_record("x.weight2", a)}),
                  to_layout(ExpertLayout::kPacked, 2), "expected 2");
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight1", wide)}),
                  to_layout(ExpertLayout::kPacked, 2), "expert 0 has");
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight1", h)}),
                  to_layout(ExpertLayout::kPacked, 2), "expert 0 has");
  expect_io_error(file({safetensors_record("x.weight0", a), safetensors_record("x.weight1", a),
                        safetensors_record("x.weight", Tensor::zeros({2, 2, 3}, DType::kFloat32))}),
                  to_layout(ExpertLayout::kPacked, 2), "both");
  expect_io_error(file({safetensors_record("x.weight", Tensor::zeros({5, 3}, DType::kFloat32))}),
                  to_layout(ExpertLayout::kPerExpert, 2, "x."), "does not split into 2 experts");
  CheckpointConversion glu = to_layout(ExpertLayout::kPacked, 2);
  glu.glu_from = GluLayout::halves();
  glu.glu_to = GluLayout::pairs();
  expect_io_error(file({safetensors_record("x.fc1.weight0", odd), safetensors_record("x.fc1.weight1", odd)}), glu,
                  "odd");
  // 6 rows: F = 3 pairs, which blocks:2 cannot hold (its gate columns would run past the rows).
  const Tensor six = Tensor::zeros({6, 3}, DType::kFloat32);
  glu.glu_to = GluLayout::blocks(2);
  expect_io_error(file({safetensors_record("x.fc1.weight0", six), safetensors_record("x.fc1.weight1", six)}), glu,
                  "do not fit GLU layout blocks:2");
  EXPECT_THROW(parse_expert_layout("stacked"), Error);
  glu.glu_to.reset();
  EXPECT_THROW(convert_checkpoint(file({}), glu), Error);  // one GLU layout without the other
}

// A GLU layout change reorders the rows of FC1 groups only. The whole expert layer (FC1 and FC2,
// weights and biases) of a module with GLU layout `from`, saved under either naming convention and
// in either expert layout, converted to the other expert layout and GLU layout `to`, loads into a
// module with layout `to` that computes bit for bit what the original computed; FC2 passes through
// byte for byte.
TEST(Checkpoint, GluChangeReordersOnlyFc1AndTheLayerComputesTheSame) {
  Rng rng;
  const int64_t G = 3, H = 8, F = 8;
  const Routing routing({5, 0, 7}, 14);
  const Tensor x = random_tensor({14, H}, DType::kFloat32, rng);
  const Tensor probs = uniform_tensor({14}, DType::kFloat32, rng, 0, 1);
  const std::vector<GluLayout> layouts = {GluLayout::halves(), GluLayout::pairs(), GluLayout::blocks(2),
                                          GluLayout::blocks(4)};
  // Our modules name the FC1 module "fc1", Megatron-LM / TransformerEngine "linear_fc1".
  const std::vector<std::pair<std::string, std::string>> namings = {{"layer.", "fc"},
                                                                    {"decoder.layers.0.mlp.experts.", "linear_fc"}};
  auto module = [&](const GluLayout& layout, ExpertLayout experts, uint64_t seed) {
    GroupedMLPOptions o;
    o.dtype = DType::kFloat32;
    o.bias = true;
    o.layout = experts;
    o.glu.layout = layout;
    o.seed = seed;
    return GroupedMLP(G, H, F, o);
  };
  auto rename = [](std::string key, const std::string& from, const std::string& to) {
    const size_t at = key.find(from);
    return at == std::string::npos ? key : key.replace(at, from.size(), to);
  };
  int checked = 0;
  for (const auto& [prefix, fc] : namings)
    for (const ExpertLayout source : {ExpertLayout::kPerExpert, ExpertLayout::kPacked})
      for (const GluLayout& from : layouts)
        for (const GluLayout& to : layouts) {
          const ExpertLayout target =
              source == ExpertLayout::kPacked ? ExpertLayout::kPerExpert : ExpertLayout::kPacked;
          SCOPED_TRACE(prefix + " " + from.name() + " -> " + to.name() + " to " +
                       (target == ExpertLayout::kPacked ? "packed" : "per-expert"));
          GroupedMLP original = module(from, source, 11);
          const Tensor y = original.forward(x, routing.layout, probs, false).y;
          const std::map<std::string, Tensor> state = original.state_dict(prefix);
          std::vector<SafetensorsRecord> records;
          for (const auto& [key, t] : state) records.push_back(safetensors_record(rename(key, ".fc", "." + fc), t));
          const SafetensorsFile file = SafetensorsFile::parse(serialize_safetensors(records), "layer");

          CheckpointConversion c = to_layout(target, G);
          c.glu_from = from;
          c.glu_to = to;
          const ConvertedCheckpoint converted = convert_checkpoint(file, c);
          const std::vector<std::string> fc1_groups = {prefix + fc + "1.bias", prefix + fc + "1.weight"};
          std::vector<std::string> reordered = converted.glu_reordered;
          std::sort(reordered.begin(), reordered.end());
          EXPECT_EQ(reordered, from == to ? std::vector<std::string>{} : fc1_groups);
          EXPECT_EQ(converted.converted.size(), 4u);
          const SafetensorsFile out = reload(converted);
          std::map<std::string, Tensor> loaded;
          for (const SafetensorsEntry& e : out.entries())
            loaded[rename(e.name, "." + fc, ".fc")] = out.tensor(e.name);
          // FC2 keeps its rows: the same bytes in the other expert layout.
          const std::string fc2 = prefix + "fc2.weight";
          const Tensor fc2_in = target == ExpertLayout::kPacked ? state.at(fc2 + "1") : state.at(fc2);
          const Tensor fc2_out = target == ExpertLayout::kPacked ? loaded.at(fc2) : loaded.at(fc2 + "1");
          const auto fc2_expert1 = [](const Tensor& t) {
            return t.dim() == 3 ? t.view().select(1) : t.view();
          };
          EXPECT_TRUE(bitwise_equal(fc2_expert1(fc2_in), fc2_expert1(fc2_out)));

          GroupedMLP restored = module(to, target, 99);
          restored.load_state_dict(loaded, prefix);
          EXPECT_TRUE(bitwise_equal(restored.forward(x, routing.layout, probs, false).y, y));
          ++checked;
        }
  EXPECT_EQ(checked, 2 * 2 * 4 * 4);
}

TEST(Checkpoint, Fc1GroupsByName) {
  EXPECT_TRUE(is_fc1_group("decoder.layers.3.mlp.experts.linear_fc1.weight"));
  EXPECT_TRUE(is_fc1_group("decoder.layers.3.mlp.experts.linear_fc1.bias"));
  EXPECT_TRUE(is_fc1_group("mlp.fc1.weight"));
  EXPECT_TRUE(is_fc1_group("fc1.weight"));
  EXPECT_FALSE(is_fc1_group("decoder.layers.3.mlp.experts.linear_fc2.weight"));
  EXPECT_FALSE(is_fc1_group("mlp.fc2.bias"));
  EXPECT_FALSE(is_fc1_group("mlp.not_fc1.weight"));
  EXPECT_FALSE(is_fc1_group("model.w13.weight"));
  // A prefix that names the module exactly makes it the FC1 group, whatever its name.
  EXPECT_TRUE(is_fc1_group("model.w13.weight", "model.w13."));
  EXPECT_TRUE(is_fc1_group("model.w13.bias", "model.w13"));
  EXPECT_FALSE(is_fc1_group("model.w2.weight", "model."));
}

TEST(Checkpoint, GluChangeWithoutAnFc1GroupIsAnErrorNamingTheGroups) {
  const Tensor w = Tensor::zeros({2, 4, 3}, DType::kFloat32);
  const SafetensorsFile f = SafetensorsFile::parse(
      serialize_safetensors({safetensors_record("mlp.w13.weight", w), safetensors_record("mlp.fc2.weight", w)}));
  CheckpointConversion c = to_layout(ExpertLayout::kPerExpert, 2);
  c.glu_from = GluLayout::halves();
  c.glu_to = GluLayout::pairs();
  EXPECT_MOE_ERROR(convert_checkpoint(f, c), ErrorCode::kInvalidArgument,
                   "no expert group is an FC1 group (module named linear_fc1 or fc1, or the module the prefix "
                   "names exactly); groups found: 'mlp.w13.weight', 'mlp.fc2.weight'");
  // Named by the prefix, the module is FC1; FC2 outside the prefix is copied as it is.
  c.prefix = "mlp.w13.";
  const ConvertedCheckpoint out = convert_checkpoint(f, c);
  EXPECT_EQ(out.glu_reordered, std::vector<std::string>{"mlp.w13.weight"});
  EXPECT_EQ(out.converted, std::vector<std::string>{"mlp.w13.weight"});
}

TEST(Checkpoint, ReportsWhatAConversionFound) {
  const SafetensorsFile original = SafetensorsFile::load(MOE_ENGINE_TEST_DATA_DIR "/three_experts.safetensors");
  const ConvertedCheckpoint same = convert_checkpoint(original, to_layout(ExpertLayout::kPerExpert, 3));
  EXPECT_FALSE(same.changed());
  EXPECT_EQ(same.already_in_layout, std::vector<std::string>{"experts.linear_fc1.weight"});
  EXPECT_EQ(same.keys_under_prefix, 4);
  const ConvertedCheckpoint none = convert_checkpoint(original, to_layout(ExpertLayout::kPacked, 3, "nothing."));
  EXPECT_FALSE(none.changed());
  EXPECT_EQ(none.keys_under_prefix, 0);
  EXPECT_TRUE(convert_checkpoint(original, to_layout(ExpertLayout::kPacked, 3)).changed());
}

}  // namespace
}  // namespace moe::test
