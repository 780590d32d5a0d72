// How `ltrain` shows jobs, events and log lines to a person. Pure: each function returns the text that
// the command prints, and times ("5s ago") are measured from the `now_unix_ms` the caller passes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::cli {

// "42s ago", "5m ago", "3h ago", "2d ago": how long before `now_unix_ms` `then_unix_ms` was.
std::string FormatAge(int64_t then_unix_ms, int64_t now_unix_ms);

// The first line of `text`, cut to `max` characters (ending in "...") when longer.
std::string FirstLine(const std::string& text, size_t max);

// `ltrain list` and `ltrain status`: one line per job under a header, the cause cut to one line; a
// hint to launch one when there are none.
std::string FormatJobTable(const std::vector<v1::Job>& jobs, int64_t now_unix_ms);

// `ltrain status JOB`: the job's state, progress, last commit and cause, then its nodes and ranks.
std::string FormatJobDetail(const v1::Job& job, int64_t now_unix_ms);

// `ltrain logs`: text folds identical lines of several ranks into one "[ranks 0-7] text" line; JSON
// is one compact object per line, for tools.
enum class LogFormat { kText, kJson };
std::string FormatLogLines(const std::vector<v1::Event>& lines, LogFormat format);

// A launch or resume following its job: "[rank 3] text" for a worker's log line, "ltrain: message"
// for a job event. `quiet` leaves out log lines and rank starts: "" when the event is not shown.
std::string FormatFollowedEvent(const v1::Event& event, bool quiet);

}  // namespace ltrain::cli
