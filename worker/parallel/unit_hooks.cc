#include "worker/parallel/unit_hooks.h"

#include <map>
#include <set>
#include <stdexcept>

namespace ltrain::worker {

std::vector<std::vector<int>> StructuralUnits(const std::vector<ShardParam>& params) {
  std::map<int, std::vector<int>> by_unit;
  for (size_t i = 0; i < params.size(); ++i) by_unit[params[i].unit].push_back(static_cast<int>(i));
  std::vector<std::vector<int>> units;
  for (auto it = by_unit.rbegin(); it != by_unit.rend(); ++it) units.push_back(it->second);
  return units;
}

UnitHooks Zero3GatherHooks(ParamStore* store, const std::vector<ShardParam>& params,
                           const std::vector<std::vector<int>>& units, int layers) {
  // Structural unit id -> store unit index.
  std::map<int, int> unit_index;
  for (size_t u = 0; u < units.size(); ++u) unit_index[params[units[u].front()].unit] = static_cast<int>(u);
  const int last_unit = layers + 1;
  UnitHooks hooks;
  hooks.before_forward = [store, unit_index](int unit) {
    auto it = unit_index.find(unit);
    if (it == unit_index.end()) return;
    if (Status s = store->Gather(it->second); !s.ok()) throw std::runtime_error(s.message());
    auto next = unit_index.find(unit + 1);
    if (next != unit_index.end()) store->Prefetch(next->second);
  };
  hooks.after_forward = [store, unit_index, last_unit](int unit) {
    auto it = unit_index.find(unit);
    if (it != unit_index.end() && unit != 0 && unit != last_unit) store->Release(it->second);
  };
  hooks.output = [store, unit_index](int unit, torch::Tensor& out) {
    auto it = unit_index.find(unit);
    if (it == unit_index.end() || !out.requires_grad() || unit == 0) return;
    const int u = it->second;
    auto prev = unit_index.find(unit - 1);
    const int before = prev == unit_index.end() ? -1 : prev->second;
    // Runs when backward reaches this block.
    out.register_hook([store, u, before](const torch::Tensor& grad) {
      if (Status s = store->Gather(u); !s.ok()) throw std::runtime_error(s.message());
      store->PrepareGradients(u);
      store->Prefetch(before);
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
