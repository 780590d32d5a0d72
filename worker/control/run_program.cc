#include "worker/control/run_program.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <vector>

#include "common/python_command.h"
#include "common/status.h"
#include "common/worker_exit.h"
#include "worker/control/progress_reporter.h"
#include "worker/control/rendezvous_store.h"
#include "worker/control/tcp_store.h"
#include "worker/control/worker_env.h"

extern char** environ;

namespace ltrain::worker {
namespace {

constexpr char kMasterKey[] = "torchrun/master";
// How long a rank waits for rank 0 to publish the master address: rank 0 may start long after the
// others (another node's image pull); a rank 0 that never does is the agent's start-up timeout's.
constexpr std::chrono::minutes kMasterTimeout{10};
constexpr int kPollMs = 200;
// A longer line is no report: it is dropped up to its end, and the buffer stays bounded.
constexpr size_t kMaxLineBytes = 4096;
constexpr size_t kMaxPhaseBytes = 64;

std::optional<int64_t> ParseCount(std::string_view text) {
  int64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value < 0) return std::nullopt;
  return value;
}

std::optional<double> ParseReal(std::string_view text) {
  double value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<double> ParseDuration(std::string_view text) {
  std::optional<double> value = ParseReal(text);
  if (!value || !(*value >= 0)) return std::nullopt;
  return value;
}

// A phase travels to the agent as a protobuf string and is shown in `ltrain status`: a short word of
// printable ASCII, never bytes that are not UTF-8 or move a terminal's cursor.
std::optional<std::string> ParsePhase(std::string_view text) {
  if (text.empty() || text.size() > kMaxPhaseBytes) return std::nullopt;
  for (char c : text) {
    if (c <= ' ' || c > '~') return std::nullopt;
  }
  return std::string(text);
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// Where rank 0's store listens for `bind_addr`, and the address the other ranks are given for it.
struct ListenAddress {
  std::string host;
  std::string advertised;
};

ListenAddress ListenAddressFor(const std::string& bind_addr) {
  if (bind_addr.empty() || bind_addr == "0.0.0.0") return {"0.0.0.0", "127.0.0.1"};
  if (bind_addr == "::") return {"::", "::1"};
  return {bind_addr, bind_addr};
}

struct MasterEndpoint {
  std::string addr;
  std::string port;
};

StatusOr<MasterEndpoint> SplitEndpoint(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0 || !ParseCount(std::string_view(endpoint).substr(colon + 1))) {
    return Internal("rendezvous key " + std::string(kMasterKey) + " holds '" + endpoint + "', not ADDR:PORT");
  }
  return MasterEndpoint{endpoint.substr(0, colon), endpoint.substr(colon + 1)};
}

// This rank's MASTER_ADDR:MASTER_PORT, agreed through the generation's rendezvous store: rank 0
// starts the job's TCPStore (tcp_store.h) in `store_server`, listening before anyone is told its
// port, and publishes it; every rank, rank 0 too, is a client of it (TORCHELASTIC_USE_AGENT_STORE=True,
// as under torchrun). One rank alone (no rendezvous) hosts it for itself. Blocks until rank 0 has.
StatusOr<MasterEndpoint> AgreeOnMaster(const WorkerEnv& env, std::unique_ptr<TcpStoreServer>& store_server) {
  if (env.rank == 0) {
    const ListenAddress listen = ListenAddressFor(env.bind_addr);
    LTRAIN_ASSIGN_OR_RETURN(store_server, TcpStoreServer::Listen(listen.host));
    store_server->Start();
    const std::string published = listen.advertised + ":" + std::to_string(store_server->port());
    if (!env.rdzv.empty() && env.world_size > 1) {
      LTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<gloo::rendezvous::Store> store,
                              ConnectRendezvousStore(env.rdzv, env.rdzv_scope, env.agent_secret));
      try {
        store->set(kMasterKey, std::vector<char>(published.begin(), published.end()));
      } catch (const std::exception& e) {
        return Unavailable(std::string("rendezvous ") + env.rdzv + " (scope " + env.rdzv_scope + "): " + e.what());
      }
    }
    return SplitEndpoint(published);
  }
  if (env.rdzv.empty()) return InvalidArgument("rank " + std::to_string(env.rank) + " has no rendezvous (LTRAIN_RDZV)");
  LTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<gloo::rendezvous::Store> store,
                          ConnectRendezvousStore(env.rdzv, env.rdzv_scope, env.agent_secret));
  std::string endpoint;
  try {
    store->wait({kMasterKey}, kMasterTimeout);
    std::vector<char> value = store->get(kMasterKey);
    endpoint.assign(value.begin(), value.end());
  } catch (const std::exception& e) {
    return Unavailable(std::string("rendezvous ") + env.rdzv + " (scope " + env.rdzv_scope + "): " + e.what());
  }
  return SplitEndpoint(endpoint);
}

// The network interface that holds `address` (an IPv4 or IPv6 literal), or "" (none, or the
// address is a name or a wildcard).
std::string InterfaceOf(const std::string& address) {
  in6_addr want6{};
  in_addr want4{};
  const bool v4 = inet_pton(AF_INET, address.c_str(), &want4) == 1;
  const bool v6 = !v4 && inet_pton(AF_INET6, address.c_str(), &want6) == 1;
  if (!v4 && !v6) return "";
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* i = list; i != nullptr && name.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    if (v4 && i->ifa_addr->sa_family == AF_INET &&
        reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == want4.s_addr) {
      name = i->ifa_name;
    } else if (v6 && i->ifa_addr->sa_family == AF_INET6 &&
               std::memcmp(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr, &want6, sizeof(want6)) == 0) {
      name = i->ifa_name;
    }
  }
  freeifaddrs(list);
  return name;
}

// Whether `entries` (NAME=VALUE) sets `name`.
bool Names(const std::vector<std::string>& entries, std::string_view name) {
  for (const std::string& entry : entries) {
    if (entry.size() > name.size() && entry.compare(0, name.size(), name) == 0 && entry[name.size()] == '=') return true;
  }
  return false;
}

// Gloo and NCCL pick the interface for their own connections from the host name, which on a node
// with several networks may be one the other nodes cannot reach. Where the agent binds a specific
// address, the program's collectives use that address's interface too, unless the user chose one.
std::vector<std::string> SocketInterfaceDefaults(const std::string& bind_addr, const std::vector<std::string>& user_env) {
  const std::string name = InterfaceOf(bind_addr);
  if (name.empty() || name == "lo") return {};
  std::vector<std::string> out;
  for (const char* variable : {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}) {
    if (std::getenv(variable) == nullptr && !Names(user_env, variable)) out.push_back(std::string(variable) + "=" + name);
  }
  return out;
}

// This process's environment with `added` (NAME=VALUE) in place of any entries of those names.
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& added) {
  std::vector<std::string> entries;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    bool replaced = false;
    for (const std::string& a : added) {
      const std::string_view name(a.data(), a.find('=') + 1);
      if (entry.substr(0, name.size()) == name) replaced = true;
    }
    if (!replaced) entries.emplace_back(entry);
  }
  entries.insert(entries.end(), added.begin(), added.end());
  return entries;
}

std::vector<char*> Pointers(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

// Splits the pipe's bytes into lines for `relay`; a line over kMaxLineBytes is dropped.
class ReportReader {
 public:
  explicit ReportReader(ProgramProgress& relay) : relay_(relay) {}

  void Add(const char* data, size_t size) {
    for (size_t i = 0; i < size; ++i) {
      if (data[i] == '\n') {
        if (!overlong_) Deliver();
        pending_.clear();
        overlong_ = false;
      } else if (!overlong_) {
        pending_ += data[i];
        if (pending_.size() > kMaxLineBytes) {
          overlong_ = true;
          pending_.clear();
        }
      }
    }
  }

  // The last line, when the program ended without a newline.
  void Finish() {
    if (!overlong_) Deliver();
    pending_.clear();
  }

 private:
  void Deliver() {
    if (std::optional<ProgressLine> line = ParseProgressLine(pending_)) relay_.Apply(*line);
  }

  ProgramProgress& relay_;
  std::string pending_;
  bool overlong_ = false;
};

// Reads what is in the (non-blocking) pipe now; false at its end (every writer closed it).
bool ReadAvailable(int fd, ReportReader& reader) {
  char buffer[4096];
  while (true) {
    ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      reader.Add(buffer, static_cast<size_t>(n));
    } else if (n == 0) {
      return false;
    } else if (errno == EINTR) {
      continue;
    } else {
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
  }
}

// The program's output, relayed by the proxy when an output-silence timeout is set: a program that
// neither prints nor reports for `timeout_s` is stopped as hung.
struct OutputWatch {
  int fd = -1;  // the read end of the program's stdout and stderr; -1: not watched
  double timeout_s = 0;
  std::chrono::steady_clock::time_point last;  // the program's last byte or report
  bool silenced = false;                       // it was stopped for its silence
};

// Copies what the (non-blocking) output pipe holds now to our stdout; false at its end.
bool RelayOutput(int fd) {
  char buffer[65536];
  while (true) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      for (ssize_t done = 0; done < n;) {
        const ssize_t w = write(STDOUT_FILENO, buffer + done, static_cast<size_t>(n - done));
        if (w > 0) {
          done += w;
        } else if (w < 0 && errno != EINTR) {
          break;  // nobody reads our output any more: the bytes are dropped, the program goes on
        }
      }
    } else if (n == 0) {
      return false;
    } else if (errno != EINTR) {
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
  }
}

// Whether any of `fds` (-1: none) has something to read now.
bool Readable(std::initializer_list<int> fds) {
  std::vector<pollfd> polled;
  for (int fd : fds) {
    if (fd >= 0) polled.push_back({fd, POLLIN, 0});
  }
  return !polled.empty() && poll(polled.data(), polled.size(), 0) > 0;
}

// Relays the program's reports (and, watched, its output) until it exits; returns its wait status
// (nullopt: waitpid failed). A descendant that keeps a pipe open does not hold the proxy: the
// program's exit ends the relay.
std::optional<int> RelayUntilExit(pid_t pid, int read_fd, ReportReader& reader, ProgramProgress& relay,
                                  OutputWatch& watch, int rank) {
  bool open = true;
  bool output_open = watch.fd >= 0;
  int status = 0;
  const auto started = std::chrono::steady_clock::now();
  watch.last = started;
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    relay.Tick(std::chrono::duration_cast<std::chrono::milliseconds>(now - started).count());
    pid_t done = waitpid(pid, &status, open || output_open ? WNOHANG : 0);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) {
      std::fprintf(stderr, "ltrain-exec: %s\n", Errno("waitpid").c_str());
      return std::nullopt;
    }
    // Silent only with nothing waiting in the pipes: after a stall of this process (a busy machine),
    // what the program printed meanwhile is read before it is judged.
    if (watch.fd >= 0 && !watch.silenced &&
        std::chrono::duration<double>(now - watch.last).count() > watch.timeout_s &&
        !Readable({open ? read_fd : -1, output_open ? watch.fd : -1})) {
      std::fprintf(stderr,
                   "ltrain-exec: rank %d printed and reported nothing for %.0f s (entrypoint.output_timeout_s); "
                   "stopping it as hung\n",
                   rank, watch.timeout_s);
      std::fflush(stderr);
      kill(pid, SIGKILL);
      watch.silenced = true;
    }
    if (!open && !output_open) continue;
    pollfd fds[2];
    nfds_t count = 0;
    if (open) fds[count++] = {read_fd, POLLIN, 0};
    if (output_open) fds[count++] = {watch.fd, POLLIN, 0};
    if (poll(fds, count, kPollMs) <= 0) continue;
    for (nfds_t i = 0; i < count; ++i) {
      if (fds[i].revents == 0) continue;
      watch.last = std::chrono::steady_clock::now();
      if (fds[i].fd == read_fd) {
        open = ReadAvailable(read_fd, reader);
      } else {
        output_open = RelayOutput(watch.fd);
      }
    }
  }
  if (open) ReadAvailable(read_fd, reader);
  if (output_open) RelayOutput(watch.fd);
  reader.Finish();
  return status;
}

// Ends the proxy as the program ended: by `signal`, without a core file of the proxy (the
// program's own is the one that matters).
int DieOf(int signal) {
  std::fflush(stdout);
  std::fflush(stderr);
  rlimit no_core{0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  ::signal(signal, SIG_DFL);
  sigset_t only;
  sigemptyset(&only);
  sigaddset(&only, signal);
  sigprocmask(SIG_UNBLOCK, &only, nullptr);
  raise(signal);
  return 128 + signal;
}

}  // namespace

std::optional<ProgressLine> ParseProgressLine(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  ProgressLine out;
  bool known = false;
  size_t i = 0;
  while (i < line.size()) {
    if (line[i] == ' ' || line[i] == '\t') {
      ++i;
      continue;
    }
    size_t end = line.find_first_of(" \t", i);
    if (end == std::string_view::npos) end = line.size();
    const std::string_view field = line.substr(i, end - i);
    i = end;
    const size_t eq = field.find('=');
    if (eq == std::string_view::npos || eq == 0) return std::nullopt;
    const std::string_view key = field.substr(0, eq);
    const std::string_view value = field.substr(eq + 1);
    bool ok = true;
    if (key == "step") {
      ok = (out.step = ParseCount(value)).has_value();
    } else if (key == "phase") {
      ok = (out.phase = ParsePhase(value)).has_value();
    } else if (key == "loss") {
      ok = (out.loss = ParseReal(value)).has_value();
    } else if (key == "total_steps") {
      ok = (out.total_steps = ParseCount(value)).has_value();
    } else if (key == "tokens") {
      ok = (out.tokens = ParseCount(value)).has_value();
    } else if (key == "step_ms") {
      ok = (out.step_ms = ParseDuration(value)).has_value();
    } else if (key == "lr") {
      ok = (out.lr = ParseReal(value)).has_value();
    } else {
      continue;
    }
    if (!ok) return std::nullopt;
    known = true;
  }
  if (!known) return std::nullopt;
  return out;
}

namespace {
// Long work to the hang detector (no step will come to measure it by), in words for the launch's line.
constexpr const char* kUnreported = "the program is running (it reports no steps)";
}  // namespace

void ProgramProgress::Tick(int64_t running_ms) {
  if (reported_) return;
  progress_.SetWork(kUnreported, running_ms / 1000, 0, "s");
}

void ProgramProgress::Apply(const ProgressLine& line) {
  if (!reported_) {
    reported_ = true;
    progress_.EndWork(kUnreported);
  }
  if (line.step) step_ = *line.step;
  if (line.total_steps) total_steps_ = *line.total_steps;
  if (line.phase) phase_ = *line.phase;
  if (line.loss) {
    StepFigures figures;
    figures.step = step_;
    figures.total_steps = total_steps_;
    figures.loss = *line.loss;
    figures.lr = line.lr.value_or(0);
    figures.step_ms = line.step_ms.value_or(0);
    if (line.tokens && line.step_ms && *line.step_ms > 0) {
      figures.tokens_per_s = static_cast<double>(*line.tokens) * 1000.0 / *line.step_ms;
    }
    progress_.RecordStep(figures);
  }
  progress_.SetPhase(step_, phase_);
}

std::optional<ExecArgs> ParseExecArgs(const std::vector<std::string>& args, std::string& error) {
  ExecArgs out;
  size_t i = 0;
  for (; i < args.size() && args[i] != "--"; i += 2) {
    if (args[i] == "--standby" && i + 1 < args.size()) {
      if (args[i + 1] != "import" && args[i + 1] != "gpu") {
        error = "--standby " + args[i + 1] + ": expected import or gpu";
        return std::nullopt;
      }
      out.standby = args[i + 1];
      continue;
    }
    if (args[i] == "--output-timeout" && i + 1 < args.size()) {
      char* end = nullptr;
      out.output_timeout_s = std::strtod(args[i + 1].c_str(), &end);
      if (end == args[i + 1].c_str() || *end != '\0' || !(out.output_timeout_s >= 0)) {
        error = "--output-timeout " + args[i + 1] + ": expected seconds";
        return std::nullopt;
      }
      continue;
    }
    if (args[i] != "--env" || i + 1 == args.size()) {
      error = "unexpected " + args[i] + "; usage: ltrain-exec [--env NAME=VALUE]... [--output-timeout SECONDS] "
              "[--standby import|gpu] -- PROGRAM [ARGS...]";
      return std::nullopt;
    }
    const std::string& entry = args[i + 1];
    const size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) {
      error = "--env " + entry + ": expected NAME=VALUE";
      return std::nullopt;
    }
    out.env.push_back(entry);
  }
  if (i + 1 >= args.size()) {
    error = "no program to run; usage: ltrain-exec [--env NAME=VALUE]... [--output-timeout SECONDS] -- PROGRAM [ARGS...]";
    return std::nullopt;
  }
  out.program.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
  if (std::string why; !out.standby.empty() && !ParsePythonCommand(out.program, why)) {
    error = "--standby: " + why;
    return std::nullopt;
  }
  return out;
}

namespace {

// What a standby's interpreter runs (python3 [OPTIONS] -c THIS MODE TARGET ARGS...): it imports torch
// and what an optimizer loads on first use, makes its GPU's context, waits for its rank's
// environment on descriptor LTRAIN_STANDBY_FD, takes it as its own, and runs the script or module
// as __main__, as `python3 SCRIPT` would.
constexpr const char* kStandbyBootstrap = R"(import os, sys
def _wait():
    fd = int(os.environ.pop("LTRAIN_STANDBY_FD"))
    cuda = os.environ.pop("LTRAIN_STANDBY_CUDA", "")
    try:
        import torch, torch.distributed
        # An optimizer's first construction imports torch._dynamo: seconds, in PyTorch 2.
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        if cuda and torch.cuda.is_available() and int(cuda) < torch.cuda.device_count():
            with torch.cuda.device(int(cuda)):
                torch.empty(1, device="cuda")
    except Exception:
        pass  # the program meets the same problem itself, and says so
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    environment = b"".join(chunks)
    if not environment:
        os._exit(0)
    directory, _, environment = environment.partition(b"\0")
    os.chdir(directory)
    os.environ.clear()
    for entry in environment.split(b"\0"):
        name, eq, value = entry.partition(b"=")
        if name and eq:
            os.environb[name] = value
    mode, target = sys.argv[1], sys.argv[2]
    sys.argv = [target] + sys.argv[3:]
    sys.path[0] = os.getcwd() if mode == "module" else os.path.dirname(os.path.abspath(target))
    return mode, target
_mode, _target = _wait()
import runpy
if _mode == "module":
    runpy.run_module(_target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(_target, run_name="__main__")
)";

// Waits on stdin for the rank this standby becomes, while the interpreter `pid` warms up, and makes
// its working directory and environment this process's. The exit code to end with when there is
// none: 0 when the input ended empty (the agent has no rank for it), 1 when the interpreter ended
// first or the directory is not there.
std::optional<int> AwaitRank(pid_t pid) {
  std::string input;
  char buffer[65536];
  while (true) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      std::fprintf(stderr, "ltrain-exec: the standby's interpreter ended before its rank came (%s %d)\n",
                   WIFSIGNALED(status) ? "signal" : "exit code",
                   WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
      return kWorkerExitFailed;
    }
    pollfd in{STDIN_FILENO, POLLIN, 0};
    if (poll(&in, 1, kPollMs) <= 0) continue;
    const ssize_t n = read(STDIN_FILENO, buffer, sizeof(buffer));
    if (n > 0) {
      input.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  if (input.empty()) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return 0;
  }
  if (Status adopted = AdoptStandbyInput(input); !adopted.ok()) {
    std::fprintf(stderr, "ltrain-exec: %s\n", adopted.message().c_str());
    return kWorkerExitFailed;
  }
  return std::nullopt;
}

// Writes `directory` and `entries`, each NUL-terminated, to `fd` and closes it; false when the
// reader went away.
bool WriteEnvironment(int fd, const std::string& directory, const std::vector<std::string>& entries) {
  std::string payload = directory;
  payload.push_back('\0');
  for (const std::string& entry : entries) {
    payload += entry;
    payload.push_back('\0');
  }
  size_t done = 0;
  while (done < payload.size()) {
    const ssize_t n = write(fd, payload.data() + done, payload.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  close(fd);
  return done == payload.size();
}

}  // namespace

int RunProgram(const ExecArgs& exec) {
  const std::vector<std::string>& argv = exec.program;
  if (argv.empty()) {
    std::fputs("ltrain-exec: no program to run\n", stderr);
    return kWorkerExitUsage;
  }
  // The program's exit is ours to wait for, even where our parent ignored SIGCHLD.
  signal(SIGCHLD, SIG_DFL);
  // Ignored before fork, so that no SIGTERM or SIGINT meant for the program kills the proxy between
  // fork and here; the child restores them. SIGPIPE: a standby's interpreter that went away.
  signal(SIGTERM, SIG_IGN);
  signal(SIGINT, SIG_IGN);
  signal(SIGPIPE, SIG_IGN);

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    std::fprintf(stderr, "ltrain-exec: %s\n", Errno("pipe").c_str());
    return kWorkerExitFailed;
  }
  const int read_fd = fds[0];
  const int write_fd = fds[1];
  OutputWatch watch;
  int output_write = -1;
  if (exec.output_timeout_s > 0) {
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) {
      std::fprintf(stderr, "ltrain-exec: %s\n", Errno("pipe").c_str());
      return kWorkerExitFailed;
    }
    watch.fd = out[0];
    watch.timeout_s = exec.output_timeout_s;
    output_write = out[1];
  }
  // Forks the interpreter or the program; between fork and exec only async-signal-safe calls.
  const pid_t parent = getpid();
  auto start = [&](std::vector<std::string> arg_strings, std::vector<std::string> env_strings, int keep_fd) -> pid_t {
    std::vector<char*> envp = Pointers(env_strings);
    std::vector<char*> args = Pointers(arg_strings);
    const std::string exec_failed = "ltrain-exec: cannot run " + arg_strings[0] + ": ";
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = fork();
    if (pid != 0) return pid;
    // Same process group as the proxy: the agent signals the group.
    for (int s : {SIGTERM, SIGINT, SIGPIPE}) signal(s, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    prctl(PR_SET_PDEATHSIG, SIGKILL);      // a proxy killed alone leaves no rank running
    if (getppid() != parent) _exit(127);   // it died before prctl took effect
    fcntl(write_fd, F_SETFD, 0);
    if (keep_fd >= 0) {  // a standby's: its stdin stays the agent's, the rank's environment comes here
      fcntl(keep_fd, F_SETFD, 0);
      const int devnull = open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    }
    if (output_write >= 0) {  // stdout and stderr through the proxy, which watches for silence
      dup2(output_write, STDOUT_FILENO);
      dup2(output_write, STDERR_FILENO);
    }
    execvpe(args[0], args.data(), envp.data());
    const char* why = std::strerror(errno);
    ssize_t ignored = write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    ignored = write(STDERR_FILENO, why, std::strlen(why));
    ignored = write(STDERR_FILENO, "\n", 1);
    (void)ignored;
    _exit(127);
  };

  // A standby: the interpreter starts now; the rank, and so the rest, comes later.
  pid_t pid = -1;
  int request_fd = -1;
  if (!exec.standby.empty()) {
    std::string why;
    const std::optional<PythonCommand> python = ParsePythonCommand(argv, why);
    if (!python) {
      std::fprintf(stderr, "ltrain-exec: --standby: %s\n", why.c_str());
      return kWorkerExitUsage;
    }
    int request[2];
    if (pipe2(request, O_CLOEXEC) != 0) {
      std::fprintf(stderr, "ltrain-exec: %s\n", Errno("pipe").c_str());
      return kWorkerExitFailed;
    }
    std::vector<std::string> arg_strings = {python->interpreter};
    arg_strings.insert(arg_strings.end(), python->options.begin(), python->options.end());
    arg_strings.insert(arg_strings.end(), {"-c", kStandbyBootstrap, python->module ? "module" : "path", python->target});
    arg_strings.insert(arg_strings.end(), python->args.begin(), python->args.end());
    std::vector<std::string> added = exec.env;
    added.push_back("LTRAIN_STANDBY_FD=" + std::to_string(request[0]));
    if (exec.standby == "gpu") added.push_back("LTRAIN_STANDBY_CUDA=" + EnvString("LTRAIN_LOCAL_RANK", "0"));
    pid = start(std::move(arg_strings), ChildEnvironment(added), request[0]);
    close(request[0]);
    if (pid < 0) {
      std::fprintf(stderr, "ltrain-exec: %s\n", Errno("fork").c_str());
      return kWorkerExitFailed;
    }
    request_fd = request[1];
    if (std::optional<int> ended = AwaitRank(pid)) return *ended;
  }

  StatusOr<WorkerEnv> env = ParseWorkerEnv(ProcessEnvironment(), {});
  if (!env.ok()) {
    std::fprintf(stderr, "ltrain-exec: %s\n", env.status().message().c_str());
    return kWorkerExitUsage;
  }
  if (env->rdzv.empty() && env->world_size > 1) {
    std::fprintf(stderr, "ltrain-exec: LTRAIN_WORLD_SIZE=%d needs LTRAIN_RDZV (grpc://HOST:PORT or file:///DIR), "
                 "where the ranks agree on MASTER_ADDR:MASTER_PORT\n", env->world_size);
    return kWorkerExitUsage;
  }
  std::unique_ptr<TcpStoreServer> store_server;  // rank 0's, until the program ends
  StatusOr<MasterEndpoint> master = AgreeOnMaster(*env, store_server);
  if (!master.ok()) {
    std::fprintf(stderr, "ltrain-exec: rank %d: no MASTER_ADDR:MASTER_PORT: %s\n", env->rank,
                 master.status().message().c_str());
    return master.status().code() == StatusCode::kInvalidArgument ? kWorkerExitUsage : kWorkerExitFailed;
  }

  std::vector<std::string> added = {"MASTER_ADDR=" + master->addr, "MASTER_PORT=" + master->port,
                                    "LTRAIN_PROGRESS_FD=" + std::to_string(write_fd)};
  for (std::string& entry : SocketInterfaceDefaults(env->bind_addr, exec.env)) added.push_back(std::move(entry));
  for (const std::string& entry : exec.env) {
    if (!Names(added, std::string_view(entry).substr(0, entry.find('=')))) added.push_back(entry);
  }
  if (request_fd >= 0) {
    std::error_code error;
    if (!WriteEnvironment(request_fd, std::filesystem::current_path(error).string(), ChildEnvironment(added))) {
      std::fprintf(stderr, "ltrain-exec: the standby's interpreter did not take its rank's environment: %s\n",
                   std::strerror(errno));
    }
  } else {
    pid = start(argv, ChildEnvironment(added), -1);
    if (pid < 0) {
      std::fprintf(stderr, "ltrain-exec: %s\n", Errno("fork").c_str());
      return kWorkerExitFailed;
    }
  }
  close(write_fd);
  fcntl(read_fd, F_SETFL, fcntl(read_fd, F_GETFL) | O_NONBLOCK);
  if (output_write >= 0) {
    close(output_write);
    fcntl(watch.fd, F_SETFL, fcntl(watch.fd, F_GETFL) | O_NONBLOCK);
  }

  Progress::Global().SetPhase(0, "startup");
  if (const std::string metrics = EnvString("LTRAIN_METRICS_FILE"); !metrics.empty()) {
    std::string error;
    if (!Progress::Global().WriteMetricsTo(metrics, env->generation, error)) {
      std::fprintf(stderr, "ltrain-exec: no metrics.jsonl: %s\n", error.c_str());
    }
  }
  if (const std::string dir = EnvString("LTRAIN_TENSORBOARD_DIR"); !dir.empty()) {
    std::string error;
    if (!Progress::Global().WriteTensorBoardTo(dir, error)) {
      std::fprintf(stderr, "ltrain-exec: no TensorBoard events: %s\n", error.c_str());
    }
  }
  std::unique_ptr<ProgressReporter> reporter;
  if (!env->agent.empty()) {
    ProgressReporterOptions options;
    options.agent_address = env->agent;
    options.job_id = env->job_id;
    options.generation = env->generation;
    options.rank = env->rank;
    options.agent_secret = env->agent_secret;
    reporter = std::make_unique<ProgressReporter>(std::move(options));
  }
  ProgramProgress relay(Progress::Global());
  ReportReader reader(relay);
  const std::optional<int> waited = RelayUntilExit(pid, read_fd, reader, relay, watch, env->rank);
  close(read_fd);
  if (watch.fd >= 0) close(watch.fd);
  if (!waited) return kWorkerExitFailed;
  const int status = *waited;
  if (watch.silenced) {
    reporter.reset();
    return kWorkerExitFailed;  // a hang: restartable, as the others are
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) Progress::Global().SetPhase(relay.step(), "done");
  reporter.reset();  // its last report: where the program ended
  if (WIFSIGNALED(status)) return DieOf(WTERMSIG(status));
  return WEXITSTATUS(status);
}

}  // namespace ltrain::worker
