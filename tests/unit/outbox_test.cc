#include "agent/outbox.h"
#include "agent/worker_credentials.h"

#include <gtest/gtest.h>

#include <grpcpp/support/status_code_enum.h>

#include <vector>

namespace ltrain::agent {
namespace {

// Only the coordinator's absence, slowness or a refusal of the agent's own credentials is worth
// another try; a refusal of what a message holds is for good.
TEST(OutboxTest, OnlyAnAwayOrBusyCoordinatorIsTriedAgain) {
  for (grpc::StatusCode code : {grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::DEADLINE_EXCEEDED,
                                grpc::StatusCode::CANCELLED, grpc::StatusCode::UNAUTHENTICATED}) {
    EXPECT_TRUE(IsRetryable(code)) << code;
  }
  for (grpc::StatusCode code : {grpc::StatusCode::RESOURCE_EXHAUSTED, grpc::StatusCode::INVALID_ARGUMENT,
                                grpc::StatusCode::INTERNAL, grpc::StatusCode::UNKNOWN, grpc::StatusCode::NOT_FOUND,
                                grpc::StatusCode::FAILED_PRECONDITION}) {
    EXPECT_FALSE(IsRetryable(code)) << code;
  }
}

TEST(OutboxTest, ADroppedBatchLeavesOneLineSayingWhatAndWhere) {
  v1::PushLogsRequest batch;
  batch.set_job_id("j-1");
  batch.set_node_id("node-a");
  for (int rank : {3, 1, 3}) {
    v1::LogLine* line = batch.add_lines();
    line->set_rank(rank);
    line->set_text("x");
  }
  std::optional<v1::PushLogsRequest> notice = DroppedLinesNotice(batch, "8: message larger than max \xff");
  ASSERT_TRUE(notice.has_value());
  EXPECT_EQ(notice->job_id(), "j-1");
  ASSERT_EQ(notice->lines_size(), 1);
  EXPECT_EQ(notice->lines(0).rank(), 3);
  EXPECT_EQ(notice->lines(0).text(),
            "ltrain agent: 3 line(s) of rank(s) 1, 3 were refused by the coordinator (8: message larger than max "
            "\xef\xbf\xbd) and dropped; the rank log files on node node-a hold them");
  EXPECT_FALSE(DroppedLinesNotice(*notice, "again").has_value()) << "no notice of a notice";
  EXPECT_FALSE(DroppedLinesNotice(v1::PushLogsRequest(), "empty").has_value());
}

// A job generation's secret opens only that generation's grant; a newer generation's replaces it.
TEST(WorkerCredentialsTest, ASecretGrantsItsOwnJobGenerationOnly) {
  WorkerCredentials credentials;
  const std::string a1 = credentials.Issue("a-1", 0, "a-1/0/");
  const std::string b1 = credentials.Issue("b-1", 3, "b-1/3/");
  EXPECT_EQ(a1.size(), 64u);
  EXPECT_NE(a1, b1);
  std::optional<WorkerGrant> grant = credentials.Find("Bearer " + a1);
  ASSERT_TRUE(grant.has_value());
  EXPECT_EQ(grant->job_id, "a-1");
  EXPECT_EQ(grant->generation, 0);
  EXPECT_EQ(grant->rendezvous_scope, "a-1/0/");
  EXPECT_EQ(credentials.Find("Bearer " + b1)->job_id, "b-1");
  for (const std::string& wrong : std::vector<std::string>{std::string(), a1, "Bearer", "Bearer ", "bearer " + a1, "Bearer " + a1 + "x",
                                   "Bearer " + a1.substr(1)}) {
    EXPECT_FALSE(credentials.Find(wrong).has_value()) << wrong;
  }
  const std::string a2 = credentials.Issue("a-1", 1, "a-1/1/");
  EXPECT_FALSE(credentials.Find("Bearer " + a1).has_value()) << "the old generation's secret is revoked";
  EXPECT_EQ(credentials.Find("Bearer " + a2)->generation, 1);
  EXPECT_EQ(credentials.Issue("a-1", 0, "a-1/0/"), "") << "no secret for an older generation than the current one";
  credentials.Revoke("a-1", 0);
  EXPECT_TRUE(credentials.Find("Bearer " + a2).has_value()) << "revoking an older generation keeps the newer one's";
  credentials.Revoke("a-1", 1);
  EXPECT_FALSE(credentials.Find("Bearer " + a2).has_value()) << "its generation ended";
  EXPECT_TRUE(credentials.Find("Bearer " + b1).has_value());
}

}  // namespace
}  // namespace ltrain::agent
