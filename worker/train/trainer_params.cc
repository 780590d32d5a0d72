// The model's parameters into and out of the trainer (part of Trainer, trainer.h): model.init_from's
// safetensors, the full parameters gathered for --export-params and Hugging Face export, the logits
// of a batch.
#include <cstdio>
#include <fstream>
#include <map>
#include <stdexcept>

#include "common/hf_format.h"
#include "common/model_family.h"
#include "common/safetensors.h"
#include "worker/torch_compat.h"
#include "worker/train/trainer.h"
#include "worker/train/trainer_internal.h"

namespace ltrain::worker {

Status Trainer::ExportParameters(const std::string& path) {
  torch::NoGradGuard no_grad;
  LTRAIN_RETURN_IF_ERROR(store_->AwaitUpdates());
  LTRAIN_RETURN_IF_ERROR(store_->SyncMasters());
  const RankCoords c = groups_->coords;
  for (int u = 0; u < store_->units(); ++u) {
    LTRAIN_RETURN_IF_ERROR(store_->GatherMasterUnit(u));
  }
  const bool collector = c.dp == 0 && c.tp == 0;
  std::map<std::string, torch::Tensor> full;
  for (size_t i = 0; i < model_->params().size(); ++i) {
    const ShardParam& p = model_->params()[i];
    LTRAIN_ASSIGN_OR_RETURN(torch::Tensor t, model_->GatherFull(p, store_->MasterValue(static_cast<int>(i))));
    if (collector && p.exported) full[p.name] = t.to(torch::kCPU).to(torch::kFloat).contiguous();
  }
  for (int u = 0; u < store_->units(); ++u) store_->ReleaseMasterUnit(u);
  const auto& names = model_->full_params();
  if (collector && layout_.pp > 1) {
    Communicator* pp = groups_->pp;
    for (size_t i = 0; i < names.size(); ++i) {
      const int owner = model_->PipelineRankOf(names[i].first);
      const uint32_t tag = static_cast<uint32_t>(i);
      if (c.pp != 0 && owner == c.pp) {
        LTRAIN_RETURN_IF_ERROR(pp->Send(full.at(names[i].first), 0, tag));
      } else if (c.pp == 0 && owner != 0) {
        torch::Tensor t = torch::empty(names[i].second, torch::kFloat);
        LTRAIN_RETURN_IF_ERROR(pp->Recv(t, owner, tag));
        full[names[i].first] = t;
      }
    }
    LTRAIN_RETURN_IF_ERROR(pp->WaitSends());
  }
  if (groups_->rank == 0) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    for (const auto& [name, shape] : names) {
      auto it = full.find(name);
      if (it == full.end()) return Internal("export: parameter " + name + " was not gathered");
      const uint32_t len = static_cast<uint32_t>(name.size());
      const uint64_t numel = static_cast<uint64_t>(it->second.numel());
      out.write(reinterpret_cast<const char*>(&len), sizeof(len));
      out.write(name.data(), len);
      out.write(reinterpret_cast<const char*>(&numel), sizeof(numel));
      out.write(static_cast<const char*>(it->second.data_ptr()), static_cast<std::streamsize>(numel * sizeof(float)));
    }
    out.close();
    if (!out) return Internal("writing exported parameters to " + path + " failed");
  }
  return groups_->world->Barrier();
}

std::vector<std::pair<std::string, torch::Tensor>> Trainer::FullParameters() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  const std::vector<ShardParam>& params = model_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].exported) continue;
    out.emplace_back(params[i].name, store_->MasterValue(static_cast<int>(i)).detach().to(torch::kCPU).to(torch::kFloat).clone());
  }
  return out;
}

torch::Tensor Trainer::Logits(const torch::Tensor& ids) {
  torch::NoGradGuard no_grad;
  if (Status s = store_->AwaitUpdates(); !s.ok()) throw std::runtime_error(s.message());
  compat::CudaBf16Autocast autocast(bf16_ && !bf16_params_);
  return model_->Logits(ids.to(device_));
}

Status Trainer::LoadInitialParameters(const std::string& path) {
  torch::NoGradGuard no_grad;
  LTRAIN_RETURN_IF_ERROR(CheckHfTensors(path, recipe_.model));
  LTRAIN_ASSIGN_OR_RETURN(auto tensor_files, SafetensorsTensorFiles(path));
  // transformers' name (and layout) of each of our parameters, and our own names as they are.
  std::map<std::string, HfName> by_ours;
  for (const HfName& n : HfNames(recipe_.model)) by_ours[n.ours] = n;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open;
  // Shapes and dtypes were checked above.
  auto read = [&](const std::string& name, bool transposed) -> StatusOr<torch::Tensor> {
    const std::string& file = tensor_files.at(name);
    if (!open.count(file)) {
      LTRAIN_ASSIGN_OR_RETURN(open[file], SafetensorsFile::Open(file));
    }
    const SafetensorsEntry* e = open[file]->Find(name);
    torch::ScalarType dtype = torch::kFloat;
    if (e->dtype == "BF16") {
      dtype = torch::kBFloat16;
    } else if (e->dtype == "F16") {
      dtype = torch::kHalf;
    }
    torch::Tensor t = torch::empty(e->shape, torch::TensorOptions().dtype(dtype));
    LTRAIN_RETURN_IF_ERROR(open[file]->Read(*e, t.data_ptr()));
    t = t.to(torch::kFloat);
    return transposed ? t.t().contiguous() : t;
  };
  std::vector<ShardParam>& params = model_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    const ShardParam& p = params[i];
    const HfName& n = by_ours.at(p.name);
    torch::Tensor full;
    // Under expert parallelism, this rank's experts only: placed where they lie in the stack.
    int64_t first = 0, count = n.experts;
    if (p.expert) {
      count = n.experts / layout_.ep;
      first = (groups_->coords.dp % layout_.ep) * count;
    }
    if (n.experts > 0 && !tensor_files.count(p.name)) {
      // transformers' experts, one tensor each: stacked as ours.
      std::vector<torch::Tensor> experts;
      for (int64_t e = first; e < first + count; ++e) {
        LTRAIN_ASSIGN_OR_RETURN(torch::Tensor t, read(HfExpertName(n.hf, e), false));
        experts.push_back(std::move(t));
      }
      full = torch::stack(experts);
    } else if (tensor_files.count(n.hf)) {
      LTRAIN_ASSIGN_OR_RETURN(full, read(n.hf, n.transposed));
    } else {
      LTRAIN_ASSIGN_OR_RETURN(full, read(p.name, false));
    }
    // A stack in one tensor (of our own export): this rank's experts of it.
    if (p.expert && full.size(0) != count) full = full.narrow(0, first, count);
    torch::Tensor mine = layout_.tp > 1 ? Slice(full, p.split, layout_.tp, groups_->coords.tp) : full;
    const int64_t at = p.expert ? mine.numel() * (first / count) : 0;
    LTRAIN_RETURN_IF_ERROR(store_->LoadParamPart(static_cast<int>(i), ParamStore::StatePart::kValue,
                                                 RangeValues(mine.reshape(-1).to(device_), at)));
  }
  if (options_.print_progress && groups_->rank == 0) {
    std::printf("model: %zu parameter tensors from %s\n", params.size(), path.c_str());
    std::fflush(stdout);
  }
  return Status::Ok();
}

}  // namespace ltrain::worker
