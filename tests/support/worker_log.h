// Reading an ltrain-worker's own log in tests (header-only, so tests that link only the worker
// libraries can use it).
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace ltrain::testing {

// The number after "loss" on every line of the log that starts with "step ".
inline std::vector<double> WorkerLogLosses(const std::filesystem::path& log) {
  std::ifstream in(log);
  std::vector<double> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("step ", 0) != 0) continue;
    std::istringstream words(line);
    std::string word;
    while (words >> word) {
      if (word == "loss") {
        double v = 0;
        words >> v;
        out.push_back(v);
      }
    }
  }
  return out;
}

// The validation losses of rank 0's "eval step N/M val_loss X ..." lines, in order.
inline std::vector<double> WorkerLogValLosses(const std::filesystem::path& log) {
  std::ifstream in(log);
  std::vector<double> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("eval step ", 0) != 0) continue;
    const size_t at = line.find(" val_loss ");
    if (at != std::string::npos) out.push_back(std::stod(line.substr(at + 10)));
  }
  return out;
}

}  // namespace ltrain::testing
