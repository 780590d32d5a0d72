// The parameter store's bf16 compute copies (what the worker trains with on GPUs), on the CPU: the
// leaves are bf16 copies of fp32 masters, the optimizer updates the masters exactly as an fp32
// store would from the same gradients, checkpoints hold the masters, and a load sets both.
#include "worker/parallel/param_store.h"

#include <map>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <gloo/rendezvous/hash_store.h>

#include "worker/comm/communicator.h"
#include "worker/comm/gloo_communicator.h"

namespace ltrain::worker {
namespace {

struct Leaves {
  torch::Tensor w, b;
};

Leaves MakeLeaves() {
  torch::manual_seed(11);
  return Leaves{torch::randn({4, 3}).requires_grad_(true), torch::randn({3}).requires_grad_(true)};
}

// w and b in one unit, or in `units` (parameter 0 is w, 1 is b).
std::unique_ptr<ParamStore> MakeStore(Leaves& leaves, int zero, Communicator* dp, bool bf16,
                                      const std::vector<std::vector<int>>& units = {{0, 1}}, bool exclusive = false) {
  AdamWConfig adamw;
  adamw.weight_decay = 0.1;
  std::vector<ParamStore::Param> params = {{&leaves.w, true, true}, {&leaves.b, false, true}};
  StatusOr<std::unique_ptr<ParamStore>> store = ParamStore::Create(params, units, zero, dp, adamw, bf16, exclusive);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  return std::move(store).value();
}

// Each rank's bf16 gradients of w and b for each step. Drawn on the test's thread: the rank threads
// must not share the global generator.
using RankGrads = std::vector<std::vector<std::pair<torch::Tensor, torch::Tensor>>>;
RankGrads DrawRankGrads(int ranks, int steps) {
  RankGrads grads(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    for (int step = 0; step < steps; ++step) {
      grads[rank].emplace_back(torch::randn({4, 3}).to(torch::kBFloat16), torch::randn({3}).to(torch::kBFloat16));
    }
  }
  return grads;
}

// Leaves of their own with `start`'s values (one pair per store).
Leaves CopyOf(const Leaves& start) {
  return Leaves{start.w.detach().clone().requires_grad_(true), start.b.detach().clone().requires_grad_(true)};
}

// Both stores get the same gradients: bf16 values, as the bf16 copies' backward produces them.
void SetGrads(Leaves& leaves, const torch::Tensor& gw, const torch::Tensor& gb) {
  torch::NoGradGuard no_grad;
  leaves.w.mutable_grad().copy_(gw);
  leaves.b.mutable_grad().copy_(gb);
}

TEST(ParamStoreTest, Bf16CopiesFollowFp32MastersThatLearnAsAnFp32Store) {
  for (const int zero : {0, 1}) {
    FakeCommunicator dp_bf16, dp_fp32;
    dp_bf16.SimulateSize(zero == 0 ? 1 : 2);
    dp_fp32.SimulateSize(zero == 0 ? 1 : 2);
    Leaves bf16 = MakeLeaves(), fp32 = MakeLeaves();
    std::unique_ptr<ParamStore> store = MakeStore(bf16, zero, &dp_bf16, /*bf16=*/true);
    std::unique_ptr<ParamStore> reference = MakeStore(fp32, zero, &dp_fp32, /*bf16=*/false);
    ASSERT_EQ(bf16.w.scalar_type(), torch::kBFloat16);
    ASSERT_EQ(bf16.w.grad().scalar_type(), torch::kBFloat16);
    ASSERT_EQ(fp32.w.scalar_type(), torch::kFloat);

    for (int64_t step = 1; step <= 3; ++step) {
      store->ZeroGrads();
      reference->ZeroGrads();
      torch::Tensor gw = torch::randn({4, 3}).to(torch::kBFloat16), gb = torch::randn({3}).to(torch::kBFloat16);
      SetGrads(bf16, gw, gb);
      SetGrads(fp32, gw, gb);
      ASSERT_TRUE(store->OptimizerStep(1e-2, 0.5, step).ok());
      ASSERT_TRUE(reference->OptimizerStep(1e-2, 0.5, step).ok());
      // Under zero 1 the masters outside the owned shard are gathered on demand.
      ASSERT_TRUE(store->SyncMasters().ok());
      EXPECT_TRUE(torch::equal(store->MasterValue(0), fp32.w.detach())) << "zero " << zero << " step " << step;
      EXPECT_TRUE(torch::equal(store->MasterValue(1), fp32.b.detach())) << "zero " << zero << " step " << step;
      EXPECT_TRUE(torch::equal(bf16.w.detach(), fp32.w.detach().to(torch::kBFloat16))) << "the copy is refreshed";
    }

    // A checkpoint holds the masters (this rank's range of them), not their bf16 roundings.
    std::map<std::string, torch::Tensor> state;
    for (const auto& [key, value] : store->ModelState({"w", "b"})) state[key] = value;
    ASSERT_TRUE(state.count("model.w") && state.count("range.w"));
    const int64_t begin = state["range.w"][0].item<int64_t>(), end = state["range.w"][1].item<int64_t>();
    EXPECT_GT(end, begin);
    EXPECT_TRUE(torch::equal(state["model.w"], fp32.w.detach().reshape(-1).narrow(0, begin, end - begin)));
    // A load sets the master and its copy.
    torch::Tensor loaded = torch::randn({12});
    ASSERT_TRUE(store->LoadParamState(0, loaded, torch::zeros({12}), torch::zeros({12})).ok());
    EXPECT_TRUE(torch::equal(store->MasterValue(0).reshape(-1), loaded));
    EXPECT_TRUE(torch::equal(bf16.w.detach().reshape(-1), loaded.to(torch::kBFloat16)));
  }
}

// Transient gradients (one data-parallel rank, zero 0): no gradients between steps; a unit's buffer
// made before backward (PrepareGradients), after it from what autograd gave the leaves
// (FinishBackward), or between two backwards of one step (the first's gradients copied in); the
// store trains exactly as one that keeps its buffers.
TEST(ParamStoreTest, TransientGradientsTrainAsKeptOnes) {
  FakeCommunicator dp_kept, dp_transient;
  Leaves kept = MakeLeaves(), transient = MakeLeaves();
  std::unique_ptr<ParamStore> reference = MakeStore(kept, 0, &dp_kept, /*bf16=*/true);
  std::unique_ptr<ParamStore> store = MakeStore(transient, 0, &dp_transient, /*bf16=*/true);
  ASSERT_TRUE(store->UseTransientGradients());
  EXPECT_TRUE(store->transient_gradients());
  EXPECT_FALSE(transient.w.grad().defined());
  const torch::Tensor cw = torch::randn({4, 3}), cb = torch::randn({3});
  auto backward = [&](Leaves& leaves, int64_t step) {
    ((leaves.w.to(torch::kFloat) * cw * static_cast<double>(step)).sum() + (leaves.b.to(torch::kFloat) * cb).square().sum())
        .backward();
  };
  for (int64_t step = 1; step <= 3; ++step) {
    reference->ZeroGrads();
    store->ZeroGrads();
    if (step == 1) store->PrepareGradients(0);
    backward(kept, step);
    backward(transient, step);
    if (step == 3) {
      store->PrepareGradients(0);
      backward(kept, step);
      backward(transient, step);
    }
    ASSERT_TRUE(reference->FinishBackward().ok());
    ASSERT_TRUE(store->FinishBackward().ok());
    EXPECT_TRUE(torch::equal(transient.w.grad(), kept.w.grad())) << "step " << step;
    EXPECT_TRUE(torch::equal(transient.b.grad(), kept.b.grad())) << "step " << step;
    EXPECT_TRUE(torch::equal(store->GradSquareSum(), reference->GradSquareSum())) << "step " << step;
    ASSERT_TRUE(reference->OptimizerStep(1e-2, 1.0, step).ok());
    ASSERT_TRUE(store->OptimizerStep(1e-2, 1.0, step).ok());
    EXPECT_FALSE(transient.w.grad().defined()) << "released after the update, step " << step;
    EXPECT_FALSE(transient.b.grad().defined()) << "released after the update, step " << step;
    EXPECT_TRUE(kept.w.grad().defined());
    EXPECT_TRUE(torch::equal(store->MasterValue(0), reference->MasterValue(0))) << "step " << step;
    EXPECT_TRUE(torch::equal(store->MasterValue(1), reference->MasterValue(1))) << "step " << step;
  }
  // Gradients are counted as held: backward holds them all by its end.
  EXPECT_EQ(store->Memory().grads, reference->Memory().grads);

  // Where gradients are reduced (two data-parallel ranks) or sharded, they stay.
  for (const auto& [zero, ranks] : {std::pair{0, 2}, std::pair{3, 1}}) {
    FakeCommunicator dp;
    dp.SimulateSize(ranks);
    Leaves leaves = MakeLeaves();
    std::unique_ptr<ParamStore> other = MakeStore(leaves, zero, &dp, /*bf16=*/true);
    EXPECT_FALSE(other->UseTransientGradients()) << "zero " << zero << " over " << ranks;
  }
}

// Two real ranks (threads over Gloo): zero 1 with bf16 copies reduce-scatters the gradients, updates
// its shard of the masters and all-gathers the bf16 copies; it must train exactly as zero 0 does
// (all-reduce, full update), its masters must match once synchronized, and so must a checkpoint.
// A Gloo group that also hands out memory "every rank writes into directly" (host memory here; on
// GPUs NCCL's symmetric windows), or fails to make it, as NCCL can.
class SymmetricGloo : public Communicator {
 public:
  SymmetricGloo(std::unique_ptr<Communicator> inner, bool fail) : inner_(std::move(inner)), fail_(fail) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  Status AllReduceSum(at::Tensor& t) override { return inner_->AllReduceSum(t); }
  Status AllReduceMean(at::Tensor& t) override { return inner_->AllReduceMean(t); }
  Status Broadcast(at::Tensor& t, int root) override { return inner_->Broadcast(t, root); }
  Status AllGather(const at::Tensor& in, at::Tensor& out) override { return inner_->AllGather(in, out); }
  Status ReduceScatterSum(const at::Tensor& in, at::Tensor& out) override { return inner_->ReduceScatterSum(in, out); }
  Status ReduceScatterMean(const at::Tensor& in, at::Tensor& out) override { return inner_->ReduceScatterMean(in, out); }
  Status Barrier() override { return inner_->Barrier(); }
  Status AllToAll(const at::Tensor& in, const std::vector<int64_t>& send, at::Tensor& out,
                  const std::vector<int64_t>& recv) override {
    return inner_->AllToAll(in, send, out, recv);
  }
  Status Send(const at::Tensor& t, int dst, uint32_t tag) override { return inner_->Send(t, dst, tag); }
  Status Recv(at::Tensor& t, int src, uint32_t tag) override { return inner_->Recv(t, src, tag); }
  Status WaitSends() override { return inner_->WaitSends(); }
  StatusOr<at::Tensor> AllocateSymmetric(int64_t bytes) override {
    if (fail_) return Internal("ncclCommWindowRegister: unhandled cuda error");
    memory_.push_back(torch::zeros({bytes}, torch::kByte));
    return memory_.back();
  }
  bool Holds(const void* p) const {
    for (const at::Tensor& m : memory_) {
      const auto* begin = static_cast<const uint8_t*>(m.data_ptr());
      if (p >= begin && p < begin + m.numel()) return true;
    }
    return false;
  }

 private:
  std::unique_ptr<Communicator> inner_;
  bool fail_;
  std::vector<at::Tensor> memory_;
};

// ZeRO-1's sharded update trains as zero 0, also with its bf16 copies moved into memory every rank
// writes into directly (UseSymmetricGathers: on GPUs, so that their all-gathers run on the copy
// engines).
TEST(ParamStoreTest, ShardedZero1UpdateTrainsAsZero0OnTwoRanks) {
  gloo::rendezvous::HashStore rendezvous_sharded, rendezvous_plain, rendezvous_symmetric;
  std::vector<std::string> failures(2);
  std::vector<torch::Tensor> sharded_w(2), plain_w(2), sharded_masters(2), plain_masters(2), sharded_model(2),
      sharded_range(2), symmetric_w(2), symmetric_masters(2);
  std::vector<int64_t> symmetric_bytes(2);
  std::vector<int> inside(2);
  const Leaves start = MakeLeaves();
  const RankGrads grads = DrawRankGrads(2, 3);
  auto rank_main = [&](int rank) {
    auto comm_sharded = GlooCommunicator::Create(rendezvous_sharded, rank, 2, "127.0.0.1", std::chrono::seconds(20));
    auto comm_plain = GlooCommunicator::Create(rendezvous_plain, rank, 2, "127.0.0.1", std::chrono::seconds(20));
    auto comm_symmetric = GlooCommunicator::Create(rendezvous_symmetric, rank, 2, "127.0.0.1", std::chrono::seconds(20));
    if (!comm_sharded.ok() || !comm_plain.ok() || !comm_symmetric.ok()) {
      failures[rank] = "no communicator";
      return;
    }
    SymmetricGloo symmetric_comm(std::move(comm_symmetric).value(), /*fail=*/false);
    Leaves a = CopyOf(start), b = CopyOf(start), c = CopyOf(start);
    std::unique_ptr<ParamStore> sharded = MakeStore(a, /*zero=*/1, comm_sharded->get(), /*bf16=*/true);
    std::unique_ptr<ParamStore> plain = MakeStore(b, /*zero=*/0, comm_plain->get(), /*bf16=*/true);
    std::unique_ptr<ParamStore> symmetric = MakeStore(c, /*zero=*/1, &symmetric_comm, /*bf16=*/true);
    if (!symmetric->UseSymmetricGathers()) failures[rank] = "UseSymmetricGathers: false";
    if (!torch::equal(c.w.detach(), start.w.detach().to(torch::kBFloat16)) ||
        !torch::equal(c.b.detach(), start.b.detach().to(torch::kBFloat16))) {
      failures[rank] = "the bf16 copies lost their values moving into symmetric memory";
    }
    for (int64_t step = 1; step <= 3; ++step) {
      for (ParamStore* s : {sharded.get(), plain.get(), symmetric.get()}) s->ZeroGrads();
      const auto& [gw, gb] = grads[rank][step - 1];
      SetGrads(a, gw, gb);
      SetGrads(b, gw, gb);
      SetGrads(c, gw, gb);
      for (ParamStore* s : {sharded.get(), plain.get(), symmetric.get()}) {
        if (Status st = s->ReduceAll(); !st.ok()) failures[rank] = st.ToString();
        // The sharded store leaves its copies' gathers in flight, as the trainer does.
        if (Status st = s->OptimizerStep(1e-2, 1.0, step, {}, /*defer_compute=*/true); !st.ok()) failures[rank] = st.ToString();
      }
    }
    if (!sharded->sharded_update() || plain->sharded_update()) failures[rank] = "sharded_update() is wrong";
    for (ParamStore* s : {sharded.get(), symmetric.get()}) {
      if (Status st = s->AwaitCompute(0); !st.ok()) failures[rank] = st.ToString();
    }
    symmetric_w[rank] = c.w.detach().clone();
    inside[rank] = symmetric_comm.Holds(c.w.data_ptr()) && symmetric_comm.Holds(c.b.data_ptr());
    symmetric_bytes[rank] = symmetric->symmetric_bytes();
    if (Status st = symmetric->SyncMasters(); !st.ok()) failures[rank] = st.ToString();
    symmetric_masters[rank] = torch::cat({symmetric->MasterValue(0).reshape(-1), symmetric->MasterValue(1).reshape(-1)});
    sharded_w[rank] = a.w.detach().clone();
    plain_w[rank] = b.w.detach().clone();
    if (Status st = sharded->SyncMasters(); !st.ok()) failures[rank] = st.ToString();
    sharded_masters[rank] = torch::cat({sharded->MasterValue(0).reshape(-1), sharded->MasterValue(1).reshape(-1)});
    plain_masters[rank] = torch::cat({plain->MasterValue(0).reshape(-1), plain->MasterValue(1).reshape(-1)});
    for (const auto& [key, value] : sharded->ModelState({"w", "b"})) {
      if (key == "model.w") sharded_model[rank] = value;
      if (key == "range.w") sharded_range[rank] = value;
    }
  };
  std::thread r0(rank_main, 0), r1(rank_main, 1);
  r0.join();
  r1.join();
  int64_t saved_elements = 0;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(failures[r], "") << "rank " << r;
    EXPECT_TRUE(torch::equal(sharded_w[r], plain_w[r])) << "rank " << r << ": the bf16 copies";
    EXPECT_TRUE(torch::equal(sharded_masters[r], plain_masters[r])) << "rank " << r << ": the masters";
    EXPECT_TRUE(torch::equal(symmetric_w[r], plain_w[r])) << "rank " << r << ": the bf16 copies in symmetric memory";
    EXPECT_TRUE(torch::equal(symmetric_masters[r], plain_masters[r])) << "rank " << r << ": the masters beside them";
    EXPECT_TRUE(inside[r]) << "rank " << r << ": the leaves are not in the symmetric memory";
    EXPECT_EQ(symmetric_bytes[r], 512) << "rank " << r << ": one unit of 16 bf16 values, at 512-byte alignment";
    // Each rank saves its shard of the masters; together they cover w (12 elements) once.
    const int64_t begin = sharded_range[r][0].item<int64_t>(), end = sharded_range[r][1].item<int64_t>();
    EXPECT_TRUE(torch::equal(sharded_model[r], plain_masters[r].narrow(0, begin, end - begin))) << "rank " << r << ": the checkpoint";
    saved_elements += end - begin;
  }
  EXPECT_EQ(saved_elements, 12);
  // The step moved the parameters away from where they started.
  EXPECT_FALSE(torch::equal(plain_w[0], start.w.detach().to(torch::kBFloat16)));
}

// Two real ranks (threads over Gloo): zero 3 with bf16 copies keeps only its fp32 shard, gathers
// the bf16 copies before use, and reduce-scatters the bf16 gradient buffer PrepareGradients made.
// It must train exactly as zero 1 with bf16 copies does, its copies and masters equal to zero 1's.
TEST(ParamStoreTest, Zero3WithBf16CopiesTrainsAsZero1OnTwoRanks) {
  gloo::rendezvous::HashStore rendezvous_z3, rendezvous_z1;
  std::vector<std::string> failures(2);
  std::vector<torch::Tensor> z3_w(2), z1_w(2), z3_masters(2), z1_masters(2), z3_model(2), z3_range(2);
  const Leaves start = MakeLeaves();
  const RankGrads grads = DrawRankGrads(2, 3);
  auto rank_main = [&](int rank) {
    auto comm_z3 = GlooCommunicator::Create(rendezvous_z3, rank, 2, "127.0.0.1", std::chrono::seconds(20));
    auto comm_z1 = GlooCommunicator::Create(rendezvous_z1, rank, 2, "127.0.0.1", std::chrono::seconds(20));
    if (!comm_z3.ok() || !comm_z1.ok()) {
      failures[rank] = "no communicator";
      return;
    }
    Leaves a = CopyOf(start), b = CopyOf(start);
    std::unique_ptr<ParamStore> z3 = MakeStore(a, /*zero=*/3, comm_z3->get(), /*bf16=*/true);
    std::unique_ptr<ParamStore> z1 = MakeStore(b, /*zero=*/1, comm_z1->get(), /*bf16=*/true);
    for (int64_t step = 1; step <= 3; ++step) {
      z3->ZeroGrads();
      z1->ZeroGrads();
      // As the backward hook does before the unit's backward.
      z3->ArmHooks(true);
      z3->PrepareGradients(0);
      if (!a.w.grad().defined() || a.w.grad().scalar_type() != torch::kBFloat16) failures[rank] = "no bf16 gradient buffer";
      const auto& [gw, gb] = grads[rank][step - 1];
      SetGrads(a, gw, gb);
      SetGrads(b, gw, gb);
      for (ParamStore* s : {z3.get(), z1.get()}) {
        if (Status st = s->ReduceAll(); !st.ok()) failures[rank] = st.ToString();
        if (Status st = s->OptimizerStep(1e-2, 1.0, step); !st.ok()) failures[rank] = st.ToString();
      }
      if (a.w.grad().defined()) failures[rank] = "the gradient buffer outlived its reduction";
    }
    if (Status st = z3->Gather(0); !st.ok()) failures[rank] = st.ToString();
    z3_w[rank] = a.w.detach().clone();
    z1_w[rank] = b.w.detach().clone();
    z3->Release(0);
    if (Status st = z3->GatherMasterUnit(0); !st.ok()) failures[rank] = st.ToString();
    z3_masters[rank] = torch::cat({z3->MasterValue(0).reshape(-1), z3->MasterValue(1).reshape(-1)});
    z3->ReleaseMasterUnit(0);
    if (Status st = z1->SyncMasters(); !st.ok()) failures[rank] = st.ToString();
    z1_masters[rank] = torch::cat({z1->MasterValue(0).reshape(-1), z1->MasterValue(1).reshape(-1)});
    for (const auto& [key, value] : z3->ModelState({"w", "b"})) {
      if (key == "model.w") z3_model[rank] = value;
      if (key == "range.w") z3_range[rank] = value;
    }
  };
  std::thread r0(rank_main, 0), r1(rank_main, 1);
  r0.join();
  r1.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(failures[r], "") << "rank " << r;
    EXPECT_EQ(z3_w[r].scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(z3_w[r], z1_w[r])) << "rank " << r << ": the gathered bf16 copies";
    EXPECT_TRUE(torch::equal(z3_masters[r], z1_masters[r])) << "rank " << r << ": the masters";
    const int64_t begin = z3_range[r][0].item<int64_t>(), end = z3_range[r][1].item<int64_t>();
    EXPECT_TRUE(torch::equal(z3_model[r], z1_masters[r].narrow(0, begin, end - begin))) << "rank " << r << ": the checkpoint";
  }
  EXPECT_FALSE(torch::equal(z3_masters[0], torch::cat({start.w.reshape(-1), start.b.reshape(-1)})));
}

// ZeRO-3 gathering each unit's bf16 copy in place into slots of such memory trains as gathering into
// the allocator's memory does; the slots are reused from step to step; where the memory cannot be
// made, the units gather into the allocator's memory.
TEST(ParamStoreTest, Zero3GathersIntoReusedSlotsAsIntoTheAllocatorsMemory) {
  for (const bool fail : {false, true}) {
    gloo::rendezvous::HashStore rendezvous_slots, rendezvous_plain;
    std::vector<std::string> failures(2);
    std::vector<torch::Tensor> slots_w(2), plain_w(2), slots_masters(2), plain_masters(2);
    std::vector<int64_t> bytes_first(2), bytes_last(2), bytes_end(2);
    std::vector<int> inside(2);
    const Leaves start = MakeLeaves();
    const RankGrads grads = DrawRankGrads(2, 3);
    auto rank_main = [&](int rank) {
      auto comm_slots = GlooCommunicator::Create(rendezvous_slots, rank, 2, "127.0.0.1", std::chrono::seconds(20));
      auto comm_plain = GlooCommunicator::Create(rendezvous_plain, rank, 2, "127.0.0.1", std::chrono::seconds(20));
      if (!comm_slots.ok() || !comm_plain.ok()) {
        failures[rank] = "no communicator";
        return;
      }
      SymmetricGloo symmetric(std::move(comm_slots).value(), fail);
      Leaves a = CopyOf(start), b = CopyOf(start);
      // Two units (w, then b), so that two slots of different sizes exist once both are gathered.
      std::unique_ptr<ParamStore> slots = MakeStore(a, /*zero=*/3, &symmetric, /*bf16=*/true, {{0}, {1}});
      std::unique_ptr<ParamStore> plain = MakeStore(b, /*zero=*/3, comm_plain->get(), /*bf16=*/true, {{0}, {1}});
      if (!slots->UseSymmetricGathers()) failures[rank] = "UseSymmetricGathers: false";
      for (int64_t step = 1; step <= 3; ++step) {
        const auto& [gw, gb] = grads[rank][step - 1];
        for (ParamStore* s : {slots.get(), plain.get()}) {
          s->ZeroGrads();  // gathers the forward's first unit (b)
          s->ArmHooks(true);
          s->PrepareGradients(0);
          s->PrepareGradients(1);
        }
        SetGrads(a, gw, gb);
        SetGrads(b, gw, gb);
        for (ParamStore* s : {slots.get(), plain.get()}) {
          if (Status st = s->ReduceAll(); !st.ok()) failures[rank] = st.ToString();
          if (Status st = s->OptimizerStep(1e-2, 1.0, step); !st.ok()) failures[rank] = st.ToString();
        }
        if (step == 1) bytes_first[rank] = slots->symmetric_bytes();
        if (step == 3) bytes_last[rank] = slots->symmetric_bytes();
      }
      for (ParamStore* s : {slots.get(), plain.get()}) {
        for (int u : {0, 1}) {
          if (Status st = s->Gather(u); !st.ok()) failures[rank] = st.ToString();
        }
      }
      bytes_end[rank] = slots->symmetric_bytes();
      inside[rank] = symmetric.Holds(a.w.data_ptr()) && symmetric.Holds(a.b.data_ptr());
      slots_w[rank] = torch::cat({a.w.detach().reshape(-1), a.b.detach().reshape(-1)});
      plain_w[rank] = torch::cat({b.w.detach().reshape(-1), b.b.detach().reshape(-1)});
      for (auto [s, out] : {std::pair{slots.get(), &slots_masters}, std::pair{plain.get(), &plain_masters}}) {
        for (int u : {0, 1}) {
          s->Release(u);
          if (Status st = s->GatherMasterUnit(u); !st.ok()) failures[rank] = st.ToString();
        }
        (*out)[rank] = torch::cat({s->MasterValue(0).reshape(-1), s->MasterValue(1).reshape(-1)});
      }
    };
    std::thread r0(rank_main, 0), r1(rank_main, 1);
    r0.join();
    r1.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(failures[r], "") << "rank " << r;
      EXPECT_TRUE(torch::equal(slots_w[r], plain_w[r])) << "rank " << r << ": the gathered bf16 copies";
      EXPECT_TRUE(torch::equal(slots_masters[r], plain_masters[r])) << "rank " << r << ": the masters";
      if (fail) {
        EXPECT_EQ(bytes_end[r], 0) << "rank " << r;
        EXPECT_FALSE(inside[r]) << "rank " << r;
      } else {
        // One slot for b during the steps (8 bytes), kept; w's (24 bytes) once both are gathered.
        EXPECT_EQ(bytes_first[r], 8) << "rank " << r;
        EXPECT_EQ(bytes_last[r], 8) << "rank " << r << ": a slot was not reused";
        EXPECT_EQ(bytes_end[r], 32) << "rank " << r;
        EXPECT_TRUE(inside[r]) << "rank " << r << ": the leaves are not in the slots";
      }
    }
    EXPECT_FALSE(torch::equal(slots_masters[0], torch::cat({start.w.reshape(-1), start.b.reshape(-1)})));
  }
}

// A store whose collectives run inline on the computation's stream (exclusive_collectives: tensor or
// pipeline parallel beside dp) makes no symmetric memory: on GPUs that stream is LibTorch's legacy
// default stream, on which NCCL's copy-engine all-gathers fail. Its units gather as without the call.
TEST(ParamStoreTest, AnExclusiveStoreMakesNoSymmetricMemory) {
  for (const int zero : {1, 3}) {
    for (const bool exclusive : {true, false}) {
      auto fake = std::make_unique<FakeCommunicator>();
      fake->SimulateSize(2);
      SymmetricGloo dp(std::move(fake), /*fail=*/false);
      Leaves leaves = MakeLeaves();
      std::unique_ptr<ParamStore> store = MakeStore(leaves, zero, &dp, /*bf16=*/true, {{0}, {1}}, exclusive);
      EXPECT_EQ(store->UseSymmetricGathers(), !exclusive) << "zero " << zero << " exclusive " << exclusive;
      if (exclusive) {
        EXPECT_EQ(store->symmetric_bytes(), 0) << "zero " << zero;
        EXPECT_FALSE(dp.Holds(leaves.w.data_ptr())) << "zero " << zero;
      } else if (zero == 1) {
        EXPECT_TRUE(dp.Holds(leaves.w.data_ptr())) << "the kept bf16 copies did not move";
      }
    }
  }
}

// Where other communicators run collectives while the data-parallel ones would be in flight (tensor
// or pipeline parallel on GPUs), the data-parallel collectives are issued by the thread that asks
// for them (here the one running backward, whose hooks launch the reductions), in its order;
// otherwise by the store's reduction thread.
TEST(ParamStoreTest, ExclusiveCollectivesAreIssuedByTheCallingThread) {
  for (const bool exclusive : {true, false}) {
    FakeCommunicator dp;
    dp.SimulateSize(2);
    Leaves leaves = MakeLeaves();
    std::vector<ParamStore::Param> params = {{&leaves.w, true, true}, {&leaves.b, false, true}};
    StatusOr<std::unique_ptr<ParamStore>> made =
        ParamStore::Create(params, {{0, 1}}, /*zero=*/0, &dp, AdamWConfig{}, /*bf16_compute=*/false, exclusive);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    std::unique_ptr<ParamStore> store = std::move(made).value();
    const int before = dp.calls();
    store->ZeroGrads();
    store->ArmHooks(true);
    (leaves.w.sum() + leaves.b.sum()).backward();
    ASSERT_TRUE(store->FinishBackward().ok());
    ASSERT_GT(dp.calls(), before);
    for (int i = before; i < dp.calls(); ++i) {
      EXPECT_EQ(dp.log()[i].thread == std::this_thread::get_id(), exclusive) << dp.log()[i].op;
    }
    // The mean over two ranks that all hold the same gradient: that gradient.
    EXPECT_TRUE(torch::allclose(leaves.w.grad(), torch::ones({4, 3})));
  }
}

// On a GPU, a queue that runs its jobs inline on a stream of their own (tensor or pipeline parallel
// beside dp) orders each job after what the enqueuing stream held when it was enqueued, and Wait
// orders the enqueuing stream after the job: long work before each write of x would otherwise let
// the job read a stale x, or the check read y before the job wrote it.
TEST(ReductionQueueTest, InlineJobsOnAStreamOfTheirOwnAreOrderedBothWays) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  ReductionQueue queue(/*threaded=*/false, cuda, /*own_stream=*/true);
  EXPECT_TRUE(queue.apart());
  const int64_t n = 1 << 22;
  torch::Tensor a = torch::randn({4096, 4096}, cuda);
  torch::Tensor x = torch::zeros({n}, cuda);
  torch::Tensor y = torch::zeros({n}, cuda);
  for (int round = 1; round <= 3; ++round) {
    for (int i = 0; i < 20; ++i) a = torch::tanh(torch::matmul(a, a) * 1e-2);
    x.add_(a.sum() * 0 + 1);  // x = round, written after the products
    const int64_t job = queue.Enqueue([x, y]() mutable {
      for (int i = 0; i < 20; ++i) y.copy_(x * 2);
      return Status::Ok();
    });
    ASSERT_TRUE(queue.Wait(job).ok());
    EXPECT_EQ(y.sum().item<double>(), 2.0 * round * static_cast<double>(n)) << "round " << round;
  }
  // A job's error comes back from Wait.
  const int64_t failing = queue.Enqueue([] { return Internal("refused"); });
  EXPECT_FALSE(queue.Wait(failing).ok());
}

// Off the GPU (or without a stream of its own) an inline queue runs its jobs on the caller's stream:
// not apart, so no copy-engine gathers.
TEST(ReductionQueueTest, AnInlineQueueOnTheCpuIsNotApart) {
  ReductionQueue inline_queue(/*threaded=*/false, torch::Device(torch::kCPU), /*own_stream=*/true);
  EXPECT_FALSE(inline_queue.apart());
  ReductionQueue threaded(/*threaded=*/true, torch::Device(torch::kCPU), /*own_stream=*/true);
  EXPECT_TRUE(threaded.apart());
}

}  // namespace
}  // namespace ltrain::worker
