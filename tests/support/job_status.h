// The job record as `ltrain status JOB --output json` prints it, parsed: how the integration,
// fault and Slurm tests read a job's state. Needs ltrain::proto.
#pragma once

#include <gtest/gtest.h>
#include <google/protobuf/util/json_util.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {

// Runs `ltrain status JOB --output json` with `extra` arguments (e.g. --coordinator HOST:PORT)
// under `env`; an answer that does not parse as a job fails the calling test. The command's exit
// code goes to `exit_code` when given.
inline v1::Job JobStatus(const std::string& job_id, const std::map<std::string, std::string>& env,
                         const std::vector<std::string>& extra = {}, int* exit_code = nullptr,
                         std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
  std::vector<std::string> argv = {LtrainBinary(), "status", job_id, "--output", "json"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  ProcessResult result = RunProcess(argv, env, timeout);
  if (exit_code != nullptr) *exit_code = result.exit_code;
  v1::Job job;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(result.output, &job).ok()) << result.output;
  return job;
}

}  // namespace ltrain::testing
