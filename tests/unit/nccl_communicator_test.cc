// The NCCL communicator of a job that recovers in place (fault.recovery: in_place), on one GPU: a
// group of one whose abort, from another thread, turns every later call and Health() into
// Unavailable naming the failure, where a communicator of a restarting job ends the process. Built
// only where the worker has NCCL; skips without a GPU.
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include <unistd.h>

#include <gtest/gtest.h>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "worker/comm/nccl_communicator.h"
#include "worker/control/rendezvous_store.h"

namespace ltrain::worker {
namespace {

std::string FreshDir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(NcclCommunicatorTest, AnAbortedRecoverableGroupFailsItsCallsInsteadOfTheProcess) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto store = ConnectRendezvousStore("file://" + FreshDir("ltrain-nccl-test"), "job-0");
  ASSERT_TRUE(store.ok()) << store.status().message();
  auto comm = NcclCommunicator::Create(**store, 0, 1, 0, std::chrono::seconds(60), "world", /*recoverable=*/true);
  ASSERT_TRUE(comm.ok()) << comm.status().message();
  NcclCommunicator& c = **comm;

  const auto cuda = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA, 0);
  torch::Tensor t = torch::full({1024}, 3.0, cuda);
  ASSERT_TRUE(c.AllReduceSum(t).ok());
  EXPECT_EQ(t.sum().item<double>(), 3.0 * 1024);
  // A ring's shift within a group of one: the rank sends to itself.
  torch::Tensor sent = torch::arange(256, cuda);
  torch::Tensor got = torch::zeros({256}, cuda);
  ASSERT_TRUE(c.SendRecv(sent, 0, got, 0, 7).ok());
  EXPECT_TRUE(torch::equal(sent, got));
  EXPECT_TRUE(c.Health().ok());

  // What the membership watch does when the next membership is announced: from its own thread.
  std::thread([&c] { c.Abort(); }).join();
  const Status after = c.AllReduceSum(t);
  EXPECT_EQ(after.code(), StatusCode::kUnavailable);
  EXPECT_NE(after.message().find("was aborted"), std::string::npos) << after.message();
  const Status health = c.Health();
  EXPECT_EQ(health.code(), StatusCode::kUnavailable);
  EXPECT_EQ(c.SendRecv(sent, 0, got, 0, 7).code(), StatusCode::kUnavailable);
  c.Abort();  // a second abort does nothing
  EXPECT_EQ(c.Health().message(), health.message());
}

// A group made again after an abort, under the next membership's keys (a new unique id), works.
TEST(NcclCommunicatorTest, AGroupMadeAgainAfterAnAbortWorks) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto base = ConnectRendezvousStore("file://" + FreshDir("ltrain-nccl-reform"), "job-0");
  ASSERT_TRUE(base.ok()) << base.status().message();
  auto first = NcclCommunicator::Create(*PrefixedView("epoch/0", **base), 0, 1, 0, std::chrono::seconds(60), "world", true);
  ASSERT_TRUE(first.ok()) << first.status().message();
  (*first)->Abort();
  auto second = NcclCommunicator::Create(*PrefixedView("epoch/1", **base), 0, 1, 0, std::chrono::seconds(60), "world", true);
  ASSERT_TRUE(second.ok()) << second.status().message();
  torch::Tensor t = torch::ones({8}, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA, 0));
  ASSERT_TRUE((*second)->Barrier().ok());
  ASSERT_TRUE((*second)->AllReduceMean(t).ok());
  EXPECT_EQ(t.sum().item<double>(), 8.0);
  EXPECT_TRUE((*second)->Health().ok());
}

// The communicator of a job that restarts on a failure (blocking, the watchdog ends the process):
// its collectives, and its ring's shift.
TEST(NcclCommunicatorTest, ABlockingGroupRunsItsCollectives) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto store = ConnectRendezvousStore("file://" + FreshDir("ltrain-nccl-blocking"), "job-0");
  ASSERT_TRUE(store.ok()) << store.status().message();
  auto comm = NcclCommunicator::Create(**store, 0, 1, 0, std::chrono::seconds(60));
  ASSERT_TRUE(comm.ok()) << comm.status().message();
  const auto cuda = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA, 0);
  torch::Tensor t = torch::full({64}, 2.0, cuda);
  ASSERT_TRUE((*comm)->AllReduceSum(t).ok());
  torch::Tensor all = torch::empty({64}, cuda);
  ASSERT_TRUE((*comm)->AllGather(t, all).ok());
  EXPECT_TRUE(torch::equal(all, t));
  torch::Tensor got = torch::zeros({64}, cuda);
  ASSERT_TRUE((*comm)->SendRecv(t, 0, got, 0, 1).ok());
  EXPECT_TRUE(torch::equal(got, t));
  EXPECT_TRUE((*comm)->Health().ok());
}

}  // namespace
}  // namespace ltrain::worker
