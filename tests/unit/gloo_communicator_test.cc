#include "worker/comm/gloo_communicator.h"

#include <unistd.h>

#include <filesystem>
#include <stdexcept>
#include <string>

#include <chrono>
#include <thread>
#include <vector>

#include <gloo/rendezvous/hash_store.h>
#include <gtest/gtest.h>
#include <torch/nn.h>

#include "common/files.h"
#include "worker/control/rendezvous_store.h"

namespace ltrain::worker {
namespace {

// The file rendezvous: values written whole under escaped names, scopes and group views apart, a
// missing key an error that names it once the wait times out.
TEST(RendezvousStoreTest, DirectoryStoreScopesAndPrefixedViews) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("ltrain-rdzv-" + std::to_string(::getpid()));
  RemoveTree(dir);
  auto a = ConnectRendezvousStore("file://" + dir.string(), "job/1");
  auto b = ConnectRendezvousStore("file://" + dir.string(), "job/2");
  ASSERT_TRUE(a.ok() && b.ok());
  (*a)->set("nccl/id", {'x', '\0', 'y'});
  EXPECT_EQ((*a)->get("nccl/id"), (std::vector<char>{'x', '\0', 'y'}));
  std::unique_ptr<gloo::rendezvous::Store> group = PrefixedView("group/tp-0", **a);
  std::thread writer([&] { group->set("rank/1", {'1'}); });
  EXPECT_EQ(group->get("rank/1"), std::vector<char>{'1'});
  writer.join();
  try {
    (*b)->wait({"nccl/id"}, std::chrono::milliseconds(5));
    ADD_FAILURE() << "another scope's key was seen";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("nccl/id"), std::string::npos) << e.what();
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename().string().find('/'), std::string::npos);
    EXPECT_NE(entry.path().filename().string().rfind(".tmp-", 0), 0u) << "a temporary file was left";
  }
  RemoveTree(dir);
}

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

// Three ranks; a group of ranks {0, 2} over its own store prefix; point-to-point messages matched by
// tag whatever order they are sent in; reduce-scatter.
TEST(GlooCommunicatorTest, GroupsSendRecvAndReduceScatter) {
  gloo::rendezvous::HashStore store;
  std::vector<Status> errors(3);
  std::vector<std::vector<float>> received(3), scattered(3);
  auto rank_main = [&](int rank) {
    auto world = GlooCommunicator::Create(store, rank, 3, "127.0.0.1", std::chrono::seconds(20));
    if (!world.ok()) {
      errors[rank] = world.status();
      return;
    }
    torch::Tensor in = torch::arange(6, torch::kFloat) * (rank + 1);
    torch::Tensor out = torch::zeros({2});
    if (Status s = (*world)->ReduceScatterSum(in, out); !s.ok()) errors[rank] = s;
    scattered[rank] = std::vector<float>(out.data_ptr<float>(), out.data_ptr<float>() + 2);
    if (rank == 1) return;
    Group group{"pair 0", {0, 2}};
    auto pair = GlooCommunicator::CreateGroup(**world, store, group, group.RankOf(rank));
    if (!pair.ok()) {
      errors[rank] = pair.status();
      return;
    }
    if (rank == 0) {
      // Sent in the opposite order to the one they are received in.
      if (Status s = (*pair)->Send(torch::full({2}, 7.0f), 1, /*tag=*/8); !s.ok()) errors[rank] = s;
      if (Status s = (*pair)->Send(torch::full({3}, 5.0f), 1, /*tag=*/3); !s.ok()) errors[rank] = s;
      if (Status s = (*pair)->WaitSends(); !s.ok()) errors[rank] = s;
    } else {
      torch::Tensor a = torch::zeros({3}), b = torch::zeros({2});
      if (Status s = (*pair)->Recv(a, 0, 3); !s.ok()) errors[rank] = s;
      if (Status s = (*pair)->Recv(b, 0, 8); !s.ok()) errors[rank] = s;
      received[rank] = {a[0].item<float>(), a[2].item<float>(), b[1].item<float>()};
    }
    torch::Tensor sum = torch::ones({1});
    if (Status s = (*pair)->AllReduceSum(sum); !s.ok()) errors[rank] = s;
    if (sum.item<float>() != 2.0f) errors[rank] = Internal("group all-reduce summed over the wrong ranks");
  };
  std::thread r0(rank_main, 0), r1(rank_main, 1), r2(rank_main, 2);
  r0.join();
  r1.join();
  r2.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r].ToString();
    // sum over ranks of arange(6)*(r+1) = 6*arange(6); rank r keeps elements [2r, 2r+2).
    EXPECT_EQ(scattered[r], (std::vector<float>{12.0f * r, 12.0f * r + 6}));
  }
  EXPECT_EQ(received[2], (std::vector<float>{5, 5, 7}));
}

TEST(GlooCommunicatorTest, RejectsBadRank) {
  gloo::rendezvous::HashStore store;
  EXPECT_FALSE(GlooCommunicator::Create(store, 2, 2, "127.0.0.1", std::chrono::seconds(1)).ok());
}

}  // namespace
}  // namespace ltrain::worker
