#include "worker/parallel/unit_hooks.h"

#include <map>
#include <set>
#include <stdexcept>

namespace ltrain::worker {
namespace {

// Structural unit id -> the store units that hold its parameters.
std::map<int, std::vector<int>> StoreUnitsByStructuralUnit(const std::vector<ShardParam>& params,
                                                           const std::vector<std::vector<int>>& units) {
  std::map<int, std::vector<int>> index;
  for (size_t u = 0; u < units.size(); ++u) index[params[units[u].front()].unit].push_back(static_cast<int>(u));
  return index;
}

}  // namespace

std::vector<std::vector<int>> StructuralUnits(const std::vector<ShardParam>& params) {
  std::map<int, std::vector<int>> by_unit;
  for (size_t i = 0; i < params.size(); ++i) by_unit[params[i].unit].push_back(static_cast<int>(i));
  std::vector<std::vector<int>> units;
  for (auto it = by_unit.rbegin(); it != by_unit.rend(); ++it) units.push_back(it->second);
  return units;
}

std::vector<std::vector<int>> SeparateExpertUnits(const std::vector<std::vector<int>>& units,
                                                  const std::vector<ShardParam>& params) {
  std::vector<std::vector<int>> out;
  for (const std::vector<int>& unit : units) {
    std::vector<int> dense, experts;
    for (int i : unit) (params[i].expert ? experts : dense).push_back(i);
    if (!dense.empty()) out.push_back(std::move(dense));
    if (!experts.empty()) out.push_back(std::move(experts));
  }
  return out;
}

UnitHooks Zero3GatherHooks(ParamStore* store, const std::vector<ShardParam>& params,
                           const std::vector<std::vector<int>>& units, int layers) {
  const std::map<int, std::vector<int>> unit_index = StoreUnitsByStructuralUnit(params, units);
  const int last_unit = layers + 1;
  auto store_units = [unit_index](int unit) {
    auto it = unit_index.find(unit);
    return it == unit_index.end() ? std::vector<int>() : it->second;
  };
  UnitHooks hooks;
  hooks.before_forward = [store, store_units](int unit) {
    for (int u : store_units(unit)) {
      if (Status s = store->Gather(u); !s.ok()) throw std::runtime_error(s.message());
    }
    for (int u : store_units(unit + 1)) store->Prefetch(u);
  };
  hooks.after_forward = [store, store_units, last_unit](int unit) {
    if (unit == 0 || unit == last_unit) return;
    for (int u : store_units(unit)) store->Release(u);
  };
  hooks.output = [store, store_units](int unit, torch::Tensor& out) {
    const std::vector<int> mine = store_units(unit);
    if (mine.empty() || !out.requires_grad() || unit == 0) return;
    const std::vector<int> before = store_units(unit - 1);
    // Runs when backward reaches this block.
    out.register_hook([store, mine, before](const torch::Tensor& grad) {
      for (int u : mine) {
        if (Status s = store->Gather(u); !s.ok()) throw std::runtime_error(s.message());
        store->PrepareGradients(u);
      }
      for (int u : before) store->Prefetch(u);
      return grad;
    });
  };
  return hooks;
}

UnitHooks PrepareGradientsHooks(ParamStore* store, const std::vector<ShardParam>& params,
                                const std::vector<std::vector<int>>& units, UnitHooks hooks) {
  hooks.output = [store, unit_index = StoreUnitsByStructuralUnit(params, units)](int unit, torch::Tensor& out) {
    auto it = unit_index.find(unit);
    if (it == unit_index.end() || !out.requires_grad()) return;
    const std::vector<int> mine = it->second;
    // Runs when backward reaches this unit.
    out.register_hook([store, mine](const torch::Tensor& grad) {
      for (int u : mine) store->PrepareGradients(u);
      return grad;
    });
  };
  return hooks;
}

UnitHooks AwaitComputeCopiesHooks(ParamStore* store, const std::vector<ShardParam>& params) {
  std::map<int, std::set<int>> store_units;
  for (size_t i = 0; i < params.size(); ++i) store_units[params[i].unit].insert(store->unit_of(static_cast<int>(i)));
  UnitHooks hooks;
  hooks.before_forward = [store, store_units](int unit) {
    auto it = store_units.find(unit);
    if (it == store_units.end()) return;
    for (int u : it->second) {
      if (Status s = store->AwaitCompute(u); !s.ok()) throw std::runtime_error(s.message());
    }
  };
  return hooks;
}

}  // namespace ltrain::worker
