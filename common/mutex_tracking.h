#pragma once

namespace ltrain {

// Turns off Abseil's tracking of the order in which every absl::Mutex is taken (gRPC's locks are
// absl::Mutex). Debian's Abseil is built with it on: each lock taken adds to one process-wide graph
// behind one global lock, and the graph's memory is never given back. Call first in main.
void StopMutexOrderTracking();

}  // namespace ltrain
