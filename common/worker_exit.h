// What ltrain-worker's exit code says, for the coordinator's failure policy.
#pragma once

namespace ltrain {

constexpr int kWorkerExitFailed = 1;     // failed; a restart from the last commit may succeed
constexpr int kWorkerExitUsage = 2;      // bad flags or environment
// Refused to start: a restart would be refused the same way (a checkpoint directory of another
// job), so the job fails without restarting.
constexpr int kWorkerExitNoRestart = 3;

}  // namespace ltrain
