#include "launcher/flight_analysis.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <vector>

#include "common/logging.h"
#include "launcher/hang_diagnosis.h"

namespace ltrain::launcher {
namespace {

constexpr size_t kMaxGroupsTold = 3;

std::string Name(const v1::CollectiveRecord& c) {
  return c.op() + " #" + std::to_string(c.seq()) + " of " + c.group();
}

bool Open(const v1::CollectiveRecord& c) { return c.state() != "completed"; }

std::string Megabytes(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MB", bytes / 1e6);
  return text;
}

}  // namespace

std::string AnalyzeFlightRecords(const std::map<int, v1::FlightRecord>& records, int world_size) {
  if (records.empty()) return "";
  // The groups, with their members where a dump says them.
  std::map<std::string, std::set<int>> members;
  for (const auto& [rank, record] : records) {
    for (const auto& group : record.groups()) {
      std::set<int>& ranks = members[group.group()];
      ranks.insert(group.ranks().begin(), group.ranks().end());
    }
    for (const auto& c : record.collectives()) {
      if (!c.p2p()) members[c.group()].insert(rank);
    }
  }
  std::vector<std::string> clauses;
  for (auto& [group, ranks] : members) {
    // The oldest collective of the group some dumped member has not completed.
    uint64_t oldest = UINT64_MAX;
    for (const auto& [rank, record] : records) {
      for (const auto& c : record.collectives()) {
        if (!c.p2p() && c.group() == group && Open(c)) oldest = std::min(oldest, c.seq());
      }
    }
    if (oldest == UINT64_MAX) continue;
    // Each member's part in it.
    std::map<std::string, std::vector<int>> entered;  // its state -> ranks
    std::vector<int> completed, no_dump;
    std::map<std::string, std::vector<int>> never;  // the last collective it enqueued -> ranks
    const v1::CollectiveRecord* subject = nullptr;
    for (int rank : ranks) {
      auto found = records.find(rank);
      if (found == records.end() || !found->second.error().empty()) {
        no_dump.push_back(rank);
        continue;
      }
      const v1::CollectiveRecord* same = nullptr;
      const v1::CollectiveRecord* last = nullptr;
      for (const auto& c : found->second.collectives()) {
        if (c.p2p() || c.group() != group) continue;
        if (c.seq() == oldest) same = &c;
        if (last == nullptr || c.seq() > last->seq()) last = &c;
      }
      if (same != nullptr) {
        if (subject == nullptr || (Open(*same) && !Open(*subject))) subject = same;
        if (Open(*same)) {
          entered[same->state().empty() ? "entered" : same->state()].push_back(rank);
        } else {
          completed.push_back(rank);
        }
      } else if (last == nullptr) {
        never["it enqueued none in this group"].push_back(rank);
      } else if (last->seq() < oldest) {
        never["its last collective was " + Name(*last) + " (" + (last->state().empty() ? "?" : last->state()) + ")"]
            .push_back(rank);
      }
      // A rank whose ring holds only later ones of the group has moved past it: nothing to say.
    }
    if (subject == nullptr) continue;
    std::string clause = Name(*subject) + " (" + Megabytes(subject->bytes()) + ") is not completed:";
    std::string parts;
    auto add = [&](const std::string& part) { parts += (parts.empty() ? " " : "; ") + part; };
    // Those whose kernel runs (waiting for the peers) first, then those whose stream is still busy.
    for (const std::string& state : {std::string("started"), std::string("scheduled")}) {
      if (auto found = entered.find(state); found != entered.end()) {
        add(DescribeRanks(found->second) + " " + state + " it" +
            (state == "scheduled" ? " (its stream still busy before it)" : ""));
        entered.erase(found);
      }
    }
    for (const auto& [state, who] : entered) add(DescribeRanks(who) + " " + state + " it");
    if (!completed.empty()) add(DescribeRanks(completed) + " completed it");
    for (const auto& [where, who] : never) {
      add(DescribeRanks(who) + " never enqueued it, " + where);
    }
    if (!no_dump.empty()) add(DescribeRanks(no_dump) + " left no dump");
    clauses.push_back(clause + parts);
  }
  std::string text = "NCCL flight recorder: ";
  if (clauses.empty()) {
    std::vector<int> dumped;
    for (const auto& [rank, record] : records) dumped.push_back(rank);
    return text + "every collective in the dumps of " + DescribeRanks(dumped) + " completed";
  }
  for (size_t i = 0; i < clauses.size() && i < kMaxGroupsTold; ++i) text += (i ? "; " : "") + clauses[i];
  if (clauses.size() > kMaxGroupsTold) text += "; and " + std::to_string(clauses.size() - kMaxGroupsTold) + " more group(s)";
  // Ranks of the world that left no dump at all (a group's own members were named above).
  std::vector<int> silent;
  for (int rank = 0; rank < world_size; ++rank) {
    if (!records.count(rank)) silent.push_back(rank);
  }
  if (!silent.empty() && static_cast<int>(silent.size()) < world_size) text += "; no dump from " + DescribeRanks(silent);
  return text;
}

std::string DescribeFlightRecords(const std::map<int, v1::FlightRecord>& records, int world_size) {
  auto clock = [](int64_t unix_ms) { return UtcTime(unix_ms, "%H:%M:%S", /*with_ms=*/true); };
  std::string out;
  char line[512];
  for (int rank = 0; rank < world_size; ++rank) {
    auto found = records.find(rank);
    if (found == records.end()) {
      out += "rank " + std::to_string(rank) + ": no dump\n";
      continue;
    }
    const v1::FlightRecord& r = found->second;
    out += "rank " + std::to_string(rank) + ": " + r.path();
    if (r.written_unix_ms() > 0) out += ", written " + clock(r.written_unix_ms());
    if (!r.error().empty()) {
      out += ", not read: " + r.error() + "\n";
      continue;
    }
    out += "\n";
    if (r.collectives_size() == 0) out += "  no collectives recorded\n";
    for (const auto& c : r.collectives()) {
      std::snprintf(line, sizeof(line), "  %s%s, %s, enqueued %s", c.p2p() ? "p2p " : "", Name(c).c_str(),
                    Megabytes(c.bytes()).c_str(), clock(c.start_unix_ms()).c_str());
      out += line;
      if (!Open(c) && c.end_unix_ms() >= c.start_unix_ms() && c.start_unix_ms() > 0) {
        std::snprintf(line, sizeof(line), ", completed %s (%lld ms)\n", clock(c.end_unix_ms()).c_str(),
                      static_cast<long long>(c.end_unix_ms() - c.start_unix_ms()));
        out += line;
      } else {
        out += ", " + (c.state().empty() ? std::string("state not said") : c.state()) + "\n";
      }
    }
  }
  return out;
}

}  // namespace ltrain::launcher
