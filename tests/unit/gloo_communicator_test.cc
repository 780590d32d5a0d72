#include "worker/comm/gloo_communicator.h"

#include <unistd.h>

#include <filesystem>
#include <functional>
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

// Runs rank_main(r) for each of `ranks` ranks, each on a thread of its own, and waits for them all.
void RunRanks(int ranks, const std::function<void(int)>& rank_main) {
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(rank_main, r);
  for (std::thread& t : threads) t.join();
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
  RunRanks(2, rank_main);
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
  RunRanks(3, rank_main);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r].ToString();
    // sum over ranks of arange(6)*(r+1) = 6*arange(6); rank r keeps elements [2r, 2r+2).
    EXPECT_EQ(scattered[r], (std::vector<float>{12.0f * r, 12.0f * r + 6}));
  }
  EXPECT_EQ(received[2], (std::vector<float>{5, 5, 7}));
}

// Three ranks exchange rows of uneven counts (some none, some to themselves), bf16 rows of two: each
// receives, in source order, exactly the rows each source addressed to it. Then again with rank 0
// sending no row at all (an input of no rows) while it receives some.
TEST(GlooCommunicatorTest, ThreeRanksAllToAllUnevenRows) {
  gloo::rendezvous::HashStore store;
  using Counts = std::function<int64_t(int src, int dst)>;
  const std::vector<Counts> exchanges = {[](int src, int dst) -> int64_t { return (2 * src + dst) % 4; },
                                         [](int src, int dst) -> int64_t { return src == 0 ? 0 : src + dst; }};
  // Row j of those src sends dst: {100 src + 10 dst + j, j} (integers below 256: exact in bf16).
  const auto rows_of = [](const Counts& count, int src, int dst) {
    std::vector<float> v;
    for (int64_t j = 0; j < count(src, dst); ++j) v.insert(v.end(), {100.0f * src + 10.0f * dst + j, float(j)});
    return v;
  };
  std::vector<Status> errors(3);
  std::vector<std::vector<std::vector<float>>> got(3, std::vector<std::vector<float>>(exchanges.size()));
  std::vector<std::string> refused(3);
  auto rank_main = [&](int rank) {
    auto comm = GlooCommunicator::Create(store, rank, 3, "127.0.0.1", std::chrono::seconds(20));
    if (!comm.ok()) {
      errors[rank] = comm.status();
      return;
    }
    for (size_t x = 0; x < exchanges.size(); ++x) {
      std::vector<float> send;
      std::vector<int64_t> send_counts, recv_counts;
      for (int r = 0; r < 3; ++r) {
        const std::vector<float> rows = rows_of(exchanges[x], rank, r);
        send.insert(send.end(), rows.begin(), rows.end());
        send_counts.push_back(exchanges[x](rank, r));
        recv_counts.push_back(exchanges[x](r, rank));
      }
      const int64_t in_rows = static_cast<int64_t>(send.size()) / 2;
      torch::Tensor in = torch::tensor(send, torch::kFloat).reshape({in_rows, 2}).to(torch::kBFloat16);
      int64_t out_rows = 0;
      for (int64_t c : recv_counts) out_rows += c;
      torch::Tensor out = torch::zeros({out_rows, 2}, torch::kBFloat16);
      if (x == 0) {
        // Refused on every rank alike, before anything is sent: one count short.
        refused[rank] = (*comm)->AllToAll(in, {send_counts[0], send_counts[1]}, out, recv_counts).ToString();
      }
      if (Status s = (*comm)->AllToAll(in, send_counts, out, recv_counts); !s.ok()) errors[rank] = s;
      torch::Tensor f = out.to(torch::kFloat).contiguous();
      got[rank][x] = std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
    }
  };
  RunRanks(3, rank_main);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r].ToString();
    for (size_t x = 0; x < exchanges.size(); ++x) {
      std::vector<float> want;
      for (int src = 0; src < 3; ++src) {
        const std::vector<float> rows = rows_of(exchanges[x], src, r);
        want.insert(want.end(), rows.begin(), rows.end());
      }
      EXPECT_EQ(got[r][x], want) << "rank " << r << ", exchange " << x;
    }
    EXPECT_NE(refused[r].find("one send and one receive count a rank"), std::string::npos) << refused[r];
  }
}

// The checks every backend makes, through the group of one (which copies its rows).
TEST(GlooCommunicatorTest, AllToAllChecksItsCountsAndShapes) {
  SelfCommunicator self;
  torch::Tensor in = torch::arange(6, torch::kFloat).reshape({3, 2});
  torch::Tensor out = torch::zeros({3, 2});
  ASSERT_TRUE(self.AllToAll(in, {3}, out, {3}).ok());
  EXPECT_TRUE(torch::equal(in, out));
  torch::Tensor wide = torch::zeros({2, 3});
  EXPECT_NE(self.AllToAll(in, {3}, wide, {2}).ToString().find("rows of 2 elements in, 3 out"), std::string::npos);
  EXPECT_NE(self.AllToAll(in, {2}, out, {3}).ToString().find("sends 2 of the input's 3 rows"), std::string::npos);
  EXPECT_NE(self.AllToAll(in, {-1}, out, {3}).ToString().find("negative"), std::string::npos);
  torch::Tensor ints = torch::zeros({3, 2}, torch::kInt);
  EXPECT_NE(self.AllToAll(in, {3}, ints, {3}).ToString().find("output is Int, its input Float"), std::string::npos);
  // The fake rank 0 of 2 gets the rows every rank sends rank 0: the input's first chunk, twice.
  FakeCommunicator fake;
  fake.SimulateSize(2);
  torch::Tensor twice = torch::zeros({2, 2});
  ASSERT_TRUE(fake.AllToAll(in, {1, 2}, twice, {1, 1}).ok());
  EXPECT_EQ(twice[1][1].item<float>(), 1.0f);
  EXPECT_EQ(fake.log().back().op, "all_to_all");
}

TEST(GlooCommunicatorTest, RejectsBadRank) {
  gloo::rendezvous::HashStore store;
  EXPECT_FALSE(GlooCommunicator::Create(store, 2, 2, "127.0.0.1", std::chrono::seconds(1)).ok());
}

}  // namespace
}  // namespace ltrain::worker

namespace ltrain::worker {
namespace {

// The groups a rank makes, kind by kind in one order on every rank: with expert parallelism its ep
// and edp groups too; at ep 1 the ep group is one rank (made by nobody) and edp is dp itself.
TEST(ProcessGroupsTest, ExpertGroupsAreMadeAfterTheOthers) {
  FakeCommunicator world;
  world.SimulateSize(8);
  Layout layout = Layout::Grid(2, 4, 1);
  layout.ep = 2;
  std::vector<std::string> made;
  auto make = [&](const Group& group, int) -> StatusOr<std::unique_ptr<Communicator>> {
    made.push_back(group.name);
    auto comm = std::make_unique<FakeCommunicator>();
    comm->SimulateSize(static_cast<int>(group.ranks.size()));
    return std::unique_ptr<Communicator>(std::move(comm));
  };
  StatusOr<ProcessGroups> groups = BuildProcessGroups(layout, 5, &world, make);
  ASSERT_TRUE(groups.ok()) << groups.status().ToString();
  ASSERT_EQ(made.size(), 4u);
  EXPECT_EQ(made[0].rfind("tp ", 0), 0u);
  EXPECT_EQ(made[1].rfind("dp ", 0), 0u);
  EXPECT_EQ(made[2].rfind("ep ", 0), 0u);
  EXPECT_EQ(made[3].rfind("edp ", 0), 0u);
  EXPECT_EQ(groups->ep->size(), 2);
  EXPECT_EQ(groups->edp->size(), 2);

  layout.ep = 1;
  made.clear();
  groups = BuildProcessGroups(layout, 5, &world, make);
  ASSERT_TRUE(groups.ok()) << groups.status().ToString();
  EXPECT_EQ(made.size(), 2u) << "tp and dp only";
  EXPECT_EQ(groups->ep->size(), 1);
  EXPECT_EQ(groups->edp, groups->dp);
}

}  // namespace
}  // namespace ltrain::worker
