// One expert-MLP problem on a device: random inputs and weights for a workload, buffers for the
// outputs and gradients, forward/backward calls, and the comparison with the float64 oracle.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "moe_engine/moe_engine.hpp"
#include "routing.hpp"
#include "workloads.hpp"

namespace moe::tools {

struct OracleCheck {
  std::string metric = "rel_error";          // or "similarity_diff" (FP8)
  std::map<std::string, double> rel_error;  // per output, in `metric`
  double max_rel_error = 0;
  double tolerance = 0;
  bool passed = false;
};

class MlpProblem {
 public:
  // fp8: also hold the FP8 MLP's state (moe_engine/expert_mlp_fp8.hpp: the weights quantized once
  // here, what its forward keeps, its scratch), run instead of the 16-bit MLP while use_fp8(true).
  MlpProblem(const Workload& workload, const GluLayout& layout, DType dtype, Device device,
             uint64_t seed, bool fp8 = false);
  // The bytes a problem of this workload allocates (inputs, weights, outputs, gradients, workspaces),
  // known before it is built (bench's estimate); it lists the constructor's tensors, so keep the two
  // in step.
  static int64_t bytes_needed(const Workload& workload, DType dtype, bool fp8 = false);

  void forward(Stream stream = nullptr);   // y and the saved pre-activation
  void backward(Stream stream = nullptr);  // dx, dprobs and the four parameter gradients (write)
  // Quantizes both weights (both copies), as a module does once per optimizer step (FP8 only).
  void quantize_weights(Stream stream = nullptr);
  void use_fp8(bool on);
  bool fp8_active() const { return fp8_active_; }
  // Runs nothing: compares the last forward + backward with the float64 oracle (FP8: DeepGEMM's
  // similarity difference per output, the bound of the FP8 MLP tests).
  OracleCheck check_against_oracle() const;

  const Workload& workload() const { return workload_; }
  const ExpertMlpSpec& spec() const { return spec_; }
  void set_fusion(MlpFusion fusion) { spec_.fusion = fusion; }
  // What the last forward and backward ran: "all" (both GLU steps fused into the GEMM epilogues),
  // "forward", "backward" or "none" (always "none" on the CPU backend).
  std::string fusion_ran() const;
  // Recompute mode: forward keeps no pre-activation, backward recomputes FC1 from x.
  void set_recompute(bool recompute) { recompute_ = recompute; }
  // Bytes per token kept from forward for backward: x, the pre-activation (not with recompute) and
  // the prob (GroupedMLP's MlpContext::saved_bytes() for the same mode, per row).
  // FP8: x's columns and the pre-activation's rows with their scales (per row of the capacity).
  int64_t saved_bytes_per_token() const;
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

 private:
  Workload workload_;
  ExpertMlpSpec spec_;
  DType dtype_;
  Device device_;
  DeviceRouting routing_;
  // Inputs and parameters (copied to the host for the oracle).
  Tensor x_, w1_, b1_, w2_, b2_, probs_, dy_;
  // Outputs.
  Tensor y_, fc1_out_, dx_, dprobs_, dw1_, db1_, dw2_, db2_;
  Tensor forward_ws_, backward_ws_;
  // FP8 state (fp8 problems only).
  struct Fp8State {
    Tensor w1, w1_scales, w1_t, w1_scales_t, w2, w2_scales, w2_t, w2_scales_t;
    Tensor x_columns, x_column_scales, x_offsets, h_rows, h_scales;
    Tensor x_rows, x_row_scales;  // kept instead of x's columns where expert_mlp_fp8_keeps_x_rows
    Tensor forward_ws, backward_ws;
  };
  std::optional<Fp8State> fp8_;
  bool fp8_active_ = false;
  ExpertMlpFp8Weights fp8_weights() const;
  ExpertMlpFp8Saved fp8_saved() const;
  bool recompute_ = false;
  bool forward_fused_ = false, backward_fused_ = false;
};

}  // namespace moe::tools
