#include "common/mutex_tracking.h"

#include <absl/synchronization/mutex.h>

namespace ltrain {

void StopMutexOrderTracking() { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); }

}  // namespace ltrain
