#include "worker/gloo_communicator.h"

#include <chrono>
#include <thread>
#include <vector>

#include <gloo/rendezvous/hash_store.h>
#include <gtest/gtest.h>
#include <torch/nn.h>

namespace ltrain::worker {
namespace {

// Two ranks as two threads, connected through real Gloo TCP pairs on loopback.
TEST(GlooCommunicatorTest, TwoRanksAllReduceBroadcastAllGatherBarrier) {
  gloo::rendezvous::HashStore store;
  std::vector<std::vector<float>> reduced(2), broadcast(2), gathered(2);
  std::vector<Status> errors(2);
  auto rank_main = [&](int rank) {
    auto comm = GlooCommunicator::Create(store, rank, 2, "127.0.0.1", std::chrono::seconds(20));
    if (!comm.ok()) {
      errors[rank] = comm.status();
      return;
    }
    torch::Tensor t = torch::full({5}, static_cast<float>(rank + 1));
    t[0] = rank == 0 ? 0.5f : 0.25f;
    errors[rank] = (*comm)->AllReduceSum(t);
    reduced[rank] = std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + 5);

    torch::Tensor b = torch::full({3}, static_cast<float>(10 * (rank + 1)));
    if (Status s = (*comm)->Broadcast(b, 1); !s.ok()) errors[rank] = s;
    broadcast[rank] = std::vector<float>(b.data_ptr<float>(), b.data_ptr<float>() + 3);

    torch::Tensor in = torch::full({2}, static_cast<float>(rank));
    torch::Tensor out = torch::zeros({4});
    if (Status s = (*comm)->AllGather(in, out); !s.ok()) errors[rank] = s;
    gathered[rank] = std::vector<float>(out.data_ptr<float>(), out.data_ptr<float>() + 4);

    torch::Tensor wide = torch::ones({3}, torch::kLong);
    if (Status s = (*comm)->AllReduceSum(wide); !s.ok()) errors[rank] = s;
    if (wide[2].item<int64_t>() != 2) errors[rank] = Internal("int64 all-reduce gave the wrong sum");
    if (Status s = (*comm)->Barrier(); !s.ok()) errors[rank] = s;
  };
  std::thread r0(rank_main, 0), r1(rank_main, 1);
  r0.join();
  r1.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r].ToString();
    EXPECT_EQ(reduced[r], (std::vector<float>{0.75f, 3, 3, 3, 3}));
    EXPECT_EQ(broadcast[r], (std::vector<float>{20, 20, 20}));
    EXPECT_EQ(gathered[r], (std::vector<float>{0, 0, 1, 1}));
  }
}

TEST(GlooCommunicatorTest, RejectsBadRank) {
  gloo::rendezvous::HashStore store;
  EXPECT_FALSE(GlooCommunicator::Create(store, 2, 2, "127.0.0.1", std::chrono::seconds(1)).ok());
}

}  // namespace
}  // namespace ltrain::worker
