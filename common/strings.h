// Splitting text at a separator, for the lists that flags, environment variables and command output
// carry ("a:1,b:2", one host a line).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ltrain {

// Every part of `text` between separators, empty ones included: "a,,b" gives a, "", b; "a," gives
// a, ""; "" gives one empty part. For input whose empty parts are errors the caller reports.
std::vector<std::string> Split(std::string_view text, char separator);

// The parts that are not empty: "a,,b," gives a, b; "" gives none.
std::vector<std::string> SplitNonEmpty(std::string_view text, char separator);

// `text` as an error message may quote it: whole up to `max` bytes, else its start and how long it
// is ("aaaa... (10485760 bytes)"), so that no message about one value grows with the value.
std::string Shortened(std::string_view text, size_t max = 80);

}  // namespace ltrain
