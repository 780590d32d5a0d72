// The cross-rank reading of a program's flight-recorder dumps.
#include "launcher/flight_analysis.h"

#include <gtest/gtest.h>

#include <string>

namespace ltrain::launcher {
namespace {

v1::CollectiveRecord Collective(uint64_t seq, const std::string& state, const std::string& group = "default_pg",
                                const std::string& op = "all_reduce") {
  v1::CollectiveRecord c;
  c.set_seq(seq);
  c.set_op(op);
  c.set_group(group);
  c.set_bytes(4 << 20);
  c.set_state(state);
  c.set_start_unix_ms(1765000000000 + static_cast<int64_t>(seq) * 1000);
  if (state == "completed") c.set_end_unix_ms(c.start_unix_ms() + 250);
  return c;
}

v1::FlightRecord Record(int rank, std::initializer_list<v1::CollectiveRecord> collectives, int world = 4) {
  v1::FlightRecord record;
  record.set_rank(rank);
  record.set_path("/j/gen-0/nccl-trace-rank-" + std::to_string(rank));
  record.set_written_unix_ms(1765000009000);
  for (const auto& c : collectives) *record.add_collectives() = c;
  v1::ProcessGroupRanks* group = record.add_groups();
  group->set_group("default_pg");
  for (int r = 0; r < world; ++r) group->add_ranks(r);
  return record;
}

TEST(FlightAnalysisTest, NamesWhoEnteredTheCollectiveAndWhoNeverEnqueuedIt) {
  std::map<int, v1::FlightRecord> records;
  records[0] = Record(0, {Collective(11, "completed"), Collective(12, "started")});
  records[1] = Record(1, {Collective(11, "completed")});
  records[2] = Record(2, {Collective(11, "completed"), Collective(12, "started")});
  records[3] = Record(3, {Collective(11, "completed"), Collective(12, "scheduled")});
  const std::string analysis = AnalyzeFlightRecords(records, 4);
  EXPECT_EQ(analysis,
            "NCCL flight recorder: all_reduce #12 of default_pg (4.2 MB) is not completed: ranks 0, 2 started it; "
            "rank 3 scheduled it (its stream still busy before it); rank 1 never enqueued it, its last collective "
            "was all_reduce #11 of default_pg (completed)");
}

TEST(FlightAnalysisTest, SaysWhichRanksLeftNoDumpAndReadsEachGroup) {
  std::map<int, v1::FlightRecord> records;
  records[0] = Record(0, {Collective(3, "started"), Collective(7, "completed", "tp")});
  records[1] = Record(1, {Collective(3, "started"), Collective(8, "started", "tp")});
  const std::string analysis = AnalyzeFlightRecords(records, 4);
  EXPECT_NE(analysis.find("all_reduce #3 of default_pg (4.2 MB) is not completed: ranks 0-1 started it; ranks 2-3 left "
                          "no dump"),
            std::string::npos)
      << analysis;
  EXPECT_NE(analysis.find("all_reduce #8 of tp (4.2 MB) is not completed: rank 1 started it; rank 0 never enqueued "
                          "it, its last collective was all_reduce #7 of tp (completed)"),
            std::string::npos)
      << analysis;
  EXPECT_EQ(AnalyzeFlightRecords({}, 4), "");
  std::map<int, v1::FlightRecord> done;
  done[0] = Record(0, {Collective(3, "completed")}, 1);
  EXPECT_EQ(AnalyzeFlightRecords(done, 1), "NCCL flight recorder: every collective in the dumps of rank 0 completed");
}

TEST(FlightAnalysisTest, DescribesEveryRanksDump) {
  std::map<int, v1::FlightRecord> records;
  records[0] = Record(0, {Collective(1, "completed"), Collective(2, "started")}, 2);
  records[1] = Record(1, {}, 2);
  records[1].set_error("not a pickle of plain data: the data ends before STOP (at byte 100)");
  const std::string text = DescribeFlightRecords(records, 3);
  EXPECT_NE(text.find("rank 0: /j/gen-0/nccl-trace-rank-0, written "), std::string::npos) << text;
  EXPECT_NE(text.find("  all_reduce #1 of default_pg, 4.2 MB, enqueued "), std::string::npos) << text;
  EXPECT_NE(text.find("(250 ms)"), std::string::npos) << text;
  EXPECT_NE(text.find("  all_reduce #2 of default_pg, 4.2 MB, enqueued "), std::string::npos) << text;
  EXPECT_NE(text.find(", started\n"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1: /j/gen-0/nccl-trace-rank-1, written "), std::string::npos) << text;
  EXPECT_NE(text.find("not read: not a pickle"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 2: no dump"), std::string::npos) << text;
}

}  // namespace
}  // namespace ltrain::launcher
