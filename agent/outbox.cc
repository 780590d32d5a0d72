#include "agent/outbox.h"

#include <set>

#include <grpcpp/support/status_code_enum.h>

#include "common/logging.h"

namespace ltrain::agent {
namespace {

constexpr char kNoticePrefix[] = "ltrain agent: ";

}  // namespace

bool IsRetryable(int grpc_code) {
  switch (static_cast<grpc::StatusCode>(grpc_code)) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      return true;
    default:
      return false;
  }
}

std::optional<v1::PushLogsRequest> DroppedLinesNotice(const v1::PushLogsRequest& dropped, const std::string& why) {
  if (dropped.lines_size() == 0) return std::nullopt;
  if (dropped.lines_size() == 1 && dropped.lines(0).text().rfind(kNoticePrefix, 0) == 0) return std::nullopt;
  std::set<int> ranks;
  for (const v1::LogLine& line : dropped.lines()) ranks.insert(line.rank());
  std::string listed;
  for (int rank : ranks) listed += (listed.empty() ? "" : ", ") + std::to_string(rank);
  constexpr size_t kMaxWhy = 512;
  const std::string reason = BoundedLine(why, kMaxWhy);
  v1::PushLogsRequest notice;
  notice.set_job_id(dropped.job_id());
  notice.set_node_id(dropped.node_id());
  v1::LogLine* line = notice.add_lines();
  line->set_rank(dropped.lines(0).rank());
  line->set_text(std::string(kNoticePrefix) + std::to_string(dropped.lines_size()) + " line(s) of rank(s) " + listed +
                 " were refused by the coordinator (" + reason + ") and dropped; the rank log files on node " +
                 dropped.node_id() + " hold them");
  return notice;
}

}  // namespace ltrain::agent
