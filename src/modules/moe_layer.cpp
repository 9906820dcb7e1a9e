// MoELayer (docs/design.md section 15): router -> plan -> permute (x and the probs) -> GroupedMLP
// (the probs applied inside, as Megatron-LM does) -> unpermute without probs; backward in reverse,
// the router's dx added into the experts' dx by the router's dgrad. The ops do the work; the layer
// owns the parameters, the buffers between the ops and the router weight's gradient contract.
#include "moe_engine/moe_layer.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include "modules/parameter_io.hpp"
#include "moe_engine/runtime.hpp"

namespace moe {

int64_t MoELayerContext::saved_bytes() const {
  int64_t bytes = experts_.saved_bytes();
  for (const Tensor* t : {&x_, &logits_, &indices_, &aux_counts_, &row_of_, &splits_, &offsets_, &row_local_,
                          &splits_local_, &offsets_local_, &offsets_experts_})
    if (t->defined()) bytes += int64_t(t->nbytes());
  return bytes;
}

namespace {

constexpr const char* kForward = "MoELayer.forward";
constexpr const char* kBackward = "MoELayer.backward";

// The ops' scratch, allocated per call, stream-ordered on exec's stream (as GroupedMLP's): one
// buffer serves the ops of a pass in turn, as they run in order on that stream.
struct Scratch {
  Tensor bytes;
  ExecContext exec;
  Scratch(size_t size, Device device, const ExecContext& outer)
      : bytes(Tensor::empty_async({int64_t(size > 0 ? size : 1)}, DType::kUInt8, device, outer.stream)),
        exec{outer.stream, {bytes.data(), bytes.nbytes(), device}} {}
};

// The sizes and the options, checked before anything is built from them.
int64_t checked_experts(int64_t num_experts, int64_t hidden, int64_t ffn, const MoELayerOptions& o) {
  MOE_CHECK(num_experts >= 1 && hidden >= 1 && ffn >= 1, ErrorCode::kInvalidArgument,
            "MoELayer: expected num_experts, hidden, ffn >= 1, got ", num_experts, ", ", hidden, ", ", ffn);
  check_router_spec(o.router, num_experts, "MoELayer: options.router");
  if (o.capacity_factor)
    MOE_CHECK(std::isfinite(*o.capacity_factor) && *o.capacity_factor > 0, ErrorCode::kInvalidArgument,
              "MoELayer: options.capacity_factor: expected a finite value > 0 (or none for no capacity), got ",
              *o.capacity_factor);
  MOE_CHECK(o.experts.dtype != DType::kFloat64 || o.experts.device.is_cpu(), ErrorCode::kDType,
            "MoELayer: options.experts.dtype float64 runs on the CPU backend only, got device ",
            to_string(o.experts.device));
  return num_experts;
}

void check_exchange_capacity(const MoELayerOptions& o) {
  if (!o.expert_parallel_capacity_factor) return;
  MOE_CHECK(o.expert_parallel != nullptr, ErrorCode::kInvalidArgument,
            "MoELayer: options.expert_parallel_capacity_factor is set without options.expert_parallel; it sizes the "
            "buffers of the expert-parallel exchange");
  const double f = *o.expert_parallel_capacity_factor;
  MOE_CHECK(std::isfinite(f) && f > 0, ErrorCode::kInvalidArgument,
            "MoELayer: options.expert_parallel_capacity_factor: expected a finite value > 0, got ", f);
}

// The experts this rank holds: E / P with expert parallelism, checked.
int64_t checked_local_experts(int64_t num_experts, int64_t hidden, int64_t ffn, const MoELayerOptions& o) {
  checked_experts(num_experts, hidden, ffn, o);
  check_exchange_capacity(o);
  if (!o.expert_parallel) return num_experts;
  const int P = o.expert_parallel->size(), r = o.expert_parallel->rank();
  MOE_CHECK(P >= 1 && r >= 0 && r < P, ErrorCode::kInvalidArgument,
            "MoELayer: options.expert_parallel: expected a rank in [0, size) and size >= 1, got rank ", r, " of ", P);
  MOE_CHECK(num_experts % P == 0, ErrorCode::kInvalidArgument, "MoELayer: num_experts = ", num_experts,
            " must be a multiple of the expert-parallel group's size ", P,
            " (each rank holds num_experts / size experts)");
  return num_experts / P;
}

// Rows per rank of a [P * L] count vector in rank-major blocks of L.
std::vector<int64_t> block_sums(const Tensor& counts_host, int P, int64_t L) {
  std::vector<int64_t> rows(size_t(P), 0);
  const int64_t* c = counts_host.data_as<int64_t>();
  for (int p = 0; p < P; ++p)
    for (int64_t l = 0; l < L; ++l) rows[size_t(p)] += c[p * L + l];
  return rows;
}

int64_t total(const std::vector<int64_t>& rows) { return std::accumulate(rows.begin(), rows.end(), int64_t{0}); }

}  // namespace

MoELayer::MoELayer(int64_t num_experts, int64_t hidden, int64_t ffn, const MoELayerOptions& o)
    : options_(o),
      num_experts_(num_experts),
      ep_rank_(o.expert_parallel ? o.expert_parallel->rank() : 0),
      ep_size_(o.expert_parallel ? o.expert_parallel->size() : 1),
      experts_(checked_local_experts(num_experts, hidden, ffn, o), hidden, ffn, o.experts),
      router_weight_(1, {num_experts, hidden}, o.experts.dtype, o.experts.device, ExpertLayout::kPacked),
      router_grad_(o.experts.accumulate_into_main_grad, o.experts.overwrite_main_grad, o.experts.zero_out_wgrad),
      tokens_per_expert_(Tensor::zeros({num_experts}, DType::kInt64, o.experts.device)),
      errors_(o.experts.device) {
  // Uniform +-1/sqrt(H), as the experts' weights; its own seed after the experts' four.
  const float bound = 1.0f / std::sqrt(float(hidden));
  detail::init_uniform(router_weight_.storage(), o.experts.seed + 4, -bound, bound);
  if (o.expert_bias) expert_bias_ = Tensor::zeros({num_experts}, acc_dtype(), o.experts.device);
}

DType MoELayer::acc_dtype() const {
  return options_.experts.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

TensorView MoELayer::router_weight_view() const { return router_weight_.value().packed_view().select(0); }

const Tensor& MoELayer::expert_bias() const {
  MOE_CHECK(expert_bias_.defined(), ErrorCode::kInvalidArgument,
            "MoELayer: the layer has no expert bias (MoELayerOptions::expert_bias is false)");
  return expert_bias_;
}

MoELayerForwardResult MoELayer::forward(const Tensor& x, bool input_requires_grad, const ExecContext& exec) {
  const int64_t H = hidden(), E = num_experts(), k = options_.router.topk;
  const Device device = options_.experts.device;
  const DType dtype = options_.experts.dtype, acc = acc_dtype();
  MOE_CHECK(x.defined() && x.dim() == 2 && x.size(1) == H, ErrorCode::kShape, kForward, ": x: expected [T, H] = [T, ",
            H, "], got ", x.view().describe());
  MOE_CHECK(x.dtype() == dtype, ErrorCode::kDType, kForward, ": x: expected ", dtype_name(dtype),
            " (MoELayerOptions::experts.dtype), got ", dtype_name(x.dtype()));
  MOE_CHECK(x.device() == device, ErrorCode::kDevice, kForward, ": x: expected a tensor on the layer's device ",
            to_string(device), ", got ", x.view().describe());
  const int64_t T = x.size(0);
  const Stream stream = exec.stream;
  auto empty = [&](Shape shape, DType dt) { return Tensor::empty_async(shape, dt, device, stream); };
  const RouterSpec& spec = options_.router;
  const bool aux = spec.aux_loss_coeff > 0, z = spec.z_loss_coeff > 0;

  MoELayerForwardResult r;
  MoELayerContext& c = r.ctx;
  c.logits_ = empty({T, E}, acc);
  c.indices_ = empty({T, k}, DType::kInt32);
  const Tensor probs = empty({T, k}, acc);
  r.counts = empty({E}, DType::kInt64);
  r.loss = empty({}, acc);
  Tensor aux_loss, z_loss;
  if (aux) {
    aux_loss = empty({}, acc);
    c.aux_counts_ = empty({E}, DType::kInt64);
  }
  if (z) z_loss = empty({}, acc);
  const Scratch scratch(std::max(router_forward_workspace_size(T, E), permute_plan_workspace_size(T, k, E)), device,
                        exec);
  const RouterOutputs out{c.logits_, c.indices_, probs,  r.counts,          aux_loss,
                          c.aux_counts_, z_loss,  tokens_per_expert_, r.loss};
  router_forward(x, router_weight_view(), expert_bias_, out, spec, scratch.exec);

  // The routing: each expert's assignments in token order, at most C of them with a capacity factor.
  const bool fixed_exchange = options_.expert_parallel && options_.expert_parallel_capacity_factor;
  Tensor row_of_expert, ids_send;  // fixed-capacity exchange: the layer's own plan, the send rows' ids
  int64_t R = permuted_rows(T, k, E, options_.capacity_factor);
  if (!fixed_exchange || options_.capacity_factor) {
    c.row_of_ = empty({T, k}, DType::kInt32);
    c.splits_ = empty({E}, DType::kInt64);
    c.offsets_ = empty({E + 1}, DType::kInt64);
    if (options_.capacity_factor) r.dropped = empty({E}, DType::kInt64);
    c.groups_ = permute_plan(c.indices_, {c.row_of_, c.splits_, c.offsets_, r.dropped}, options_.capacity_factor,
                             &errors_, scratch.exec);
    r.splits = c.splits_;
  }
  if (fixed_exchange) {
    // The send buffer is the layer's plan from here on: rank d's C rows at [d C, (d + 1) C),
    // assignments the layer's capacity dropped not sent.
    const int64_t P = ep_size_, C = pair_capacity(T, k, P, *options_.expert_parallel_capacity_factor);
    row_of_expert = options_.capacity_factor ? c.row_of_ : Tensor();
    R = P * C;
    c.row_of_ = empty({T, k}, DType::kInt32);
    c.splits_ = empty({P}, DType::kInt64);
    c.offsets_ = empty({P + 1}, DType::kInt64);
    ids_send = empty({R, 1}, DType::kInt32);
    r.dropped = empty({P}, DType::kInt64);
    c.groups_ = send_plan(c.indices_, row_of_expert, local_experts(), C,
                          {c.row_of_, ids_send, c.splits_, c.offsets_, r.dropped}, &errors_, scratch.exec);
    r.splits = c.splits_;
  }

  // x and the probs into expert order (the send buffer's order). Rows past the routed ones are
  // neither written nor read (the fixed exchange's unsent rows travel, marked by their id, unread).
  const Tensor x_sorted = empty({R, H}, dtype), probs_sorted = empty({R}, acc);
  permute(x, probs, c.row_of_, c.groups_, x_sorted, probs_sorted, exec);
  // The experts apply the probs (y_e = FC2(act(FC1 x) p) + p b2, Megatron-LM's place for them), so
  // their output needs no keeping for a probs gradient in unpermute: dprobs comes from the MLP.
  Tensor out_sorted;  // the experts' rows in this rank's expert order
  if (options_.expert_parallel) {
    out_sorted = exchange_forward(c, x_sorted, probs_sorted, ids_send, input_requires_grad, exec);
    if (fixed_exchange) {  // the plan's splits less its last group (rows nothing was sent in)
      r.local_splits = empty({local_experts()}, DType::kInt64);
      copy_tensor(r.local_splits, c.splits_local_.view().slice(0, local_experts()), stream);
    } else {
      r.local_splits = c.splits_local_;
    }
  } else {
    MlpForwardResult mlp = experts_.forward(x_sorted, c.groups_, probs_sorted, input_requires_grad, exec);
    out_sorted = mlp.y;
    c.experts_ = std::move(mlp.ctx);
  }
  r.y = empty({T, H}, dtype);  // unpermute writes every token (zeros where all k were dropped)
  unpermute(out_sorted, {}, c.row_of_, c.groups_, r.y, exec);

  c.input_requires_grad_ = input_requires_grad;
  c.router_backward_ = input_requires_grad || router_weight_.requires_grad;
  // router_backward reads x (dweight = dl^T x; x also sets its shapes); without it, nothing router-side.
  if (c.router_backward_) {
    c.x_ = x;
  } else {
    c.logits_ = c.indices_ = c.aux_counts_ = Tensor();
  }
  c.live_ = true;
  c.owner_ = id_.value;
  return r;
}

// Expert parallelism (docs/design.md section 16).
// - Dropless: x_sorted's routed rows are in expert order, which is destination order (rank p holds
//   experts [p L, (p + 1) L)): the counts per expert go to their ranks, one host read sizes the
//   rows' all-to-all, each source's block arrives in expert order, and each received row's local
//   expert follows from the counts.
// - Fixed capacity: x_sorted is the send buffer, C rows per rank; every exchange has those sizes and
//   the rows' local expert ids (L: nothing sent) travel with them.
// Either way the received rows are sorted by local expert (stable: source order within an expert)
// for the experts, and their outputs go back the same way.
Tensor MoELayer::exchange_forward(MoELayerContext& c, const Tensor& x_sorted, const Tensor& probs_sorted,
                                  const Tensor& ids_send, bool input_requires_grad, const ExecContext& exec) {
  Communicator& comm = *options_.expert_parallel;
  const int P = ep_size_;
  const int64_t L = local_experts(), E = num_experts(), H = hidden(), R = x_sorted.size(0);
  const Device device = options_.experts.device;
  const DType dtype = options_.experts.dtype, acc = acc_dtype();
  const Stream stream = exec.stream;
  auto empty = [&](Shape shape, DType dt) { return Tensor::empty_async(shape, dt, device, stream); };

  const bool fixed = ids_send.defined();
  Tensor ids;  // [N, 1] int32: each received row's local expert
  if (fixed) {
    c.send_rows_ = c.recv_rows_ = std::vector<int64_t>(size_t(P), R / P);
    ids = empty({R, 1}, DType::kInt32);
    comm.all_to_all(ids_send, c.send_rows_, ids, c.recv_rows_, stream);
  } else {
    const std::vector<int64_t> blocks(size_t(P), L);
    const Tensor recv_counts = empty({E}, DType::kInt64);  // [P, L]: source s's rows for local expert l
    comm.all_to_all(c.splits_, blocks, recv_counts, blocks, stream);
    synchronize(stream);  // the dropless exchange's host read
    const Tensor send_host = c.splits_.to(Device::cpu()), recv_host = recv_counts.to(Device::cpu());
    c.send_rows_ = block_sums(send_host, P, L);
    c.recv_rows_ = block_sums(recv_host, P, L);
    // Rank-major blocks, expert order within one.
    Tensor ids_host = Tensor::empty({total(c.recv_rows_), 1}, DType::kInt32);
    int32_t* id = ids_host.data_as<int32_t>();
    const int64_t* rc = recv_host.data_as<int64_t>();
    for (int64_t b = 0; b < E; ++b)
      for (int64_t i = 0; i < rc[b]; ++i) *id++ = int32_t(b % L);
    ids = ids_host.to(device);
  }
  const int64_t sent = total(c.send_rows_), N = total(c.recv_rows_);

  const Tensor x_recv = empty({N, H}, dtype), probs_recv = empty({N, 1}, acc);
  comm.all_to_all(x_sorted.view().slice(0, sent), c.send_rows_, x_recv, c.recv_rows_, stream);
  comm.all_to_all(probs_sorted.view().slice(0, sent), c.send_rows_, probs_recv.view().reshape({N}), c.recv_rows_,
                  stream);

  // The plan that sorts the received rows by local expert; with fixed capacity one group more, of
  // the rows nothing was sent in, which the experts do not compute.
  const int64_t groups = fixed ? L + 1 : L;
  c.row_local_ = empty({N, 1}, DType::kInt32);
  c.splits_local_ = empty({groups}, DType::kInt64);
  c.offsets_local_ = empty({groups + 1}, DType::kInt64);
  {
    const Scratch scratch(permute_plan_workspace_size(N, 1, groups), device, exec);
    c.groups_local_ = permute_plan(ids, {c.row_local_, c.splits_local_, c.offsets_local_, {}}, std::nullopt,
                                   &errors_, scratch.exec);
  }
  GroupLayout expert_groups = c.groups_local_;
  if (fixed) {
    c.offsets_experts_ = empty({L + 1}, DType::kInt64);
    expert_groups = GroupLayout::compute(c.splits_local_.view().slice(0, L), N, c.offsets_experts_, &errors_, stream);
  }
  const Tensor x_local = empty({N, H}, dtype), probs_local = empty({N}, acc);
  permute(x_recv, probs_recv, c.row_local_, c.groups_local_, x_local, probs_local, exec);
  MlpForwardResult mlp = experts_.forward(x_local, expert_groups, probs_local, input_requires_grad, exec);
  c.experts_ = std::move(mlp.ctx);
  const Tensor y_recv = empty({N, H}, dtype);
  unpermute(mlp.y, {}, c.row_local_, c.groups_local_, y_recv, exec);
  const Tensor out_sorted = empty({R, H}, dtype);  // rows past the sent ones: unrouted, never read
  comm.all_to_all(y_recv, c.recv_rows_, out_sorted.view().slice(0, sent), c.send_rows_, stream);
  c.expert_parallel_ = true;
  return out_sorted;
}

MlpBackwardResult MoELayer::exchange_backward(MoELayerContext& c, const Tensor& dy_sorted, const ExecContext& exec) {
  Communicator& comm = *options_.expert_parallel;
  const int64_t H = hidden(), R = dy_sorted.size(0), N = total(c.recv_rows_), sent = total(c.send_rows_);
  const Device device = options_.experts.device;
  const DType dtype = options_.experts.dtype, acc = acc_dtype();
  const Stream stream = exec.stream;
  auto empty = [&](Shape shape, DType dt) { return Tensor::empty_async(shape, dt, device, stream); };

  const Tensor dy_recv = empty({N, H}, dtype), dy_local = empty({N, H}, dtype);
  comm.all_to_all(dy_sorted.view().slice(0, sent), c.send_rows_, dy_recv, c.recv_rows_, stream);
  unpermute_backward(dy_recv, {}, {}, c.row_local_, c.groups_local_, dy_local, {}, exec);
  MlpBackwardResult mlp = experts_.backward(c.experts_, dy_local, exec);
  if (!c.router_backward_) return mlp;  // neither x nor the router weight wants the rows' gradients
  // The rows' gradients back into received order, then to their ranks.
  const Tensor dprobs_recv = empty({N, 1}, acc);
  Tensor dx_recv;
  if (c.input_requires_grad_) {
    dx_recv = empty({N, H}, dtype);
    permute_backward(mlp.dx, mlp.dprobs, c.row_local_, c.groups_local_, dx_recv, dprobs_recv, exec);
  } else {
    // Only dprobs is wanted; the op sums rows too, so give it one zero column to sum.
    const Tensor zero_column = Tensor::zeros_async({N, 1}, dtype, device, stream), unused = empty({N, 1}, dtype);
    permute_backward(zero_column, mlp.dprobs, c.row_local_, c.groups_local_, unused, dprobs_recv, exec);
  }
  mlp.dprobs = empty({R}, acc);  // rows past the sent ones: unrouted, never read
  comm.all_to_all(dprobs_recv.view().reshape({N}), c.recv_rows_, mlp.dprobs.view().slice(0, sent), c.send_rows_,
                  stream);
  if (c.input_requires_grad_) {
    mlp.dx = empty({R, H}, dtype);
    comm.all_to_all(dx_recv, c.recv_rows_, mlp.dx.view().slice(0, sent), c.send_rows_, stream);
  }
  return mlp;
}

MoELayerBackwardResult MoELayer::backward(MoELayerContext& ctx, const Tensor& dy, double d_loss,
                                          const ExecContext& exec) {
  const Device device = options_.experts.device;
  Tensor scale = Tensor::empty_async({}, acc_dtype(), device, exec.stream);
  if (device.is_cpu()) {
    if (scale.dtype() == DType::kFloat64)
      *scale.data_as<double>() = d_loss;
    else
      *scale.data_as<float>() = float(d_loss);
  } else {
    // A constant on the stream, graph safe: lo + (hi - lo) u is lo exactly for lo = hi.
    fill_uniform(scale, 0, float(d_loss), float(d_loss), exec.stream);
  }
  return backward(ctx, dy, scale, exec);
}

MoELayerBackwardResult MoELayer::backward(MoELayerContext& ctx, const Tensor& dy, const Tensor& d_loss,
                                          const ExecContext& exec) {
  MOE_CHECK(ctx.live_, ErrorCode::kInvalidArgument, kBackward,
            ": the context was already used (or comes from no forward)");
  MOE_CHECK(ctx.owner_ == id_.value, ErrorCode::kInvalidArgument, kBackward,
            ": the context comes from another layer's forward");
  const int64_t H = hidden(), E = num_experts(), k = options_.router.topk;
  const int64_t T = ctx.row_of_.size(0), R = ctx.groups_.capacity();
  const Device device = options_.experts.device;
  const DType dtype = options_.experts.dtype, acc = acc_dtype();
  MOE_CHECK(dy.defined() && dy.dim() == 2 && dy.size(0) == T && dy.size(1) == H, ErrorCode::kShape, kBackward,
            ": dy: expected [T, H] = [", T, ", ", H, "] like forward's x, got ", dy.view().describe());
  MOE_CHECK(dy.dtype() == dtype, ErrorCode::kDType, kBackward, ": dy: expected ", dtype_name(dtype), ", got ",
            dtype_name(dy.dtype()));
  MOE_CHECK(dy.device() == device, ErrorCode::kDevice, kBackward, ": dy: expected a tensor on the layer's device ",
            to_string(device), ", got ", dy.view().describe());
  if (d_loss.defined()) {
    MOE_CHECK(d_loss.dim() == 0 && d_loss.dtype() == acc && d_loss.device() == device, ErrorCode::kShape, kBackward,
              ": d_loss: expected a 0-dim ", dtype_name(acc), " tensor on ", to_string(device), " (the loss's), got ",
              d_loss.view().describe());
  }
  const bool router_weight_grad = ctx.router_backward_ && router_weight_.requires_grad;
  if (router_weight_grad) router_grad_.check_main_grad(router_weight_, kBackward);
  const Stream stream = exec.stream;
  auto empty = [&](Shape shape, DType dt) { return Tensor::empty_async(shape, dt, device, stream); };

  // unpermute without probs: each of a token's kept rows gets dy[t], bit for bit.
  const Tensor dy_sorted = empty({R, H}, dtype);
  unpermute_backward(dy, {}, {}, ctx.row_of_, ctx.groups_, dy_sorted, {}, exec);
  MlpBackwardResult mlp;
  if (ctx.expert_parallel_) {
    mlp = exchange_backward(ctx, dy_sorted, exec);
  } else {
    mlp = experts_.backward(ctx.experts_, dy_sorted, exec);
  }
  ctx.live_ = false;

  MoELayerBackwardResult r;
  r.fc1_weight = std::move(mlp.fc1_weight);
  r.fc1_bias = std::move(mlp.fc1_bias);
  r.fc2_weight = std::move(mlp.fc2_weight);
  r.fc2_bias = std::move(mlp.fc2_bias);
  if (ctx.router_backward_) {
    // permute's backward: dx[t] = sum_j dx_sorted[row(t, j)] (float32, j in order, rounded once) and
    // the probs' gradient d_probs[t, j] = dprobs_sorted[row(t, j)] (0 where dropped).
    const Tensor d_probs = empty({T, k}, acc);
    Tensor dx_sorted = mlp.dx, dx;
    if (ctx.input_requires_grad_) {
      dx = r.dx = empty({T, H}, dtype);
    } else {
      // Only d_probs is wanted; the op sums rows too, so give it one zero column to sum.
      dx_sorted = Tensor::zeros_async({R, 1}, dtype, device, stream);
      dx = empty({T, 1}, dtype);
    }
    permute_backward(dx_sorted, mlp.dprobs, ctx.row_of_, ctx.groups_, dx, d_probs, exec);
    // The router: d_probs and the losses' gradient (loss = aux + z: both get d_loss). Its dx is
    // added into permute's, dx = round(permute's dx + float32 sum_e dl_e W_e) (on Hopper's grouped
    // GEMM the sum rounded first): deterministic.
    RouterOutputGrads d_out{d_probs, {}, {}};
    if (d_loss.defined()) {
      if (ctx.aux_counts_.defined()) d_out.d_aux_loss = d_loss;
      if (options_.router.z_loss_coeff > 0) d_out.d_z_loss = d_loss;
    }
    RouterGrads grads;
    if (ctx.input_requires_grad_) {
      grads.dx = r.dx;
      grads.accumulate_dx = true;
    }
    if (router_weight_grad) {
      const ParamGrad target = router_grad_.immediate(router_weight_, r.router_weight, exec);
      grads.dweight = target.grad.expert(0);
      grads.dweight_mode = target.mode;
    }
    const Scratch scratch(router_backward_workspace_size(T, E, H, dtype), device, exec);
    router_backward(d_out, ctx.x_, router_weight_view(), ctx.logits_, ctx.indices_, ctx.aux_counts_, grads,
                    options_.router, scratch.exec);
  }
  ctx.x_ = ctx.logits_ = ctx.indices_ = ctx.aux_counts_ = Tensor();
  ctx.row_of_ = ctx.splits_ = ctx.offsets_ = Tensor();
  ctx.groups_ = GroupLayout();
  ctx.row_local_ = ctx.splits_local_ = ctx.offsets_local_ = ctx.offsets_experts_ = Tensor();
  ctx.groups_local_ = GroupLayout();
  return r;
}

void MoELayer::update_expert_bias(float rate, const ExecContext& exec) {
  MOE_CHECK(expert_bias_.defined(), ErrorCode::kInvalidArgument,
            "MoELayer.update_expert_bias: the layer has no expert bias (MoELayerOptions::expert_bias is false)");
  router_update_expert_bias(expert_bias_, tokens_per_expert_, rate, exec);
  fill_bytes(tokens_per_expert_, 0, exec.stream);
}

std::map<std::string, Tensor> MoELayer::state_dict(const std::string& prefix) const {
  std::map<std::string, Tensor> out = experts_.state_dict(prefix + "experts.");
  out[prefix + "router.weight"] = router_weight_.storage().packed().reshape({num_experts(), hidden()});
  if (expert_bias_.defined()) out[prefix + "router.expert_bias"] = expert_bias_;
  return out;
}

void MoELayer::load_state_dict(std::map<std::string, Tensor> state, const std::string& prefix,
                               std::optional<GluLayout> glu_from) {
  const std::string experts_prefix = prefix + "experts.";
  std::map<std::string, Tensor> experts_state;
  for (auto it = state.begin(); it != state.end();) {
    if (it->first.starts_with(experts_prefix)) {
      experts_state.insert(*it);
      it = state.erase(it);
    } else {
      ++it;
    }
  }
  // [E, H] (Megatron's) or [1, E, H] (the parameter's storage).
  detail::import_param(state, prefix + "router.weight", router_weight_.storage());
  if (expert_bias_.defined()) {
    const std::string key = prefix + "router.expert_bias";
    const auto it = state.find(key);
    MOE_CHECK(it != state.end(), ErrorCode::kInvalidArgument, "MoELayer.load_state_dict: missing key '", key,
              "' (expected ", expert_bias_.view().describe(), ")");
    MOE_CHECK(it->second.shape() == expert_bias_.shape(), ErrorCode::kShape, "MoELayer.load_state_dict: key '", key,
              "' is ", it->second.view().describe(), ", expected shape ", expert_bias_.shape().to_string());
    MOE_CHECK(it->second.dtype() == expert_bias_.dtype(), ErrorCode::kDType, "MoELayer.load_state_dict: key '", key,
              "' is ", dtype_name(it->second.dtype()), ", expected ", dtype_name(expert_bias_.dtype()));
    copy_tensor(expert_bias_, it->second);
    if (expert_bias_.device().is_cuda()) synchronize(nullptr);
    state.erase(it);
  }
  detail::check_no_unexpected_keys(state, prefix, "MoELayer.load_state_dict");
  experts_.load_state_dict(std::move(experts_state), experts_prefix, glu_from);
}

}  // namespace moe
