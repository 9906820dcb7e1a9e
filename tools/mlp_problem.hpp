// One expert-MLP problem on a device: random inputs and weights for a workload, buffers for the
// outputs and gradients, forward/backward calls, and the comparison with the float64 oracle.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "moe_engine/moe_engine.hpp"
#include "routing.hpp"
#include "workloads.hpp"

namespace moe::tools {

struct OracleCheck {
  std::map<std::string, double> rel_error;  // per output
  double max_rel_error = 0;
  double tolerance = 0;
  bool passed = false;
};

class MlpProblem {
 public:
  MlpProblem(const Workload& workload, const GluLayout& layout, DType dtype, Device device,
             uint64_t seed);
  // The bytes a problem of this workload allocates (inputs, weights, outputs, gradients, workspaces),
  // known before it is built (bench's estimate); it lists the constructor's tensors, so keep the two
  // in step.
  static int64_t bytes_needed(const Workload& workload, DType dtype);

  void forward(Stream stream = nullptr);   // y and the saved pre-activation
  void backward(Stream stream = nullptr);  // dx, dprobs and the four parameter gradients (write)
  // Runs nothing: compares the last forward + backward with the float64 oracle.
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
  int64_t saved_bytes_per_token() const {
    return (workload_.hidden + (recompute_ ? 0 : 2 * workload_.ffn)) * int64_t(dtype_size(dtype_)) + 4;
  }
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
  bool recompute_ = false;
  bool forward_fused_ = false, backward_fused_ = false;
};

}  // namespace moe::tools
