// ltrain-worker: one training rank. Everything lives in the worker library; see worker/train/run_worker.h.
// A user's program as the rank is ltrain-exec's (exec_main.cc).
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <string_view>
#include <vector>

#include "common/mutex_tracking.h"
#include "common/worker_exit.h"
#include "worker/train/run_worker.h"

namespace {

// A crash prints where it happened into the rank's log (the agent shows its last lines in the
// job's failure), then dies of the same signal so that the agent reports it.
void OnFatalSignal(int signal, siginfo_t*, void* context) {
  const char* name = sigabbrev_np(signal);
  const char head[] = "ltrain-worker: fatal signal SIG";
  ssize_t ignored = write(STDERR_FILENO, head, sizeof(head) - 1);
  if (name) ignored = write(STDERR_FILENO, name, strlen(name));
  ignored = write(STDERR_FILENO, "; backtrace:\n", 13);
  (void)ignored;
  void* frames[48];
  int count = backtrace(frames, 48);
  backtrace_symbols_fd(frames, count, STDERR_FILENO);
  // A call through a null pointer leaves nothing to unwind from: the caller's return address is
  // on top of the stack.
  const ucontext_t* uc = static_cast<const ucontext_t*>(context);
  if (uc != nullptr && uc->uc_mcontext.gregs[REG_RIP] == 0) {
    void* caller = *reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP]);
    ignored = write(STDERR_FILENO, "called from:\n", 13);
    backtrace_symbols_fd(&caller, 1, STDERR_FILENO);
  }
  ::signal(signal, SIG_DFL);
  raise(signal);
}

}  // namespace

int main(int argc, char** argv) {
  struct sigaction action {};
  action.sa_sigaction = OnFatalSignal;
  action.sa_flags = SA_SIGINFO;
  for (int signal : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(signal, &action, nullptr);
  ltrain::StopMutexOrderTracking();
  return ltrain::worker::RunWorker(argc, argv);
}
