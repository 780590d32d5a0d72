// The parameter store's side of checkpoints (part of ParamStore, param_store.h): which range of each
// parameter this rank owns, saves and loads, host snapshots of the model and optimizer state, and
// loading them back.
#include "worker/parallel/param_store.h"

#include <exception>

#include <c10/util/Exception.h>

#include "worker/torch_compat.h"

namespace ltrain::worker {

Range ParamStore::OwnedOfParam(int param) const {
  const int64_t off = OffsetInUnit(param);
  const int64_t n = params_[param].value->numel();
  Range seg = Intersect(Owned(units_[unit_of_[param]]), Range{off, off + n});
  if (seg.size() <= 0) return Range{0, 0};
  return Range{seg.begin - off, seg.end - off};
}

int64_t ParamStore::OwnedAt(int param) const {
  const Range r = OwnedOfParam(param);
  if (r.size() == 0) return 0;
  return OffsetInUnit(param) + r.begin - Owned(units_[unit_of_[param]]).begin;
}

namespace {

torch::Tensor RangeTensor(Range r) { return torch::tensor(std::vector<int64_t>{r.begin, r.end}, torch::kLong); }

// The device copies of a snapshot are queued; waits for them once.
void AwaitHostCopies(const std::vector<std::pair<std::string, torch::Tensor>>& state, const torch::Device& device) {
  if (device.is_cuda() && !state.empty()) compat::Synchronize(device);
}

}  // namespace

torch::Tensor ParamStore::HostCopy(const torch::Tensor& t) const {
  if (!t.is_cuda()) return t.reshape(-1).to(torch::kCPU, torch::kFloat, false, /*copy=*/true);
  const int64_t n = t.numel();
  torch::Tensor host;
  if (snapshot_arena_.defined() && snapshot_used_ + n <= snapshot_arena_.numel()) {
    host = snapshot_arena_.narrow(0, snapshot_used_, n);
    snapshot_used_ += n;
  } else {
    host = torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true));
  }
  host.copy_(t.reshape(-1), /*non_blocking=*/true);
  return host;
}

torch::Tensor ParamStore::TakeSnapshotMemory(int64_t numel) const {
  if (!snapshot_arena_.defined() || snapshot_used_ + numel > snapshot_arena_.numel()) return torch::Tensor();
  torch::Tensor out = snapshot_arena_.narrow(0, snapshot_used_, numel);
  snapshot_used_ += numel;
  return out;
}

int64_t ParamStore::ReserveSnapshot() {
  if (params_.empty() || !params_[0].value->is_cuda()) return 0;
  int64_t numel = 0;
  for (size_t i = 0; i < params_.size(); ++i) numel += 3 * SaveRangeOfParam(static_cast<int>(i)).size();
  snapshot_arena_ = torch::empty({numel}, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true));
  snapshot_used_ = 0;
  return numel * 4;
}

namespace {

Range Shifted(Range r, int64_t by) { return Range{r.begin + by, r.end + by}; }

}  // namespace

Range ParamStore::SaveRangeOfParam(int param) const {
  return Shifted(LocalSaveRange(param), params_[param].saved_offset);
}

Range ParamStore::LoadRangeOfParam(int param, bool moments, bool gather_masters) const {
  return Shifted(LocalLoadRange(param, moments, gather_masters), params_[param].saved_offset);
}

Range ParamStore::LocalSaveRange(int param) const {
  // Under ZeRO the rank's shard (the only copy of the moments, and of the parameters at stage 3);
  // without it every rank holds everything, and rank d of the dp group saves the d-th of dp equal
  // parts.
  if (zero_ >= 1) return OwnedOfParam(param);
  const int64_t n = params_[param].value->numel();
  const Communicator* comm = units_[unit_of_[param]].comm;
  const int64_t d = comm->rank(), size = comm->size();
  return Range{n * d / size, n * (d + 1) / size};
}

Range ParamStore::LocalLoadRange(int param, bool moments, bool gather_masters) const {
  if (moments ? zero_ >= 1 : zero_ == 3 || (gather_masters && CanGatherMasters())) return OwnedOfParam(param);
  return Range{0, params_[param].value->numel()};
}

std::vector<std::pair<std::string, torch::Tensor>> ParamStore::ModelState(const std::vector<std::string>& names) const {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Range r = LocalSaveRange(static_cast<int>(i));
    out.emplace_back("range." + names[i], RangeTensor(Shifted(r, params_[i].saved_offset)));
    if (zero_ < 3) {
      out.emplace_back("model." + names[i], HostCopy(MasterValue(static_cast<int>(i)).reshape(-1).narrow(0, r.begin, r.size())));
      continue;
    }
    const Unit& unit = units_[unit_of_[i]];
    out.emplace_back("model." + names[i], HostCopy(unit.shard.narrow(0, OwnedAt(static_cast<int>(i)), r.size())));
  }
  if (!params_.empty()) AwaitHostCopies(out, params_[0].value->device());
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> ParamStore::OptimizerState(const std::vector<std::string>& names) const {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Unit& unit = units_[unit_of_[i]];
    const Range r = LocalSaveRange(static_cast<int>(i));
    // The moments of the parameter's elements this rank holds start at OwnedAt in the unit.
    const int64_t at = OwnedAt(static_cast<int>(i)) + (zero_ >= 1 ? 0 : r.begin);
    out.emplace_back("range." + names[i], RangeTensor(Shifted(r, params_[i].saved_offset)));
    out.emplace_back("exp_avg." + names[i], HostCopy(unit.exp_avg.narrow(0, at, r.size())));
    out.emplace_back("exp_avg_sq." + names[i], HostCopy(unit.exp_avg_sq.narrow(0, at, r.size())));
  }
  if (!params_.empty()) AwaitHostCopies(out, params_[0].value->device());
  return out;
}

Status ParamStore::LoadParamState(int param, const RangeValues& value, const RangeValues& exp_avg,
                                  const RangeValues& exp_avg_sq, bool gather_masters) {
  LTRAIN_RETURN_IF_ERROR(LoadParamPart(param, StatePart::kValue, value, gather_masters));
  LTRAIN_RETURN_IF_ERROR(LoadParamPart(param, StatePart::kExpAvg, exp_avg));
  return LoadParamPart(param, StatePart::kExpAvgSq, exp_avg_sq);
}

Status ParamStore::LoadParamPart(int param, StatePart part, const RangeValues& t, bool gather_masters) {
  torch::NoGradGuard no_grad;
  gather_masters = gather_masters && CanGatherMasters();
  const Range need = LocalLoadRange(param, part != StatePart::kValue, gather_masters);
  // `t` is placed within the saved stack (Param::saved_offset); this parameter's elements from 0.
  const int64_t begin = t.begin - params_[param].saved_offset;
  const int64_t end = begin + t.values.numel();
  if (need.size() > 0 && (begin > need.begin || end < need.end)) {
    const int64_t offset = params_[param].saved_offset;
    return DataLoss("checkpoint state of parameter " + std::to_string(param) + " holds elements [" +
                    std::to_string(t.begin) + ", " + std::to_string(t.end()) + "), this rank needs [" +
                    std::to_string(need.begin + offset) + ", " + std::to_string(need.end + offset) +
                    ") (was it saved by another model?)");
  }
  // Elements `r` of `t` (covered, as checked above), flattened.
  auto elements = [&t, begin](Range r) { return t.values.reshape(-1).narrow(0, r.begin - begin, r.size()); };
  Unit& unit = units_[unit_of_[param]];
  const Range r = OwnedOfParam(param);
  const int64_t at = OwnedAt(param);
  // A gathered (or prefetched) ZeRO-3 unit would keep the values from before the load.
  if (zero_ == 3 && part == StatePart::kValue) Release(unit_of_[param]);
  if (part == StatePart::kValue) {
    if (zero_ < 3 && !gather_masters) {
      const torch::Tensor whole = elements(need);
      MasterValue(param).view(-1).copy_(whole);
      if (unit.compute.defined()) params_[param].value->detach().view(-1).copy_(whole);
    } else if (zero_ < 3) {
      if (r.size() > 0) MasterValue(param).view(-1).narrow(0, r.begin, r.size()).copy_(elements(r));
    } else if (r.size() > 0) {
      unit.shard.narrow(0, at, r.size()).copy_(elements(r));
    }
  } else if (r.size() > 0) {
    (part == StatePart::kExpAvg ? unit.exp_avg : unit.exp_avg_sq).narrow(0, at, r.size()).copy_(elements(r));
  }
  return Status::Ok();
}

Status ParamStore::GatherMasters() {
  if (!CanGatherMasters()) return Status::Ok();
  masters_stale_ = true;
  LTRAIN_RETURN_IF_ERROR(SyncMasters());
  RefreshCompute();
  return Status::Ok();
}

}  // namespace ltrain::worker
