#include "worker/control/checkpoint_stop.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>

namespace ltrain::worker {
namespace {

using std::chrono::milliseconds;

// The generation's rendezvous store, shared by the ranks of a test: a key missing when a rank
// gathers is a timeout at once (no waiting), and publishing can be made to fail.
class FakeStore {
 public:
  void Connect(CheckpointStop& stop) {
    stop.Connect(
        [this](const std::string& key, const std::string& value) -> Status {
          if (fail_publish_) return Unavailable("the agent is unreachable");
          values_[key] = value;
          return Status::Ok();
        },
        [this](const std::vector<std::string>& keys, milliseconds timeout) -> StatusOr<std::vector<std::string>> {
          ++gathers_;
          std::vector<std::string> values;
          for (const auto& key : keys) {
            auto found = values_.find(key);
            if (found == values_.end()) {
              return Status(StatusCode::kDeadlineExceeded,
                            key + " not published within " + std::to_string(timeout.count()) + " ms");
            }
            values.push_back(found->second);
          }
          return values;
        });
  }

  std::map<std::string, std::string> values_;
  bool fail_publish_ = false;
  int gathers_ = 0;
};

class CheckpointStopTest : public ::testing::Test {
 protected:
  // `world` ranks, each connected to the store and begun at `start`.
  void Start(int world, int64_t start) {
    for (int rank = 0; rank < world; ++rank) {
      ranks_.push_back(std::make_unique<CheckpointStop>(rank, world, milliseconds(500)));
      store_.Connect(*ranks_.back());
      ranks_.back()->Begin(start);
    }
  }

  // Runs rank `rank` through `steps`; returns the step after which it stops (-1: none).
  int64_t RunTo(int rank, int64_t first, int64_t last) {
    for (int64_t step = first; step <= last; ++step) {
      StatusOr<bool> stop = ranks_[rank]->After(step);
      EXPECT_TRUE(stop.ok()) << stop.status().ToString();
      if (stop.ok() && *stop) return step;
    }
    return -1;
  }

  FakeStore store_;
  std::vector<std::unique_ptr<CheckpointStop>> ranks_;
};

TEST_F(CheckpointStopTest, WithoutARequestNoRankStopsOrWaits) {
  Start(2, 0);
  EXPECT_EQ(RunTo(0, 1, 50), -1);
  EXPECT_EQ(RunTo(1, 1, 50), -1);
  EXPECT_EQ(store_.gathers_, 0);
  EXPECT_FALSE(ranks_[0]->stop_step().has_value());
}

// Rank 1 learnt of the stop one step later than rank 0: both stop after rank 1's hold step.
TEST_F(CheckpointStopTest, RanksThatLearnOfTheStopAtDifferentStepsStopAfterTheSameOne) {
  Start(2, 10);
  EXPECT_EQ(RunTo(0, 11, 13), -1);
  EXPECT_EQ(RunTo(1, 11, 14), -1);
  ranks_[0]->Request();  // holds at 14
  ranks_[1]->Request();  // holds at 15
  EXPECT_EQ(store_.values_.at(CheckpointStop::HoldKey(0)), "14");
  EXPECT_EQ(store_.values_.at(CheckpointStop::HoldKey(1)), "15");
  EXPECT_EQ(RunTo(0, 14, 20), 15);
  EXPECT_EQ(RunTo(1, 15, 20), 15);
  EXPECT_EQ(ranks_[0]->stop_step(), 15);
  EXPECT_EQ(ranks_[1]->stop_step(), 15);
  EXPECT_EQ(store_.gathers_, 2) << "each rank gathers once, at its hold step";
}

// After ranks 1 and 2 left with a lost node (in place), ranks 0 and 3 agree between themselves.
TEST_F(CheckpointStopTest, TheMembersLeftAgreeWithoutTheRanksThatLeft) {
  Start(4, 10);
  for (int rank : {0, 3}) ranks_[rank]->SetMembers({0, 3});
  ranks_[0]->Request();  // holds at 11
  EXPECT_EQ(RunTo(3, 11, 11), -1);
  ranks_[3]->Request();  // holds at 12
  EXPECT_EQ(RunTo(0, 11, 20), 12);
  EXPECT_EQ(RunTo(3, 12, 20), 12);
  EXPECT_EQ(ranks_[0]->stop_step(), 12);
}

TEST_F(CheckpointStopTest, RequestBeforeTrainingBeginsHoldsAtTheFirstStep) {
  CheckpointStop stop(0, 2, milliseconds(500));
  store_.Connect(stop);
  stop.Request();
  stop.Request();  // idempotent
  EXPECT_TRUE(store_.values_.empty()) << "nothing to publish before the starting step is known";
  stop.Begin(120);  // resumed from step 120
  EXPECT_EQ(store_.values_.at(CheckpointStop::HoldKey(0)), "121");
  store_.values_[CheckpointStop::HoldKey(1)] = "121";
  StatusOr<bool> after = stop.After(121);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_TRUE(*after);
}

TEST_F(CheckpointStopTest, ARankThatNeverPublishesMakesTheWaitFailWithTheKeys) {
  Start(2, 0);
  ranks_[0]->Request();
  StatusOr<bool> after = ranks_[0]->After(1);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(after.status().message().find("rank 0 waited for every rank's stop step"), std::string::npos)
      << after.status().message();
  EXPECT_NE(after.status().message().find("stop/hold/1 not published"), std::string::npos) << after.status().message();
}

TEST_F(CheckpointStopTest, AFailedPublishFailsTheRankAtItsHoldStep) {
  Start(2, 5);
  store_.fail_publish_ = true;
  ranks_[1]->Request();  // holds at 6
  StatusOr<bool> after = ranks_[1]->After(6);
  ASSERT_FALSE(after.ok());
  EXPECT_NE(after.status().message().find("rank 1 could not publish its stop step 6: the agent is unreachable"),
            std::string::npos)
      << after.status().message();
  EXPECT_EQ(store_.gathers_, 0);
}

TEST_F(CheckpointStopTest, AMalformedHoldIsNamed) {
  Start(2, 0);
  ranks_[0]->Request();
  store_.values_[CheckpointStop::HoldKey(1)] = "soon";
  StatusOr<bool> after = ranks_[0]->After(1);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().message(), "stop/hold/1='soon' is not a step number");
}

TEST_F(CheckpointStopTest, OneRankNeedsNoStore) {
  CheckpointStop stop(0, 1);
  stop.Begin(0);
  StatusOr<bool> first = stop.After(1);
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(*first);
  stop.Request();
  StatusOr<bool> second = stop.After(2);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_TRUE(*second);
  EXPECT_EQ(stop.stop_step(), 2);
}

}  // namespace
}  // namespace ltrain::worker
