#include "worker/parallel/param_store.h"

#include <cmath>
#include <cstdio>
#include <exception>

#include <ATen/ops/_foreach_norm.h>
#include <c10/util/Exception.h>

#include "worker/model/fused_kernels.h"
#include "worker/torch_compat.h"

namespace ltrain::worker {

void ParamStore::ClearFailure() {
  if (queue_) queue_->ClearError();
  if (update_queue_) update_queue_->ClearError();
}

ParamStore::ParamStore(std::vector<Param> params, int zero, Communicator* dp, AdamWConfig adamw)
    : params_(std::move(params)), zero_(zero), dp_(dp), adamw_(adamw) {}

ParamStore::~ParamStore() {
  // The hooks point at this object: remove them before it goes.
  for (auto& acc : accumulators_) acc->post_hooks().clear();
  if (queue_) (void)queue_->WaitAll();
}

StatusOr<std::unique_ptr<ParamStore>> ParamStore::Create(std::vector<Param> params,
                                                         const std::vector<std::vector<int>>& units, int zero,
                                                         Communicator* dp, AdamWConfig adamw, bool bf16_compute,
                                                         bool exclusive_collectives, bool inline_on_own_stream,
                                                         Communicator* expert_dp) {
  if (zero < 0 || zero > 3) return InvalidArgument("parallel.zero=" + std::to_string(zero) + " is not 0, 1, 2 or 3");
  std::unique_ptr<ParamStore> store(new ParamStore(std::move(params), zero, dp, adamw));
  const torch::Device device = store->params_.empty() ? torch::Device(torch::kCPU) : store->params_[0].value->device();
  const bool collectives = dp->size() > 1;
  store->queue_ = std::make_unique<ReductionQueue>(collectives && !exclusive_collectives, device,
                                                   collectives && (!exclusive_collectives || inline_on_own_stream));
  std::vector<int64_t> numels;
  for (const Param& p : store->params_) numels.push_back(p.value->numel());
  store->unit_of_.assign(store->params_.size(), -1);
  torch::NoGradGuard no_grad;
  for (const std::vector<int>& members : units) {
    Unit unit;
    if (members.empty()) return InvalidArgument("a unit of no parameters");
    const bool expert = store->params_[members.front()].expert;
    for (int i : members) {
      if (i < 0 || i >= static_cast<int>(store->params_.size())) return InvalidArgument("no parameter " + std::to_string(i));
      if (store->params_[i].expert != expert) {
        return InvalidArgument("unit of parameters " + std::to_string(members.front()) + "..." +
                               std::to_string(members.back()) + " mixes expert parameters with others");
      }
    }
    unit.comm = expert && expert_dp != nullptr ? expert_dp : dp;
    store->expert_units_ = store->expert_units_ || unit.comm != dp;
    unit.layout = LayoutUnit(members, numels, unit.comm->size());
    const torch::Tensor& first = *store->params_[members.front()].value;
    torch::TensorOptions options = first.options().requires_grad(false);
    unit.full = torch::zeros({unit.layout.padded}, options);
    for (size_t k = 0; k < members.size(); ++k) {
      const int i = members[k];
      if (store->unit_of_[i] != -1) return InvalidArgument("parameter " + std::to_string(i) + " is in two units");
      store->unit_of_[i] = static_cast<int>(store->units_.size());
      torch::Tensor& value = *store->params_[i].value;
      torch::Tensor slot = unit.full.narrow(0, unit.layout.offsets[k], value.numel());
      slot.copy_(value.detach().reshape(-1));
      value = slot.view(value.sizes()).detach().requires_grad_(true);
    }
    torch::TensorOptions grad_options = options;
    if (bf16_compute) {
      unit.compute = unit.full.to(torch::kBFloat16);
      grad_options = unit.compute.options();
      for (size_t k = 0; k < members.size(); ++k) {
        torch::Tensor& value = *store->params_[members[k]].value;
        value = unit.compute.narrow(0, unit.layout.offsets[k], value.numel()).view(value.sizes()).detach().requires_grad_(true);
      }
    }
    const int64_t state = zero == 0 ? unit.layout.padded : unit.layout.shard;
    unit.exp_avg = torch::zeros({state}, options);
    unit.exp_avg_sq = torch::zeros({state}, options);
    if (zero < 2) {
      unit.grad_full = torch::zeros({unit.layout.padded}, grad_options);
      for (size_t k = 0; k < members.size(); ++k) {
        torch::Tensor& value = *store->params_[members[k]].value;
        value.mutable_grad() = unit.grad_full.narrow(0, unit.layout.offsets[k], value.numel()).view(value.sizes());
      }
    } else {
      // On CUDA the gradient shard is made by the step's first reduction (Launch) and dropped by
      // ZeroGrads: the forward before it runs without it (as FSDP's, whose gradients are set to none).
      if (!options.device().is_cuda()) unit.grad_shard = torch::zeros({unit.layout.shard}, options);
    }
    if (zero == 3) {
      // Only the shard stays: released unit by unit, the model's full parameters are never all
      // held twice. With bf16 copies the fp32 values are gathered only for an export
      // (GatherMasterUnit).
      Range own = store->Owned(unit);
      unit.shard = unit.full.narrow(0, own.begin, own.size()).clone();
      compat::ResizeStorage(unit.compute.defined() ? unit.compute : unit.full, 0);
      if (unit.compute.defined()) compat::ResizeStorage(unit.full, 0);
      unit.gathered = false;
    }
    store->units_.push_back(std::move(unit));
  }
  for (size_t i = 0; i < store->params_.size(); ++i) {
    if (store->unit_of_[i] == -1) return InvalidArgument("parameter " + std::to_string(i) + " is in no unit");
    ParamStore* self = store.get();
    const int index = static_cast<int>(i);
    store->accumulators_.push_back(compat::AddGradReadyHook(*store->params_[i].value, [self, index] { self->OnGradReady(index); }));
  }
  return store;
}

Range ParamStore::Owned(const Unit& unit) const {
  if (zero_ == 0) return Range{0, unit.layout.padded};
  const int64_t s = unit.layout.shard;
  return Range{s * unit.comm->rank(), s * (unit.comm->rank() + 1)};
}

torch::Tensor ParamStore::OwnedGrad(Unit& unit) {
  if (zero_ >= 2) return unit.grad_shard;
  Range own = Owned(unit);
  return unit.grad_full.narrow(0, own.begin, own.size());
}

bool ParamStore::sharded_update() const {
  return (zero_ == 1 || zero_ == 2) && dp_->size() > 1 && !units_.empty() && units_.front().compute.defined();
}

torch::Tensor ParamStore::OwnedCompute(Unit& unit) {
  Range own = Owned(unit);
  return unit.compute.narrow(0, own.begin, own.size());
}

Status ParamStore::SyncMasters() {
  if (!masters_stale_) return Status::Ok();
  torch::NoGradGuard no_grad;
  for (Unit& unit : units_) {
    torch::Tensor mine = OwnedParam(unit).clone(), full = unit.full;
    Communicator* comm = unit.comm;
    queue_->Enqueue([comm, mine, full]() mutable { return comm->AllGather(mine, full); });
  }
  Status s = queue_->WaitAll();
  if (s.ok()) masters_stale_ = false;
  return s;
}

torch::Tensor ParamStore::OwnedParam(Unit& unit) {
  if (zero_ == 3) return unit.shard;
  Range own = Owned(unit);
  return unit.full.narrow(0, own.begin, own.size());
}

Status ParamStore::BroadcastParameters() {
  if (zero_ == 3) return Status::Ok();
  torch::NoGradGuard no_grad;
  for (Unit& unit : units_) {
    LTRAIN_RETURN_IF_ERROR(unit.comm->Broadcast(unit.full, 0));
  }
  RefreshCompute();
  return Status::Ok();
}

Status ParamStore::BroadcastState(int root) {
  if (zero_ != 0) {
    return FailedPrecondition("the training state is sharded (ZeRO " + std::to_string(zero_) +
                              "): no rank holds a whole copy to fill a replacement from");
  }
  if (expert_units_) {
    return FailedPrecondition("experts split over expert-parallel ranks have no copy on every data-parallel rank");
  }
  torch::NoGradGuard no_grad;
  LTRAIN_RETURN_IF_ERROR(AwaitUpdates());
  for (Unit& unit : units_) {
    for (torch::Tensor* t : {&unit.full, &unit.exp_avg, &unit.exp_avg_sq}) {
      if (t->defined()) LTRAIN_RETURN_IF_ERROR(dp_->Broadcast(*t, root));
    }
  }
  RefreshCompute();
  return Status::Ok();
}

std::vector<torch::Tensor> ParamStore::OwnedState() {
  std::vector<torch::Tensor> out;
  for (Unit& unit : units_) {
    out.push_back(OwnedParam(unit));
    for (torch::Tensor* t : {&unit.exp_avg, &unit.exp_avg_sq}) {
      if (t->defined()) out.push_back(*t);
    }
  }
  return out;
}

Status ParamStore::GatherOwned() {
  if (zero_ == 1 || zero_ == 2) {
    masters_stale_ = true;
    LTRAIN_RETURN_IF_ERROR(SyncMasters());
  }
  RefreshCompute();
  return Status::Ok();
}

void ParamStore::RefreshCompute() {
  // ZeRO-3 casts each gathered shard instead (Prefetch).
  if (zero_ == 3) return;
  torch::NoGradGuard no_grad;
  for (Unit& unit : units_) {
    if (unit.compute.defined()) unit.compute.copy_(unit.full);
  }
}

int64_t ParamStore::OffsetInUnit(int param) const {
  const Unit& unit = units_[unit_of_[param]];
  for (size_t k = 0; k < unit.layout.params.size(); ++k) {
    if (unit.layout.params[k] == param) return unit.layout.offsets[k];
  }
  return 0;
}

torch::Tensor ParamStore::MasterValue(int param) const {
  const torch::Tensor& value = *params_[param].value;
  const Unit& unit = units_[unit_of_[param]];
  if (!unit.compute.defined()) return value.detach();
  return unit.full.narrow(0, OffsetInUnit(param), value.numel()).view(value.sizes());
}

void ParamStore::ZeroUnitGrads(Unit& unit, bool zero, std::vector<torch::Tensor>* stale) {
  // Runs of adjacent parameters: zeroed, or (gradients only the products write) left to the
  // products' first write; the padding past the last parameter is zeroed once, at creation.
  int64_t run_at = 0, run_n = 0;
  bool run_products = false;
  auto flush = [&] {
    if (run_n == 0) return;
    if (zero && !run_products) unit.grad_full.narrow(0, run_at, run_n).zero_();
    run_n = 0;
  };
  for (size_t k = 0; k < unit.layout.params.size(); ++k) {
    const Param& p = params_[unit.layout.params[k]];
    const int64_t at = unit.layout.offsets[k], n = p.value->numel();
    const bool products = p.product_grad && p.value->grad().defined();
    if (products && stale != nullptr) stale->push_back(p.value->grad());
    if (run_n > 0 && (products != run_products || at != run_at + run_n)) flush();
    if (run_n == 0) run_at = at, run_products = products;
    run_n += n;
  }
  flush();
}

void ParamStore::ZeroGrads(bool one_backward) {
  torch::NoGradGuard no_grad;
  one_backward_ = one_backward;
  std::vector<torch::Tensor> stale;
  for (Unit& unit : units_) {
    if (zero_ >= 2 && unit.full.is_cuda()) {
      unit.grad_shard = torch::Tensor();
    } else if (zero_ >= 2) {
      // On the CPU it stays (the memory plan counts it apart from the step's heap), unzeroed: the
      // step's first reduction overwrites it, queued after the gather that runs a pending update
      // reading it.
    } else if (transient_) {
      // Left by a step without an update (a drill's, a failed one): made again in backward. A
      // deferred update still reading them holds them itself.
      DropGradients(unit);
    } else {
      ZeroUnitGrads(unit, /*zero=*/!unit.grads_zeroed, &stale);
      unit.grads_zeroed = false;
    }
    unit.pending = static_cast<int>(unit.layout.params.size());
    unit.launched = false;
    unit.shard_written = false;
  }
  MarkGradientsStale(stale);
  // ZeRO-3: the forward's first unit (the embedding, last in backward order) is gathered while the
  // host gets the batch ready. Not earlier, after the update: between steps the trainer runs
  // collectives of its own (checkpoints, the final barrier) on communicators the data-parallel
  // group may share, and two threads must not issue on one.
  if (zero_ == 3) Prefetch(units() - 1);
}

void ParamStore::ArmHooks(bool armed) {
  armed_ = armed;
  for (Unit& unit : units_) {
    unit.pending = static_cast<int>(unit.layout.params.size());
    unit.launched = false;
  }
}

void ParamStore::OnGradReady(int param) {
  if (!armed_) return;
  Unit& unit = units_[unit_of_[param]];
  if (--unit.pending == 0 && !unit.launched) Launch(unit_of_[param]);
}

void ParamStore::Launch(int u) {
  Unit& unit = units_[u];
  unit.launched = true;
  const int dp = unit.comm->size();
  Communicator* comm = unit.comm;
  if (zero_ < 2) {
    if (dp == 1) return;
    torch::Tensor grads = unit.grad_full;
    if (sharded_update()) {
      // Only the owned shard's mean is needed: half an all-reduce's traffic.
      const Range own = Owned(unit);
      queue_->Enqueue([comm, grads, own]() mutable {
        torch::NoGradGuard no_grad;
        torch::Tensor mine = grads.narrow(0, own.begin, own.size());
        return comm->ReduceScatterMean(grads, mine);
      });
      return;
    }
    queue_->Enqueue([comm, grads]() mutable {
      torch::NoGradGuard no_grad;
      return comm->AllReduceMean(grads);
    });
    return;
  }
  // The step's first reduction writes the shard (one pass, no zeroing); later ones add to it. Where
  // nothing will add to it (one backward a step) and the unit's gradients share one buffer, the shard
  // is the reduction's mean itself, in the buffer's dtype: the optimizer and the norm read bf16
  // gradients as they do under ZeRO-1. Else it is fp32, as the masters.
  const bool add = unit.shard_written;
  unit.shard_written = true;
  const bool mean_only = one_backward_ && !add && unit.grad_flat.defined();
  const torch::TensorOptions shard_options = mean_only ? unit.grad_flat.options() : unit.full.options();
  if (!unit.grad_shard.defined() || (!add && unit.grad_shard.dtype() != shard_options.dtype())) {
    unit.grad_shard = torch::empty({unit.layout.shard}, shard_options);
  }
  torch::Tensor shard = unit.grad_shard;
  if (unit.grad_flat.defined()) {
    // The unit's gradients are views of one buffer: reduce-scattered from it as they are (bf16
    // with bf16 copies).
    // The leaves let go of it now, so that it is freed once the collective has read it.
    torch::Tensor flat = unit.grad_flat;
    unit.grad_flat = torch::Tensor();
    for (int i : unit.layout.params) params_[i].value->mutable_grad() = torch::Tensor();
    const int64_t n = unit.layout.shard;
    if (mean_only) {
      queue_->Enqueue([comm, flat, shard]() mutable {
        torch::NoGradGuard no_grad;
        compat::RecordCurrentStream(flat);
        return comm->ReduceScatterMean(flat, shard);
      });
      Release(u);
      return;
    }
    queue_->Enqueue([comm, flat, shard, n, dp, add]() mutable {
      torch::NoGradGuard no_grad;
      compat::RecordCurrentStream(flat);
      // In place, into this rank's chunk of the buffer: no memory of its own.
      torch::Tensor mine = flat.narrow(0, comm->rank() * n, n);
      LTRAIN_RETURN_IF_ERROR(comm->ReduceScatterSum(flat, mine));
      if (add) {
        shard.add_(mine, 1.0 / dp);
      } else if ((dp & (dp - 1)) == 0) {
        // 1/dp is exact in bf16: the mean is written in one pass (in mine's dtype, exactly).
        at::mul_out(shard, mine, at::scalar_tensor(1.0 / dp, mine.options()));
      } else {
        shard.copy_(mine);
        shard.mul_(1.0 / dp);
      }
      return Status::Ok();
    });
    Release(u);
    return;
  }
  // zero >= 2: the gradients live in the leaves' own .grad tensors; hand them to the job.
  std::vector<torch::Tensor> grads;
  for (int i : unit.layout.params) grads.push_back(params_[i].value->grad());
  UnitLayout layout = unit.layout;
  queue_->Enqueue([comm, grads, layout, shard, dp, add]() mutable {
    torch::NoGradGuard no_grad;
    torch::Tensor flat = torch::zeros({layout.padded}, shard.options());
    for (size_t k = 0; k < grads.size(); ++k) {
      if (grads[k].defined()) flat.narrow(0, layout.offsets[k], grads[k].numel()).copy_(grads[k].reshape(-1));
    }
    torch::Tensor mine = torch::empty({layout.shard}, shard.options());
    LTRAIN_RETURN_IF_ERROR(comm->ReduceScatterSum(flat, mine));
    if (dp > 1) mine.div_(dp);
    if (add) {
      shard.add_(mine);
    } else {
      shard.copy_(mine);
    }
    return Status::Ok();
  });
  // Under zero 3 the unit's full parameters are not needed again in this backward.
  Release(u);
}

Status ParamStore::FinishBackward() {
  MakeAllGradients();
  ZeroStaleGradients();
  if (armed_) {
    for (int u = 0; u < units(); ++u) {
      if (!units_[u].launched) Launch(u);
    }
  }
  Status s = queue_->WaitAll();
  if (armed_ && zero_ >= 2) {
    for (Param& p : params_) p.value->mutable_grad() = torch::Tensor();
  }
  for (Unit& unit : units_) {
    unit.pending = static_cast<int>(unit.layout.params.size());
    unit.launched = false;
  }
  return s;
}

Status ParamStore::ReduceAll() {
  const bool was = armed_;
  armed_ = true;
  for (int u = 0; u < units(); ++u) Launch(u);
  Status s = FinishBackward();
  armed_ = was;
  return s;
}

void ParamStore::ForEachOwned(const Unit& unit,
                              const std::function<void(const Param&, int64_t at, int64_t n)>& fn) const {
  const Range own = Owned(unit);
  for (size_t k = 0; k < unit.layout.params.size(); ++k) {
    const Param& p = params_[unit.layout.params[k]];
    const int64_t off = unit.layout.offsets[k];
    const Range seg = Intersect(own, Range{off, off + p.value->numel()});
    if (seg.size() > 0) fn(p, seg.begin - own.begin, seg.size());
  }
}

torch::Tensor ParamStore::GradSquareSum() {
  torch::NoGradGuard no_grad;
  // Summed on the device, one value brought back: on CUDA from fp32 norms of every segment (one
  // kernel, as clip_grad_norm_ does), on the CPU from squares in double.
  // Adjacent counted parameters of a unit make one segment (fewer, longer ones for the kernel).
  std::vector<torch::Tensor> sums, segments;
  std::vector<double> weights;  // of the segments
  for (Unit& unit : units_) {
    torch::Tensor grad = OwnedGrad(unit);
    // Without ZeRO, with expert units: each rank's share of the elements its group holds alike.
    const double weight = zero_ == 0 && expert_units_ ? 1.0 / unit.comm->size() : 1.0;
    int64_t run_at = 0, run_n = 0;
    auto flush = [&] {
      if (run_n == 0) return;
      torch::Tensor g = grad.narrow(0, run_at, run_n);
      if (g.is_cuda()) {
        segments.push_back(g);
        weights.push_back(weight);
      } else {
        torch::Tensor sum = g.to(torch::kDouble).square().sum();
        sums.push_back(weight == 1.0 ? sum : sum * weight);
      }
      run_n = 0;
    };
    ForEachOwned(unit, [&](const Param& p, int64_t at, int64_t n) {
      if (!p.counts_for_norm || (run_n > 0 && at != run_at + run_n)) flush();
      if (!p.counts_for_norm) return;
      if (run_n == 0) run_at = at;
      run_n += n;
    });
    flush();
  }
  if (!segments.empty()) {
    torch::Tensor squares = torch::stack(at::_foreach_norm(segments)).to(torch::kDouble).square();
    if (expert_units_ && zero_ == 0) {
      squares = squares * torch::tensor(weights, torch::TensorOptions().dtype(torch::kDouble)).to(squares.device());
    }
    sums.push_back(squares.sum());
  }
  if (sums.empty()) {
    const torch::Device device = units_.empty() ? torch::Device(torch::kCPU) : units_.front().full.device();
    return torch::zeros({1}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  }
  return torch::stack(sums).sum().reshape({1});
}

Status ParamStore::AwaitCompute(int u) {
  if (u < 0 || u >= units()) return Status::Ok();
  Unit& unit = units_[u];
  if (unit.update_job != 0) {
    const int64_t job = unit.update_job;
    unit.update_job = 0;
    LTRAIN_RETURN_IF_ERROR(update_queue_->Wait(job));
  }
  if (unit.compute_job == 0) return Status::Ok();
  Status s = queue_->Wait(unit.compute_job);
  unit.compute_job = 0;
  return s;
}

void ParamStore::UpdateUnit(Unit& unit, const torch::Tensor& grad, const AdamWConfig& adamw, double lr, double b1,
                            double b2, int64_t step, const torch::Tensor& divisor, const torch::Tensor& copy_into) {
  torch::Tensor param = OwnedParam(unit);
  const bool sharded = sharded_update();
  // The kernel also writes the owned part of the bf16 copies (zero 0: all of them; zero 3: where
  // the gather hands it `copy_into`).
  torch::Tensor copy = copy_into.defined() ? copy_into : zero_ == 0 || sharded ? OwnedCompute(unit) : torch::Tensor();
  // One launch per run of adjacent parameters of one weight-decay class (a Llama layer: 4, not 9).
  int64_t run_at = 0, run_n = 0;
  bool run_decay = false;
  auto flush = [&] {
    if (run_n == 0) return;
    FusedAdamW(param.narrow(0, run_at, run_n), grad.narrow(0, run_at, run_n), unit.exp_avg.narrow(0, run_at, run_n),
               unit.exp_avg_sq.narrow(0, run_at, run_n),
               copy.defined() ? copy.narrow(0, run_at, run_n) : torch::Tensor(), lr, b1, b2, adamw.eps,
               run_decay ? adamw.weight_decay : 0.0, step, divisor);
    run_n = 0;
  };
  ForEachOwned(unit, [&](const Param& p, int64_t at, int64_t n) {
    if (run_n > 0 && (p.decay != run_decay || at != run_at + run_n)) flush();
    if (run_n == 0) run_at = at, run_decay = p.decay;
    run_n += n;
  });
  flush();
}

bool ParamStore::can_defer_update() const {
  return zero_ == 0 && !units_.empty() && units_.front().compute.defined() && FusedAdamWAvailable(units_.front().full);
}

Status ParamStore::AwaitUpdates() {
  bool pending = false;
  for (Unit& unit : units_) {
    std::function<bool(const torch::Tensor&)> update = TakePendingUpdate(unit);
    if (!update) continue;
    pending = true;
    queue_->Enqueue([update]() {
      update(torch::Tensor());
      return Status::Ok();
    });
  }
  if (pending) LTRAIN_RETURN_IF_ERROR(queue_->WaitAll());
  for (int u = 0; u < units(); ++u) LTRAIN_RETURN_IF_ERROR(AwaitCompute(u));
  return Status::Ok();
}

bool ParamStore::ApplyDeferred(Unit& unit, const torch::Tensor& grad, const DeferredUpdate& u, const torch::Tensor& copy) {
  torch::NoGradGuard no_grad;
  if (u.own_kernel) {
    UpdateUnit(unit, grad, adamw_, u.lr, adamw_.beta1, adamw_.beta2, u.step, u.divisor, copy);
    return copy.defined();
  }
  UpdateComposite({{&unit, grad}}, u);
  return false;
}

std::function<bool(const torch::Tensor&)> ParamStore::TakePendingUpdate(Unit& unit) {
  if (!unit.update_pending) return {};
  unit.update_pending = false;
  torch::Tensor grad = std::move(unit.pending_grad);  // leaves the unit's undefined
  Unit* target = &unit;
  const DeferredUpdate u = deferred_;
  return [this, target, grad, u](const torch::Tensor& copy) {
    // Read on this stream, allocated on the computation's: the allocator must not hand the memory
    // on before this stream is done with it.
    compat::RecordCurrentStream(grad);
    if (u.divisor.defined()) compat::RecordCurrentStream(u.divisor);
    return ApplyDeferred(*target, grad, u, copy);
  };
}

void ParamStore::UpdateComposite(const std::vector<std::pair<Unit*, torch::Tensor>>& units, const DeferredUpdate& u) {
  if (units.empty()) return;
  const double b1 = adamw_.beta1, b2 = adamw_.beta2, lr = u.lr;
  const double bias1 = 1 - std::pow(b1, static_cast<double>(u.step));
  const double bias2 = 1 - std::pow(b2, static_cast<double>(u.step));
  const torch::TensorOptions f32 = torch::TensorOptions().dtype(torch::kFloat).device(units.front().first->full.device());
  // The owned segment of every parameter, by weight-decay class: [decays][w, g, m, v].
  std::vector<torch::Tensor> lists[2][4];
  for (const auto& [unit, unit_grad] : units) {
    torch::Tensor grad = unit_grad, param = OwnedParam(*unit);
    // bf16 gradients (bf16_compute, zero < 2) meet the fp32 masters as fp32.
    if (grad.scalar_type() != param.scalar_type()) grad = grad.to(param.scalar_type());
    ForEachOwned(*unit, [&](const Param& p, int64_t at, int64_t n) {
      auto& l = lists[p.decay ? 1 : 0];
      l[0].push_back(param.narrow(0, at, n));
      l[1].push_back(grad.narrow(0, at, n));
      l[2].push_back(unit->exp_avg.narrow(0, at, n));
      l[3].push_back(unit->exp_avg_sq.narrow(0, at, n));
    });
  }
  for (int decay = 0; decay < 2; ++decay) {
    auto& l = lists[decay];
    if (l[0].empty()) continue;
    // On CUDA: one kernel per class over every segment.
    if (compat::FusedAdamW(l[0], l[1], l[2], l[3], torch::full({}, static_cast<double>(u.step), f32), lr, b1, b2,
                           decay ? adamw_.weight_decay : 0.0, adamw_.eps, u.divisor)) {
      continue;
    }
    for (size_t i = 0; i < l[0].size(); ++i) {
      torch::Tensor w = l[0][i], g = l[1][i], m = l[2][i], v = l[3][i];
      if (u.grad_scale != 1.0) g.mul_(u.grad_scale);
      if (u.grad_divisor.defined()) g.div_(u.grad_divisor.reshape({}));
      // torch::optim::AdamW's update, element for element.
      if (decay) w.mul_(1 - lr * adamw_.weight_decay);
      m.mul_(b1).add_(g, 1 - b1);
      v.mul_(b2).addcmul_(g, g, 1 - b2);
      torch::Tensor denom = (v.sqrt() / std::sqrt(bias2)).add_(adamw_.eps);
      w.addcdiv_(m, denom, -lr / bias1);
    }
  }
}

Status ParamStore::OptimizerStep(double lr, double grad_scale, int64_t step, const torch::Tensor& grad_divisor,
                                 bool defer_compute) {
  torch::NoGradGuard no_grad;
  const double b1 = adamw_.beta1, b2 = adamw_.beta2;
  // bf16 compute copies on CUDA: our kernel, one pass per segment that also writes the bf16 copy of
  // the owned elements (zero 0: all of them; a sharded update then all-gathers the copies).
  if (units_.empty()) return Status::Ok();
  const bool own_kernel = units_.front().compute.defined() && FusedAdamWAvailable(units_.front().full);
  const bool sharded = sharded_update();
  // For the fused kernels: clipping as one device scalar the gradients are divided by (undefined:
  // none).
  const torch::TensorOptions f32 = torch::TensorOptions().dtype(torch::kFloat).device(units_.front().full.device());
  torch::Tensor divisor = grad_divisor.defined() ? grad_divisor.reshape({}).to(f32) : torch::Tensor();
  if (grad_scale != 1.0) divisor = divisor.defined() ? divisor / grad_scale : torch::full({}, 1.0 / grad_scale, f32);
  if (zero_ == 3 && defer_compute) {
    // Each unit's update runs in its next gather's job (TakePendingUpdate), on the gradients of now.
    deferred_ = DeferredUpdate{lr, grad_scale, step, grad_divisor, divisor, own_kernel};
    for (Unit& unit : units_) {
      unit.update_pending = true;
      unit.pending_grad = OwnedGrad(unit);
    }
    return Status::Ok();
  }
  if (own_kernel && zero_ == 0 && defer_compute) {
    // In forward order, each unit a job on the update queue's stream (ordered after this stream's
    // backward): the next forward waits for a unit's job just before using it (AwaitCompute).
    if (!update_queue_) update_queue_ = std::make_unique<ReductionQueue>(/*threaded=*/true, units_.front().full.device(), /*own_stream=*/true);
    update_divisor_ = divisor;
    const bool transient = transient_;
    for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
      Unit* unit = &*it;
      const AdamWConfig adamw = adamw_;
      // Transient gradients: the job alone holds the unit's; they are freed when it ends, and the
      // allocator gives their memory out again once the update's stream has read them.
      torch::Tensor grad = OwnedGrad(*unit);
      if (transient) {
        DropGradients(*unit);
      } else {
        unit->grads_zeroed = true;
      }
      unit->update_job = update_queue_->Enqueue([this, unit, grad, transient, adamw, divisor, lr, b1, b2, step]() {
        torch::NoGradGuard no_grad;
        UpdateUnit(*unit, grad, adamw, lr, b1, b2, step, divisor);
        if (transient) {
          compat::RecordCurrentStream(grad);
        } else {
          ZeroUnitGrads(*unit, /*zero=*/true, nullptr);
        }
        return Status::Ok();
      });
    }
    return Status::Ok();
  }
  if (own_kernel) {
    for (Unit& unit : units_) UpdateUnit(unit, OwnedGrad(unit), adamw_, lr, b1, b2, step, divisor);
  } else {
    std::vector<std::pair<Unit*, torch::Tensor>> all;
    for (Unit& unit : units_) all.emplace_back(&unit, OwnedGrad(unit));
    UpdateComposite(all, DeferredUpdate{lr, grad_scale, step, grad_divisor, divisor, false});
  }
  // Read by the update, queued on this stream: the allocator reuses their memory after it.
  if (transient_) {
    for (Unit& unit : units_) DropGradients(unit);
  }
  if (sharded) {
    // The owned part of the copies from the updated masters (our kernel wrote it already), then
    // every rank's part, in place and in bf16; in forward order (units are in backward's), so that
    // deferred gathers arrive as the next forward needs them.
    for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
      Unit& unit = *it;
      if (!own_kernel) OwnedCompute(unit).copy_(OwnedParam(unit));
      const Range own = Owned(unit);
      torch::Tensor all = unit.compute;
      Communicator* comm = unit.comm;
      unit.compute_job = queue_->Enqueue([comm, all, own]() mutable {
        torch::NoGradGuard no_grad;
        return comm->AllGather(all.narrow(0, own.begin, own.size()), all);
      });
    }
    masters_stale_ = true;
    if (defer_compute) return Status::Ok();
    for (Unit& unit : units_) unit.compute_job = 0;
    return queue_->WaitAll();
  }
  if ((zero_ == 1 || zero_ == 2) && dp_->size() > 1) {
    for (Unit& unit : units_) {
      torch::Tensor mine = OwnedParam(unit).clone(), full = unit.full;
      Communicator* comm = unit.comm;
      queue_->Enqueue([comm, mine, full]() mutable { return comm->AllGather(mine, full); });
    }
  }
  Status s = queue_->WaitAll();
  if (s.ok() && !(own_kernel && zero_ == 0)) RefreshCompute();
  return s;
}

Status ParamStore::DpAllReduce(torch::Tensor& tensor) {
  Communicator* comm = dp_;
  torch::Tensor t = tensor;
  return queue_->Wait(queue_->Enqueue([comm, t]() mutable { return comm->AllReduceSum(t); }));
}

Status ParamStore::Gather(int u) {
  if (zero_ != 3 || u < 0 || u >= units()) return Status::Ok();
  Unit& unit = units_[u];
  if (unit.gathered) return Status::Ok();
  if (unit.gather_job == 0) Prefetch(u);
  Status s = queue_->Wait(unit.gather_job);
  unit.gather_job = 0;
  unit.gathered = true;
  return s;
}

void ParamStore::Prefetch(int u) {
  if (zero_ != 3 || u < 0 || u >= units()) return;
  Unit& unit = units_[u];
  if (unit.gathered || unit.gather_job != 0) return;
  // The last step's update of this unit, where it was left to this gather: first, on the same stream.
  std::function<bool(const torch::Tensor&)> update = TakePendingUpdate(unit);
  if (!unit.compute.defined()) {
    unit.gather_job = GatherFp32(unit, update ? [update]() { update(torch::Tensor()); } : std::function<void()>());
    return;
  }
  Communicator* comm = unit.comm;
  torch::Tensor shard = unit.shard;
  // bf16 copies, gathered in place: this rank's part of the copy is written first (by the pending
  // update's kernel, which reads the fp32 shard anyway, else cast from the shard), then every
  // rank's part gathered around it (half the traffic of the fp32 values). Written through a tensor
  // of its own over the copy's memory: a write through the copy itself would count as a change of
  // the leaves, which share its version counter, and autograd would refuse the values saved for
  // backward.
  torch::Tensor all = unit.compute;
  const size_t bytes = static_cast<size_t>(unit.layout.padded) * all.element_size();
  TakeSlot(u, bytes);
  if (unit.slot < 0) compat::ResizeStorage(all, bytes);
  const Range own = Owned(unit);
  const int64_t numel = unit.layout.numel;
  unit.gather_job = queue_->Enqueue([comm, shard, all, own, numel, update]() mutable {
    torch::NoGradGuard no_grad;
    torch::Tensor mine = torch::from_blob(static_cast<char*>(all.data_ptr()) + own.begin * all.element_size(),
                                          {own.size()}, all.options());
    if (update && update(mine)) {
      // The kernel wrote the parameters' elements; the padding past them is not theirs.
      if (own.end > numel) mine.narrow(0, std::max<int64_t>(numel - own.begin, 0), own.end - std::max(numel, own.begin)).zero_();
    } else {
      mine.copy_(shard);
    }
    return comm->AllGather(mine, all);
  });
}

void ParamStore::Release(int u) {
  if (zero_ != 3 || u < 0 || u >= units()) return;
  Unit& unit = units_[u];
  if (unit.gather_job != 0) {
    (void)queue_->Wait(unit.gather_job);  // an error resurfaces at the next wait
    unit.gather_job = 0;
  }
  if (unit.slot >= 0) {
    compat::PointStorage(unit.compute, nullptr, 0);
    slots_[unit.slot].unit = -1;
    unit.slot = -1;
  } else {
    compat::ResizeStorage(unit.compute.defined() ? unit.compute : unit.full, 0);
  }
  unit.gathered = false;
}

bool ParamStore::UseSymmetricGathers() {
  // NCCL runs a windowed all-gather on the copy engines through cudaMemcpyBatchAsync, which fails
  // on the legacy default stream, the one the collectives run on without a stream of their own.
  if (!queue_->apart()) return false;
  // One symmetric region a group: the expert units' group is another.
  if (expert_units_) return false;
  symmetric_gathers_ = zero_ == 3 && dp_->size() > 1 && !units_.empty() && units_.front().compute.defined();
  if (symmetric_gathers_) return true;
  if (!sharded_update()) return false;
  // zero 1/2: the bf16 copies are whole on every rank and kept; they move once into one region of
  // symmetric memory (each unit at the same offset on every rank), where the update writes the owned
  // parts and the all-gathers fill in the rest.
  constexpr int64_t kAlign = 512;
  std::vector<int64_t> at;
  int64_t total = 0;
  for (const Unit& unit : units_) {
    at.push_back(total);
    total += (unit.compute.numel() * unit.compute.element_size() + kAlign - 1) / kAlign * kAlign;
  }
  torch::Tensor region = MakeSymmetric(total);
  if (!region.defined()) return false;
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& unit = units_[k];
    const int64_t bytes = unit.compute.numel() * unit.compute.element_size();
    torch::Tensor place = region.narrow(0, at[k], bytes);
    // Through a tensor of its own: the copy's version counter is the leaves'.
    torch::from_blob(place.data_ptr(), {unit.compute.numel()}, unit.compute.options()).copy_(unit.compute);
    compat::PointStorage(unit.compute, place.data_ptr(), static_cast<size_t>(bytes));
  }
  copies_region_ = region;
  return true;
}

int64_t ParamStore::symmetric_bytes() const {
  int64_t bytes = copies_region_.defined() ? copies_region_.numel() : 0;
  for (const Slot& slot : slots_) bytes += slot.memory.numel();
  return bytes;
}

void ParamStore::TakeSlot(int u, size_t bytes) {
  if (!symmetric_gathers_) return;
  Unit& unit = units_[u];
  // The smallest free slot that fits without wasting more than half of it; every rank takes the
  // same one (the same calls in the same order), so that the unit sits at the same offsets on every rank.
  int best = -1;
  for (size_t k = 0; k < slots_.size(); ++k) {
    const size_t size = static_cast<size_t>(slots_[k].memory.numel());
    if (slots_[k].unit >= 0 || size < bytes || size > 2 * bytes) continue;
    if (best < 0 || size < static_cast<size_t>(slots_[best].memory.numel())) best = static_cast<int>(k);
  }
  if (best < 0) {
    torch::Tensor memory = MakeSymmetric(static_cast<int64_t>(bytes));
    if (!memory.defined()) {
      // The units gather into the allocator's memory, as with LTRAIN_COPY_ENGINE_GATHERS=0.
      symmetric_gathers_ = false;
      return;
    }
    slots_.push_back(Slot{memory, -1});
    best = static_cast<int>(slots_.size()) - 1;
  }
  slots_[best].unit = u;
  unit.slot = best;
  compat::PointStorage(unit.compute, slots_[best].memory.data_ptr(), bytes);
}

torch::Tensor ParamStore::MakeSymmetric(int64_t bytes) {
  torch::Tensor memory;
  Status made;  // apart from the queue's status, which would keep the error for every later wait
  Communicator* comm = dp_;
  // In the collectives' order: the registration is a collective of the dp group.
  const Status waited = queue_->Wait(queue_->Enqueue([comm, bytes, &memory, &made]() {
    StatusOr<torch::Tensor> m = comm->AllocateSymmetric(bytes);
    if (m.ok()) {
      memory = std::move(m).value();
    } else {
      made = m.status();
    }
    return Status::Ok();
  }));
  if (!waited.ok()) return {};  // an earlier job's error, which the next wait returns again
  // The backend has none (Gloo), or NCCL could not make it (on every rank alike).
  if (!made.ok() && made.code() != StatusCode::kFailedPrecondition) {
    std::fprintf(stderr, "ltrain-worker: warning: data-parallel gathers with NCCL's kernels, not the copy engines: %s\n",
                 made.message().c_str());
  }
  return memory;
}

bool ParamStore::UseTransientGradients() {
  if (zero_ != 0 || units_.empty()) return false;
  for (const Unit& unit : units_) {
    if (unit.comm->size() > 1) return false;
  }
  transient_ = true;
  for (Unit& unit : units_) DropGradients(unit);
  return true;
}

void ParamStore::DropGradients(Unit& unit) {
  unit.grad_full = torch::Tensor();
  for (int i : unit.layout.params) params_[i].value->mutable_grad() = torch::Tensor();
}

void ParamStore::MakeAllGradients() {
  if (!transient_) return;
  for (Unit& unit : units_) MakeGradients(unit, /*in_backward=*/false);
}

void ParamStore::MakeGradients(Unit& unit, bool in_backward) {
  if (unit.grad_full.defined()) return;
  torch::NoGradGuard no_grad;
  // In the leaves' dtype (bf16 with bf16 copies), as Create makes it.
  unit.grad_full = torch::empty({unit.layout.padded}, (unit.compute.defined() ? unit.compute : unit.full).options());
  std::vector<torch::Tensor> stale;
  // Runs of elements to zero: every one but the copied gradients and the stale ones.
  int64_t run_at = 0;
  auto zero_to = [&](int64_t end) {
    if (end > run_at) unit.grad_full.narrow(0, run_at, end - run_at).zero_();
  };
  for (size_t k = 0; k < unit.layout.params.size(); ++k) {
    const Param& p = params_[unit.layout.params[k]];
    torch::Tensor& value = *p.value;
    const int64_t at = unit.layout.offsets[k], n = value.numel();
    torch::Tensor view = unit.grad_full.narrow(0, at, n).view(value.sizes());
    if (value.grad().defined()) {
      zero_to(at);
      view.copy_(value.grad());
      run_at = at + n;
    } else if (in_backward && p.product_grad) {
      zero_to(at);
      stale.push_back(view);
      run_at = at + n;
    }
    value.mutable_grad() = view;
  }
  zero_to(unit.layout.padded);
  MarkGradientsStale(stale);
}

void ParamStore::PrepareGradients(int u) {
  if (u < 0 || u >= units()) return;
  if (transient_) return MakeGradients(units_[u], /*in_backward=*/true);
  if (zero_ != 3 || !armed_) return;
  Unit& unit = units_[u];
  if (unit.grad_flat.defined() || unit.launched) return;
  torch::NoGradGuard no_grad;
  // In the leaves' dtype: bf16 with bf16 copies, else fp32.
  unit.grad_flat = torch::zeros({unit.layout.padded}, (unit.compute.defined() ? unit.compute : unit.full).options());
  for (size_t k = 0; k < unit.layout.params.size(); ++k) {
    torch::Tensor& value = *params_[unit.layout.params[k]].value;
    torch::Tensor view = unit.grad_flat.narrow(0, unit.layout.offsets[k], value.numel()).view(value.sizes());
    if (value.grad().defined()) view.copy_(value.grad());
    value.mutable_grad() = view;
  }
}

Status ParamStore::GatherMasterUnit(int u) {
  if (zero_ != 3 || u < 0 || u >= units()) return Status::Ok();
  Unit& unit = units_[u];
  if (!unit.compute.defined()) return Gather(u);
  return queue_->Wait(GatherFp32(unit));
}

int64_t ParamStore::GatherFp32(Unit& unit, const std::function<void()>& before) {
  torch::Tensor full = unit.full, shard = unit.shard;
  compat::ResizeStorage(full, static_cast<size_t>(unit.layout.padded) * full.element_size());
  Communicator* comm = unit.comm;
  return queue_->Enqueue([comm, shard, full, before]() mutable {
    torch::NoGradGuard no_grad;
    if (before) before();
    return comm->AllGather(shard, full);
  });
}

void ParamStore::ReleaseMasterUnit(int u) {
  if (zero_ != 3 || u < 0 || u >= units()) return;
  Unit& unit = units_[u];
  if (!unit.compute.defined()) return Release(u);
  compat::ResizeStorage(unit.full, 0);
}

MemoryBytes ParamStore::Memory() const {
  MemoryBytes m;
  for (const Unit& unit : units_) {
    const int64_t e = unit.full.element_size();
    m.params += (zero_ == 3 ? unit.layout.shard : unit.layout.padded) * e;
    // ZeRO-3's bf16 copies exist only while gathered.
    if (unit.compute.defined() && zero_ < 3) m.params += unit.compute.numel() * unit.compute.element_size();
    const int64_t ge = unit.compute.defined() && zero_ < 2 ? unit.compute.element_size() : e;
    m.grads += (zero_ >= 2 ? unit.layout.shard : unit.layout.padded) * ge;
    m.optimizer += (unit.exp_avg.numel() + unit.exp_avg_sq.numel()) * e;
  }
  return m;
}

}  // namespace ltrain::worker
