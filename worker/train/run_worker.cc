#include "worker/train/run_worker.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cerrno>
#include <filesystem>
#include <mutex>
#include <optional>
#include <thread>

#include <signal.h>
#include <sys/stat.h>
#include <sched.h>
#include <unistd.h>

#include <dlfcn.h>
#include <malloc.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "common/layout.h"
#include "common/layout_plan.h"
#include "common/checkpoint_manifest.h"
#include "common/files.h"
#include "common/recipe.h"
#include "common/worker_exit.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/torch_compat.h"
#include "worker/control/checkpoint_stop.h"
#include "worker/control/progress.h"
#include "worker/control/progress_reporter.h"
#include "worker/control/rendezvous_store.h"
#include "worker/control/worker_env.h"
#include "worker/model/fused_kernels.h"
#include "worker/parallel/param_store.h"
#include "worker/plan/topology.h"
#include "worker/train/model_tools.h"
#include "worker/train/trainer.h"
#ifdef LTRAIN_WITH_NCCL
#include "worker/comm/nccl_communicator.h"
#endif

namespace ltrain::worker {
namespace {

// Collective timeout at start: fault.collective_timeout_s of the recipe (LTRAIN_COLLECTIVE_TIMEOUT_S
// wins), or its derived figure before any step (twice the start-up's or the checkpoint's limit; the
// trainer derives it again from its steps' times): long enough for a slow step, short enough that a
// vanished peer fails the collective instead of hanging it forever.
// LTRAIN_COLLECTIVE_TIMEOUT_S's seconds; 0 when unset.
int CollectiveTimeoutOverride() {
  int seconds = 0;
  return EnvInt(ProcessEnvironment(), "LTRAIN_COLLECTIVE_TIMEOUT_S", &seconds).ok() && seconds > 0 ? seconds : 0;
}

std::chrono::milliseconds CollectiveLimit(const Recipe& recipe) {
  if (const int seconds = CollectiveTimeoutOverride(); seconds > 0) return std::chrono::seconds(seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(CollectiveTimeout(recipe, 0, 0).seconds * 1000.0));
}

// LibTorch's set_num_threads sizes its OpenMP pool but not OpenBLAS's own pthread pool, which
// otherwise takes every core and oversubscribes a node running several ranks. Looked up at run
// time because which BLAS libblas.so.3 resolves to is the host's choice.
void SetBlasThreads(int threads) {
  using SetThreadsFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreadsFn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(threads);
}

// The caching allocator records its last kMemoryHistoryEntries allocations and frees; when an
// allocation fails, its snapshot goes to rank-N-oom-snapshot.pickle in the working directory (the
// generation's, beside the rank's log), and the error names it: what filled the memory, in PyTorch's
// memory viewer. LTRAIN_MEMORY_HISTORY=0 records nothing.
constexpr size_t kMemoryHistoryEntries = 100000;

void WriteMemorySnapshotOnOutOfMemory(int rank) {
  if (!compat::RecordMemoryHistory(kMemoryHistoryEntries)) return;
  std::error_code ec;
  const std::string path =
      (std::filesystem::current_path(ec) / ("rank-" + std::to_string(rank) + "-oom-snapshot.pickle")).string();
  SetOutOfMemorySnapshotPath(path);
  compat::OnDeviceOutOfMemory([path] {
    static std::atomic<bool> written{false};
    if (written.exchange(true)) return;
    const std::string snapshot = compat::MemorySnapshotPickled();
    if (Status saved = WriteFileText(path, snapshot); !saved.ok()) {
      std::fprintf(stderr, "ltrain-worker: the allocator's snapshot at the out-of-memory error was not written: %s\n",
                   saved.message().c_str());
      return;
    }
    std::fprintf(stderr, "ltrain-worker: the allocator's snapshot at the out-of-memory error: %s (%.1f MB)\n",
                 path.c_str(), static_cast<double>(snapshot.size()) / 1e6);
  });
}

std::string DefaultCheckpointDir(const WorkerEnv& env, const Recipe& recipe) {
  std::string home = EnvString("LTRAIN_HOME");
  if (home.empty()) home = EnvString("HOME", ".") + "/.ltrain";
  std::string job = !env.job_id.empty() ? env.job_id : (!recipe.name.empty() ? recipe.name : "manual");
  return home + "/checkpoints/" + job;
}

// The world communicator and one per process group of the recipe's layout (tp, dp, pp, embedding),
// each group connected through its own prefix of the rendezvous store.
// With fault.recovery in_place every communicator is a ReformableCommunicator, so that a recovery
// connects the groups of the next membership (epoch) beneath the pointers the trainer keeps.
struct Connection {
  std::shared_ptr<gloo::rendezvous::Store> base;   // the generation's keys
  std::shared_ptr<gloo::rendezvous::Store> store;  // the membership's: `base`, or its "epoch/E" part
  std::unique_ptr<Communicator> world;
  ProcessGroups groups;
  // In place: the membership the communicators belong to, and the newest whose were aborted (-1:
  // none); guarded by `mu` with the communicators' swap (AdoptConnections) and their abort.
  std::mutex mu;
  int epoch = 0;
  int aborted_epoch = -1;
};

// Closes the connections of `conn`'s membership (every group's Communicator::Abort), once.
void AbortConnections(Connection& conn) {
  std::lock_guard<std::mutex> lock(conn.mu);
  if (conn.aborted_epoch == conn.epoch) return;
  conn.aborted_epoch = conn.epoch;
  conn.world->Abort();
  for (auto& comm : conn.groups.owned) comm->Abort();
}

StatusOr<std::unique_ptr<Connection>> Connect(const WorkerEnv& env, const Recipe& recipe, [[maybe_unused]] bool dp_side_stream,
                                              int epoch, bool reformable) {
  auto conn = std::make_unique<Connection>();
  conn->epoch = epoch;
  LTRAIN_ASSIGN_OR_RETURN(Layout layout, PlanLayout(recipe, env.world_size));
  if (env.world_size == 1) {
    conn->world = std::make_unique<SelfCommunicator>();
    conn->groups = DataParallelGroups(conn->world.get());
    return conn;
  }
  if (env.rdzv.empty()) {
    return InvalidArgument("LTRAIN_WORLD_SIZE=" + std::to_string(env.world_size) +
                           " needs a rendezvous address in LTRAIN_RDZV (grpc://HOST:PORT or file:///DIR)");
  }
  LTRAIN_ASSIGN_OR_RETURN(conn->base, ConnectRendezvousStore(env.rdzv, env.rdzv_scope, env.agent_secret));
  conn->store = conn->base;
  if (reformable) {
    // A membership after a replacement connects under keys of its own, and gives way to the next one
    // where a member dies before it formed.
    conn->store = MembershipView(epoch > 0 ? "epoch/" + std::to_string(epoch) : "",
                                 "membership/" + std::to_string(epoch + 1), conn->base, CollectiveLimit(recipe));
  }
  auto wrap = [reformable](std::unique_ptr<Communicator> comm) -> std::unique_ptr<Communicator> {
    if (!reformable) return comm;
    return std::make_unique<ReformableCommunicator>(std::move(comm));
  };
  GroupFactory make;
  if (recipe.parallel.device == Device::kCuda) {
#ifdef LTRAIN_WITH_NCCL
    const std::chrono::milliseconds timeout = CollectiveLimit(recipe);
    if ((layout.tp > 1 || layout.pp > 1) && layout.dp > 1 && dp_side_stream) {
      // dp's collectives run on a stream of their own beside tp's or pp's (ParamStore's exclusive
      // collectives), every group's issued in one order on every rank by one thread at a time. NCCL
      // runs kernels of several communicators in their host order only with implicit launch
      // ordering (NCCL 2.26 and later; its guide, "Using multiple NCCL communicators
      // concurrently"), read once, before the first communicator. A value set by the user stays.
      setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", /*overwrite=*/0);
    }
    auto nccl = NcclCommunicator::Create(*conn->store, env.rank, env.world_size, env.local_rank, timeout, "world",
                                         /*recoverable=*/reformable);
    if (!nccl.ok()) return nccl.status();
    conn->world = wrap(std::move(nccl).value());
    Connection* c = conn.get();
    const int local_rank = env.local_rank;
    make = [c, local_rank, timeout, wrap, reformable](const Group& group,
                                                      int group_rank) -> StatusOr<std::unique_ptr<Communicator>> {
      std::unique_ptr<gloo::rendezvous::Store> prefixed = PrefixedView("group/" + group.name, *c->store);
      auto comm = NcclCommunicator::Create(*prefixed, group_rank, static_cast<int>(group.ranks.size()), local_rank,
                                           timeout, group.name, /*recoverable=*/reformable);
      if (!comm.ok()) return comm.status();
      return wrap(std::move(comm).value());
    };
#else
    return InvalidArgument("parallel.device=cuda needs a worker built against LibTorch with CUDA and NCCL");
#endif
  } else {
    auto gloo = GlooCommunicator::Create(*conn->store, env.rank, env.world_size, env.bind_addr, CollectiveLimit(recipe));
    if (!gloo.ok()) return gloo.status();
    GlooCommunicator* world = gloo->get();
    conn->world = wrap(std::move(gloo).value());
    Connection* c = conn.get();
    make = [c, world, wrap](const Group& group, int group_rank) -> StatusOr<std::unique_ptr<Communicator>> {
      auto comm = GlooCommunicator::CreateGroup(*world, *c->store, group, group_rank);
      if (!comm.ok()) return comm.status();
      return wrap(std::move(comm).value());
    };
  }
  LTRAIN_ASSIGN_OR_RETURN(conn->groups, BuildProcessGroups(layout, env.rank, conn->world.get(), make));
  return conn;
}

// LTRAIN_FAULT_KILL=WHEN:RANK[,WHEN:RANK...], WHEN a step or `recovery`: the drill of ranks that die
// (see the usage text).
struct KillDrill {
  int64_t step = -1;         // after this step
  bool in_recovery = false;  // as it begins to recover from a peer's failure
};

StatusOr<KillDrill> ParseKillDrill(int rank) {
  KillDrill drill;
  const std::string text = EnvString("LTRAIN_FAULT_KILL");
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(begin, end - begin);
    begin = end + 1;
    const size_t colon = item.find(':');
    char* rank_end = nullptr;
    const long kill_rank = colon == std::string::npos ? -1 : std::strtol(item.c_str() + colon + 1, &rank_end, 10);
    const std::string when = item.substr(0, colon == std::string::npos ? 0 : colon);
    char* step_end = nullptr;
    const long long step = when == "recovery" ? 0 : std::strtoll(when.c_str(), &step_end, 10);
    const bool step_ok = when == "recovery" || (!when.empty() && step_end != nullptr && *step_end == '\0' && step >= 1);
    if (kill_rank < 0 || rank_end == item.c_str() + colon + 1 || *rank_end != '\0' || !step_ok) {
      return InvalidArgument("LTRAIN_FAULT_KILL='" + text + "': '" + item +
                             "' is not STEP:RANK (STEP >= 1) or recovery:RANK");
    }
    if (kill_rank != rank) continue;
    if (when == "recovery") {
      drill.in_recovery = true;
    } else {
      drill.step = step;
    }
  }
  return drill;
}

[[noreturn]] void KillForDrill(int rank, const std::string& when) {
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::printf("rank %d: killing itself %s at %.3f (LTRAIN_FAULT_KILL)\n", rank, when.c_str(), now);
  std::fflush(stdout);
  ::raise(SIGKILL);
  std::abort();
}

// A recovery's new connections go beneath the communicators `old` handed out (the trainer keeps
// them); `fresh` was built by Connect for the same layout, so its groups come in the same order.
Status AdoptConnections(Connection& old, Connection& fresh) {
  auto adopt = [](Communicator* into, Communicator* from) -> Status {
    auto* a = dynamic_cast<ReformableCommunicator*>(into);
    auto* b = dynamic_cast<ReformableCommunicator*>(from);
    if (a == nullptr || b == nullptr) return Status::Ok();  // a group of one: nothing to re-form
    return a->Replace(b->Release());
  };
  if (old.groups.owned.size() != fresh.groups.owned.size()) {
    return Internal("the re-formed membership has " + std::to_string(fresh.groups.owned.size()) + " groups, not " +
                    std::to_string(old.groups.owned.size()));
  }
  std::lock_guard<std::mutex> lock(old.mu);
  LTRAIN_RETURN_IF_ERROR(adopt(old.world.get(), fresh.world.get()));
  for (size_t i = 0; i < old.groups.owned.size(); ++i) {
    LTRAIN_RETURN_IF_ERROR(adopt(old.groups.owned[i].get(), fresh.groups.owned[i].get()));
  }
  old.store = fresh.store;
  old.epoch = fresh.epoch;
  return Status::Ok();
}

// On GPUs a peer that died leaves the others waiting inside their collectives: NCCL sees no closed
// connection, as Gloo does, until its timeout. The coordinator, told of the death by the peer's
// agent, announces the next membership as it replaces the rank; this thread waits for that key on a
// store connection of its own and aborts the connections of the membership it ends. The step in
// flight then fails (Trainer::CheckGroupsBeforeUpdate, or its next call) and the rank re-forms
// (Recovery::Reform). It looks again every second: a rank ends at most that much later.
class MembershipWatch {
 public:
  MembershipWatch(Connection* conn, std::shared_ptr<gloo::rendezvous::Store> store, int rank)
      : conn_(conn), store_(std::move(store)), rank_(rank), thread_([this] { Run(); }) {}
  ~MembershipWatch() {
    stop_ = true;
    thread_.join();
  }

 private:
  void Run() {
    while (!stop_) {
      int current = 0;
      bool aborted = false;
      {
        std::lock_guard<std::mutex> lock(conn_->mu);
        current = conn_->epoch;
        aborted = conn_->aborted_epoch == current;
      }
      if (aborted) {  // the rank is re-forming: the next connections come with the next epoch
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      const std::string key = "membership/" + std::to_string(current + 1);
      try {
        store_->wait({key}, std::chrono::seconds(1));
      } catch (const std::exception&) {
        continue;  // not yet (or the store did not answer): look again
      }
      {
        std::lock_guard<std::mutex> lock(conn_->mu);
        if (conn_->epoch != current) continue;  // re-formed meanwhile: those connections are current
      }
      std::printf("rank %d: membership %d was announced: closing the connections of membership %d\n", rank_,
                  current + 1, current);
      std::fflush(stdout);
      AbortConnections(*conn_);
    }
  }

  Connection* conn_;
  std::shared_ptr<gloo::rendezvous::Store> store_;
  int rank_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The recovery's hooks over this process's connections (worker/recovery).
std::unique_ptr<Recovery> MakeRecovery(const WorkerEnv& env, const Recipe& recipe, bool dp_side_stream, Connection* conn,
                                       int epoch, bool kill_in_recovery) {
  Recovery::Hooks hooks;
  // The drill of a coordinator lost during a recovery: survivors first started pause this long as they
  // begin to recover (a test kills the leader meanwhile).
  const double pause_s = env.epoch == 0 ? std::atof(EnvString("LTRAIN_FAULT_PAUSE_RECOVERY").c_str()) : 0.0;
  hooks.abort = [conn, kill_in_recovery, rank = env.rank, pause_s] {
    if (kill_in_recovery) KillForDrill(rank, "as it begins to recover");
    AbortConnections(*conn);
    if (pause_s > 0) {
      std::printf("rank %d: pausing %.1f s as it begins to recover (LTRAIN_FAULT_PAUSE_RECOVERY)\n", rank, pause_s);
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::duration<double>(pause_s));
    }
  };
  hooks.await_membership = [conn](int epoch, std::chrono::milliseconds timeout) -> StatusOr<std::string> {
    const std::string key = "membership/" + std::to_string(epoch);
    try {
      conn->base->wait({key}, timeout);
      const std::vector<char> value = conn->base->get(key);
      return std::string(value.begin(), value.end());
    } catch (const std::exception& e) {
      return Unavailable("membership " + std::to_string(epoch) + " was not announced within " +
                         std::to_string(timeout.count() / 1000) + " s: " + e.what());
    }
  };
  hooks.reconnect = [conn, env, recipe, dp_side_stream](int epoch) -> Status {
    LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Connection> fresh,
                            Connect(env, recipe, dp_side_stream, epoch, /*reformable=*/true));
    return AdoptConnections(*conn, *fresh);
  };
  const at::Device device = recipe.parallel.device == Device::kCuda
                                ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank))
                                : at::Device(at::kCPU);
  auto recovery = std::make_unique<Recovery>(std::move(hooks), env.rank, epoch, CollectiveLimit(recipe), device);
  if (env.epoch == 0) recovery->Synced();  // a rank of the generation's start holds its own state
  return recovery;
}

// LTRAIN_FAULT_STARTUP_STALL=SECONDS[:RANK]: the drill of a slow start-up (see the usage text).
Status StallStartupIfAsked(int rank) {
  const char* v = std::getenv("LTRAIN_FAULT_STARTUP_STALL");
  if (v == nullptr || *v == '\0') return Status::Ok();
  const std::string text = v;
  char* end = nullptr;
  const double seconds = std::strtod(text.c_str(), &end);
  long stall_rank = -1;
  if (end != text.c_str() && *end == ':') {
    char* rank_end = nullptr;
    stall_rank = std::strtol(end + 1, &rank_end, 10);
    if (rank_end == end + 1 || *rank_end != '\0') end = nullptr;
  } else if (end == text.c_str() || *end != '\0') {
    end = nullptr;
  }
  if (end == nullptr || !(seconds >= 0)) {
    return InvalidArgument("LTRAIN_FAULT_STARTUP_STALL='" + text + "' is not SECONDS or SECONDS:RANK");
  }
  if (stall_rank >= 0 && stall_rank != rank) return Status::Ok();
  std::printf("rank %d: stalling start-up for %.1f s (LTRAIN_FAULT_STARTUP_STALL)\n", rank, seconds);
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  return Status::Ok();
}

// A CPU rank frees and takes again the same activations and gradients every step. glibc gives large
// blocks back to the system (mapped blocks, and the heap's top past the trim threshold), and each
// step then faults their pages in again: on this project's 2-core machine that was a tenth of a
// step, and spells of a few steps at 1.5-2.5x a rank's time, which no other rank had at once (the
// straggler rule saw them). Blocks up to glibc's largest threshold (32 MB) come from the heap, and
// the heap keeps up to 1 GB free.
void KeepFreedHostMemory() {
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// LTRAIN_FAULT_SLOW_RANK=FACTOR:RANK: the straggler drill (see the usage text); 1 for other ranks.
StatusOr<double> SlowFactor(int rank) {
  const std::string text = EnvString("LTRAIN_FAULT_SLOW_RANK");
  if (text.empty()) return 1.0;
  char* end = nullptr;
  const double factor = std::strtod(text.c_str(), &end);
  char* rank_end = nullptr;
  const long slow_rank = end != text.c_str() && *end == ':' ? std::strtol(end + 1, &rank_end, 10) : -1;
  if (!(factor >= 1.0) || rank_end == nullptr || rank_end == end + 1 || *rank_end != '\0' || slow_rank < 0) {
    return InvalidArgument("LTRAIN_FAULT_SLOW_RANK='" + text + "' is not FACTOR:RANK with FACTOR >= 1");
  }
  return slow_rank == rank ? factor : 1.0;
}

Status Run(const WorkerEnv& env) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size) {
    return InvalidArgument("LTRAIN_RANK=" + std::to_string(env.rank) + " is outside LTRAIN_WORLD_SIZE=" +
                           std::to_string(env.world_size));
  }
  LTRAIN_ASSIGN_OR_RETURN(Recipe recipe, LoadWorkerRecipe(env));
  // Checkpoints (and what else a rank writes) are the user's alone whatever the umask the worker was
  // started with, or readable by the checkpoint folder's group where the recipe says so.
  UsePrivateFileModes();
  if (recipe.checkpoint.share_with_group) ::umask(027);

  const int threads = CpuThreadsPerRank(env.local_world_size);
  at::set_num_threads(threads);
  SetBlasThreads(threads);
  if (recipe.parallel.device != Device::kCuda) KeepFreedHostMemory();
  if (recipe.parallel.device == Device::kCuda && EnvString("LTRAIN_MEMORY_HISTORY") != "0") {
    WriteMemorySnapshotOnOutOfMemory(env.rank);
  }

  TrainerOptions options;
  options.rank = env.rank;
  options.local_rank = env.local_rank;
  options.generation = env.generation;
  options.job_id = env.job_id;
  options.collective_timeout = CollectiveLimit(recipe);
  options.derive_collective_timeout = recipe.fault.collective_timeout_s <= 0 && CollectiveTimeoutOverride() == 0;
  options.dp_overlap = EnvString("LTRAIN_DP_OVERLAP") != "0";
  options.overlap_update = EnvString("LTRAIN_OVERLAP_UPDATE") != "0";
  if (const std::string transient = EnvString("LTRAIN_TRANSIENT_GRADIENTS"); !transient.empty()) {
    options.transient_gradients = transient == "0" ? 0 : 1;
  }
  options.copy_engine_gathers = EnvString("LTRAIN_COPY_ENGINE_GATHERS") != "0";
  options.dp_side_stream = EnvString("LTRAIN_DP_SIDE_STREAM") != "0";
  options.stochastic_residual = EnvString("LTRAIN_STOCHASTIC_RESIDUAL") == "1";
  options.tp_split_batch = EnvString("LTRAIN_TP_SPLIT_BATCH") == "1";
  if (std::string trace = EnvString("LTRAIN_DATA_TRACE"); !trace.empty()) {
    options.data_trace = trace + "/data-rank-" + std::to_string(env.rank) + ".tsv";
  }
  LTRAIN_ASSIGN_OR_RETURN(options.slow_factor, SlowFactor(env.rank));
  // CPU ranks whose threads fit the cores they may run on are each kept to cores by the scheduler,
  // and each step's work is on its main thread's core (more ranks than cores take turns on all of
  // them: their whole figures are compared).
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  const int cores = ::sched_getaffinity(0, sizeof(allowed), &allowed) == 0 ? CPU_COUNT(&allowed)
                                                                                     : static_cast<int>(std::thread::hardware_concurrency());
  options.report_cores = recipe.parallel.device != Device::kCuda && threads * env.local_world_size <= cores;
  SetCollectiveStreamPriority(EnvString("LTRAIN_DP_HIGH_PRIORITY") == "1");
  FusedKernelOptions kernels;
  kernels.linear = EnvString("LTRAIN_FUSED_LINEAR") != "0";
  kernels.layer_norm = EnvString("LTRAIN_FUSED_LAYER_NORM") != "0";
  kernels.adamw = EnvString("LTRAIN_FUSED_ADAMW") != "0";
  kernels.tp_overlap = EnvString("LTRAIN_TP_OVERLAP") != "0";
  LTRAIN_RETURN_IF_ERROR(EnvSwitch(ProcessEnvironment(), "LTRAIN_NORM_REBUILD", &kernels.norm_rebuild));
  // Timing picks an algorithm per run; a deterministic recipe's runs (and their resumes) take
  // cuBLASLt's first candidate, the same every time.
  kernels.gemm_tune = EnvString("LTRAIN_GEMM_TUNE") != "0" && !recipe.training.deterministic;
  LTRAIN_RETURN_IF_ERROR(EnvInt(ProcessEnvironment(), "LTRAIN_GEMM_SM_MARGIN", &kernels.gemm_sm_margin));
  LTRAIN_RETURN_IF_ERROR(EnvInt(ProcessEnvironment(), "LTRAIN_GEMM_CANDIDATES", &kernels.gemm_candidates));
  if (kernels.gemm_candidates < 1 || kernels.gemm_candidates > kMaxGemmCandidates) {
    return InvalidArgument("LTRAIN_GEMM_CANDIDATES=" + std::to_string(kernels.gemm_candidates) + " is outside 1 to " +
                           std::to_string(kMaxGemmCandidates) + ": how many of cuBLASLt's candidates to time per product");
  }
  kernels.fp8 = recipe.parallel.precision == Precision::kFp8;
  kernels.fp8_keep_weights = recipe.parallel.zero < 3;
  kernels.fp8_rowwise = recipe.parallel.fp8_scaling == Fp8ScalingKind::kRowwise;
  kernels.fp8_writer_amax = EnvString("LTRAIN_FP8_WRITER_AMAX") != "0";
  kernels.fp8_fast_accum = EnvString("LTRAIN_FP8_FAST_ACCUM") != "0";
  // The gradients in e5m2 under tensorwise scaling (its range), in e4m3 under rowwise (the rows'
  // scales give the range, e4m3 the extra bit), as torchao's recipes have them.
  kernels.fp8_gradients_e4m3 = kernels.fp8_rowwise;
  if (const std::string gradients = EnvString("LTRAIN_FP8_GRADIENTS"); !gradients.empty()) {
    if (gradients != "e4m3" && gradients != "e5m2") {
      return InvalidArgument("LTRAIN_FP8_GRADIENTS=" + gradients +
                             ": the gradients' FP8 format is e5m2 or e4m3 (by default e5m2 under tensorwise scaling, "
                             "e4m3 under rowwise)");
    }
    kernels.fp8_gradients_e4m3 = gradients == "e4m3";
  }
  if (const std::string products = EnvString("LTRAIN_FP8_PRODUCTS"); !products.empty()) {
    if (products.find_first_not_of("fdw") != std::string::npos) {
      return InvalidArgument("LTRAIN_FP8_PRODUCTS=" + products + ": say which products run in FP8 by the letters f "
                             "(forward), d (input gradient) and w (weight gradient), for example fdw");
    }
    kernels.fp8_forward = products.find('f') != std::string::npos;
    kernels.fp8_input_grad = products.find('d') != std::string::npos;
    kernels.fp8_weight_grad = products.find('w') != std::string::npos;
  }
  if (kernels.fp8 && recipe.parallel.device == Device::kCuda && !Fp8ProductsAvailable()) {
    return InvalidArgument("parallel.precision: fp8 needs a GPU of compute capability 8.9 or newer (Hopper, Ada) and a "
                           "worker built with CUDA kernels on a LibTorch with float8 types (2.1 and later); use "
                           "bf16-fp32-residual here");
  }
  SetFusedKernelOptions(kernels);
  LTRAIN_ASSIGN_OR_RETURN(CheckpointWriteFault fault, CheckpointWriteFault::FromEnv());
  options.checkpoint_write_fault = fault;
  if (const std::string profile = EnvString("LTRAIN_PROFILE"); !profile.empty()) {
    LTRAIN_ASSIGN_OR_RETURN(ProfileWindow window, ParseProfileWindow(profile, EnvString("LTRAIN_PROFILE_RANKS")));
    if (window.Records(env.rank)) {
      options.profile_step = window.first;
      options.profile_last = window.last;
      // A relative path is the job's directory's (the worker runs there), said whole in the log.
      std::error_code ec;
      const std::filesystem::path path = window.PathFor(env.rank);
      options.profile_path = path.is_absolute() ? path.string() : (std::filesystem::current_path(ec) / path).string();
    }
  }
  options.checkpoint_dir = !recipe.checkpoint.enabled       ? ""
                           : !env.checkpoint_dir.empty()     ? env.checkpoint_dir
                           : !recipe.checkpoint.dir.empty() ? recipe.checkpoint.dir
                                                            : DefaultCheckpointDir(env, recipe);
  // A checkpoint directory belongs to one job: another job's commits there would be pruned and
  // mixed with this one's. Every rank looks (the directory is shared), before anything is written.
  if (!options.checkpoint_dir.empty()) {
    LTRAIN_RETURN_IF_ERROR(CheckCheckpointDirWritable(options.checkpoint_dir, env.rank));
    if (std::optional<CommittedStep> owner = ForeignCheckpoint(options.checkpoint_dir, env.job_id)) {
      return FailedPrecondition(CheckpointOwnershipError(
          options.checkpoint_dir, *owner, env.job_id.empty() ? "this run (no job id)" : "job " + env.job_id));
    }
  }
  // A restarted generation continues from the job's newest committed checkpoint instead of
  // starting over (and overwriting it), also when the job began from another run's checkpoint
  // (checkpoint.resume_from): its own commits are newer.
  const std::string resume_from_recipe = recipe.checkpoint.resume_from;
  std::error_code ec;
  if (env.generation > 0 && !options.checkpoint_dir.empty() &&
      std::filesystem::exists(std::filesystem::path(options.checkpoint_dir) / "latest", ec)) {
    recipe.checkpoint.resume_from = options.checkpoint_dir;
  } else if (env.generation > 0 && env.committed_step > 0 && !options.checkpoint_dir.empty()) {
    // The job committed there, and the commits are gone: starting over would train from step 1 what the
    // job had trained, and overwrite nothing the user could still put back. A restart would find the same.
    return FailedPrecondition(
        "job " + env.job_id + " committed step " + std::to_string(env.committed_step) + " in " + options.checkpoint_dir +
        ", and that directory holds no checkpoint now (removed or moved?). Put it back and `ltrain resume " + env.job_id +
        "` again, or `ltrain launch` the recipe again to train from the start");
  }

  // `ltrain stop --checkpoint` reaches this rank in the agent's replies to its progress reports.
  CheckpointStop stop(env.rank, env.world_size);
  // The kill drill hits the rank as first started, not its replacement (LTRAIN_EPOCH above 0) nor a
  // restarted generation.
  LTRAIN_ASSIGN_OR_RETURN(KillDrill drill, ParseKillDrill(env.rank));
  if (env.epoch > 0 || env.generation > 0) drill = KillDrill{};
  options.stop_after = [&stop, drill, rank = env.rank](int64_t step) {
    if (step == drill.step) KillForDrill(rank, "after step " + std::to_string(step));
    return stop.After(step);
  };
  // Progress goes to the agent (for hang detection) from here on, startup included.
  Progress::Global().SetPhase(0, "startup");
  std::unique_ptr<ProgressReporter> reporter;
  if (const std::string& agent = env.agent; !agent.empty()) {
    ProgressReporterOptions reporting;
    reporting.agent_address = agent;
    reporting.job_id = env.job_id;
    reporting.generation = env.generation;
    reporting.rank = env.rank;
    reporting.on_checkpoint_stop = [&stop] { stop.Request(); };
    reporting.agent_secret = env.agent_secret;
    reporter = std::make_unique<ProgressReporter>(std::move(reporting));
    // A commit reaches the coordinator before the line that announces it.
    options.report_progress = [r = reporter.get()] { r->Flush(); };
  }

  // Missing data fails every rank on its own before the rendezvous. Found after it, one rank's exit
  // could close a peer's connections while that peer was still connecting: the peer then failed with
  // an error a restart might cure, and the job restarted to find the same files.
  LTRAIN_RETURN_IF_ERROR(OpenTrainingData(recipe).status());
  auto connect_start = std::chrono::steady_clock::now();
  constexpr const char* kConnecting = "connecting to the job's ranks";
  Progress::Global().SetWork(kConnecting, 0, env.world_size, "ranks");
  const bool in_place = InPlaceRecoveryProblem(recipe, env.world_size).empty();
  // A write to the connection of a peer that died must fail the collective, not end this process.
  if (in_place) ::signal(SIGPIPE, SIG_IGN);
  int epoch = env.epoch;
  StatusOr<std::unique_ptr<Connection>> connected = Connect(env, recipe, options.dp_side_stream, epoch, in_place);
  // A replacement whose membership lost another member before it formed joins the next one.
  while (!connected.ok() && env.epoch > 0 && IsSupersededError(connected.status().message())) {
    std::printf("rank %d: membership %d lost a member before it formed; joining membership %d\n", env.rank, epoch,
                epoch + 1);
    std::fflush(stdout);
    connected = Connect(env, recipe, options.dp_side_stream, ++epoch, in_place);
  }
  LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Connection> conn, std::move(connected));
  Progress::Global().EndWork(kConnecting);
  ConnectCheckpointStop(&stop, conn->base);
  std::unique_ptr<Recovery> recovery;
  if (in_place) {
    recovery = MakeRecovery(env, recipe, options.dp_side_stream, conn.get(), epoch, drill.in_recovery);
    options.recovery = recovery.get();
  }
  std::unique_ptr<MembershipWatch> watch;
  if (in_place && recipe.parallel.device == Device::kCuda) {
    LTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<gloo::rendezvous::Store> store,
                            ConnectRendezvousStore(env.rdzv, env.rdzv_scope, env.agent_secret));
    watch = std::make_unique<MembershipWatch>(conn.get(), std::move(store), env.rank);
  }
  // Every rank says it is up: the first line of each rank's log, and proof of the rendezvous.
  std::printf("rank %d/%d up: pid %d, %d CPU thread(s), connected to %d peer(s) in %.0f ms\n", env.rank,
              env.world_size, static_cast<int>(getpid()), threads, env.world_size - 1,
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - connect_start).count());
  std::fflush(stdout);
  // Ranks tell rank 0 their checkpoint files are durable through the checkpoint directory itself.
  std::unique_ptr<CheckpointCommitBoard> board;
  if (env.world_size > 1 && !options.checkpoint_dir.empty()) {
    board = std::make_unique<FileCommitBoard>(options.checkpoint_dir);
    options.commit_board = board.get();
  }
  if (const std::string metrics = EnvString("LTRAIN_METRICS_FILE"); !metrics.empty()) {
    std::string error;
    if (!Progress::Global().WriteMetricsTo(metrics, env.generation, error)) {
      std::fprintf(stderr, "rank %d: no metrics.jsonl: %s\n", env.rank, error.c_str());
    }
  }
  if (const std::string dir = EnvString("LTRAIN_TENSORBOARD_DIR"); !dir.empty()) {
    std::string error;
    if (!Progress::Global().WriteTensorBoardTo(dir, error)) {
      std::fprintf(stderr, "rank %d: no TensorBoard events: %s\n", env.rank, error.c_str());
    }
  }
  LTRAIN_RETURN_IF_ERROR(StallStartupIfAsked(env.rank));
  LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(recipe, options, &conn->groups));
  // Starting from another run's checkpoint at or past training.steps would train nothing and
  // succeed: a fine-tune set up with the steps counted from the checkpoint instead of from the start.
  if (env.generation == 0 && !resume_from_recipe.empty() &&
      trainer->step() >= recipe.training.steps) {
    const long long at = static_cast<long long>(trainer->step());
    return FailedPrecondition(
        "checkpoint.resume_from=" + resume_from_recipe + " holds step " + std::to_string(at) +
        " and training.steps is " + std::to_string(recipe.training.steps) +
        ": nothing is left to train. training.steps counts from the start of the run that wrote the checkpoint; "
        "for 100 more steps, set training.steps=" + std::to_string(at + 100));
  }
  stop.Begin(trainer->step());
  Status done = trainer->Run();
  // Ranks left with a lost node and none replaced them: this rank goes on among the members, as rank
  // `index` of them, in their layout (each member takes more of the global batch's micro-batches).
  while (done.ok() && recovery != nullptr && recovery->reshaped()) {
    const std::vector<int> members = recovery->TakeMembers();
    const int member_epoch = recovery->epoch();
    const auto at = std::find(members.begin(), members.end(), env.rank);
    if (at == members.end()) {
      return Internal("membership " + std::to_string(member_epoch) + " goes on without rank " + std::to_string(env.rank));
    }
    WorkerEnv member_env = env;
    member_env.rank = static_cast<int>(at - members.begin());
    member_env.world_size = static_cast<int>(members.size());
    member_env.epoch = member_epoch;  // what it joins in: as a replacement would, with no state of its own yet
    watch.reset();
    LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Connection> next,
                            Connect(member_env, recipe, options.dp_side_stream, member_epoch, /*reformable=*/true));
    // Its recovery starts with no state of its own (a trainer made for it reads no checkpoint) until
    // AdoptState gave it the earlier trainer's.
    std::unique_ptr<Recovery> next_recovery =
        MakeRecovery(member_env, recipe, options.dp_side_stream, next.get(), member_epoch, /*kill_in_recovery=*/false);
    options.recovery = next_recovery.get();
    options.rank = member_env.rank;
    LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> next_trainer, Trainer::Create(recipe, options, &next->groups));
    LTRAIN_RETURN_IF_ERROR(next_trainer->AdoptState(*trainer));
    stop.SetMembers(members);  // a stop with a final checkpoint is agreed among them
    trainer = std::move(next_trainer);
    recovery = std::move(next_recovery);
    conn = std::move(next);
    if (recipe.parallel.device == Device::kCuda) {
      LTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<gloo::rendezvous::Store> store,
                              ConnectRendezvousStore(env.rdzv, env.rdzv_scope, env.agent_secret));
      watch = std::make_unique<MembershipWatch>(conn.get(), std::move(store), env.rank);
    }
    done = trainer->Run();
  }
  if (done.ok() && stop.stop_step() == trainer->step() && trainer->step() < recipe.training.steps) {
    Progress::Global().RecordStoppedAfterCheckpoint();
    if (reporter) reporter->Flush();
    std::printf("rank %d: stopped after step %lld of %lld, %s: the job is being stopped (ltrain stop --checkpoint)\n",
                env.rank, static_cast<long long>(trainer->step()), static_cast<long long>(recipe.training.steps),
                options.checkpoint_dir.empty() ? "saving nothing (checkpoints are off)" : "with its checkpoint committed");
  }
  if (done.ok() && !env.export_params.empty()) done = trainer->ExportParameters(env.export_params);
  Progress::Global().SetPhase(trainer->step(), "done");
  // The agent's last report of this rank, which its exit report carries, says where it ended.
  if (reporter) reporter->Flush();
  return done;
}

}  // namespace

std::string WorkerUsage() {
  return R"(ltrain-worker: one training rank (started by an ltrain agent, or by hand).

Usage: ltrain-worker [--recipe FILE] [--set key=value]... [--export-params FILE] [--help]
       ltrain-worker --standby worker [ARGS...]

  --recipe FILE         the recipe YAML (default: $LTRAIN_RECIPE_FILE)
  --set key=value       override a recipe field, e.g. --set training.steps=20 (repeatable)
  --export-params FILE  after training, rank 0 gathers every parameter of the full model (from
                        every tp, pp and ZeRO shard) and writes them to FILE: per parameter, in the
                        model's order, uint32 name length, name, uint64 count, float32 values
  --help             this text
  --standby worker      load, then wait on stdin for the rank to become: the agent writes the
                        working directory and the rank's environment (NUL-separated) and closes it
                        (its warm standby of a job under fault.recovery: in_place)

Environment (set by the agent; flags win over it):
  LTRAIN_JOB_ID            job id (names the default checkpoint directory)
  LTRAIN_RANK              this process's rank, 0-based (default 0)
  LTRAIN_WORLD_SIZE        number of ranks (default 1; 1 needs no rendezvous)
  LTRAIN_LOCAL_RANK        rank on this node (picks the GPU)
  LTRAIN_LOCAL_WORLD_SIZE  ranks on this node (CPU threads = cores / this, unless OMP_NUM_THREADS is set)
  LTRAIN_GENERATION        restart count; >0 resumes from the newest checkpoint
  LTRAIN_EPOCH             membership of the generation (fault.recovery: in_place); >0: this rank
                           replaces a failed one, connects under the epoch's keys and takes its
                           training state from a peer's memory
  LTRAIN_RECIPE_FILE       path of the resolved recipe YAML
  LTRAIN_RDZV              rendezvous address: grpc://HOST:PORT (agent) or file:///DIR (by hand)
  LTRAIN_RDZV_SCOPE        key prefix of this job generation in the rendezvous store
  LTRAIN_CHECKPOINT_DIR    overrides checkpoint.dir
  LTRAIN_AGENT             HOST:PORT of the agent's WorkerService, where progress reports go
  LTRAIN_AGENT_SECRET_FILE a 0600 file with this job generation's secret, which the agent asks of
                           every call (it serves a worker only its own job's keys and progress)
  LTRAIN_BIND_ADDR         address Gloo listens on (default 127.0.0.1)
  LTRAIN_COLLECTIVE_TIMEOUT_S  seconds before a stuck collective fails (default: the recipe's
                           fault.collective_timeout_s, or the figure derived from the steps' times)

Profiling:
  LTRAIN_PROFILE=STEP:PATH rank 0 records step STEP (1-based) with the CUDA profiler (operators and
                           kernels) and writes a Chrome trace to PATH (open it in Perfetto or
                           chrome://tracing); CUDA builds only. FIRST-LAST:PATH records steps FIRST
                           to LAST in one trace, with nothing waited for between them (the gaps
                           between steps show). {rank} in PATH: every rank records, each into its
                           own file; without PATH (LTRAIN_PROFILE=STEP or FIRST-LAST) every rank
                           writes profile-rank-N.json in the job's directory; the throughput
                           line leaves the profiled steps and the writing of their trace out
  LTRAIN_PROFILE_RANKS=all|0,4-7
                           which ranks record the window (default: every rank where PATH names
                           {rank} or is absent, else rank 0)
  LTRAIN_MEMORY_HISTORY=0  CUDA: do not record the caching allocator's last 100,000 allocations and
                           frees (by default recorded, about 0.5% of a step; on an out-of-memory
                           error the rank writes their snapshot to rank-N-oom-snapshot.pickle
                           beside its log, for PyTorch's memory viewer)
  LTRAIN_FUSED_LINEAR=0    LibTorch's linear layers and GELU instead of the worker's cuBLASLt ones
                           (bf16 on CUDA), to compare speed or numerics
  LTRAIN_FUSED_LAYER_NORM=0  LibTorch's layer norm and RMS norm backward instead of the worker's
                           kernels (which add the residual branch's gradient in the same pass)
  LTRAIN_FUSED_ADAMW=0     LibTorch's fused AdamW over fp32 copies of the bf16 gradients instead of
                           the worker's kernel (which also writes the bf16 weights)
  LTRAIN_DP_OVERLAP=0      all-reduce the data-parallel gradients after backward, not during it
  LTRAIN_OVERLAP_UPDATE=0  run the optimizer's update inline after backward, not unit by unit on a
                           stream of its own beside the next forward (zero 0, bf16 on CUDA) or
                           in each unit's gather for the next forward (zero 3)
  LTRAIN_TRANSIENT_GRADIENTS=0
                           keep the gradients' buffers from step to step (zero 0-2 on one
                           data-parallel rank, no pipeline), instead of making each block's when
                           backward reaches it and releasing it after its update (=1 does so on
                           CPUs too; by default on CUDA only)
  LTRAIN_COPY_ENGINE_GATHERS=0
                           gather the bf16 weights (zero 3 before use, zero 1/2 after each
                           update) with NCCL's kernels, not on the copy engines within memory the
                           ranks write into directly (NCCL 2.28, one node)
  LTRAIN_DP_SIDE_STREAM=0  with tp or pp beside dp, run the data-parallel collectives on the
                           computation's stream, not on a stream of their own beside it (they are
                           issued in the computation's order either way; on their own stream the
                           worker sets NCCL_LAUNCH_ORDER_IMPLICIT=1 unless it is set)
  LTRAIN_TP_OVERLAP=0      all-reduce a tensor-parallel block input's gradient after its products'
                           backward, not beside their weight-gradient products (tp without
                           sequence parallelism, our products)
  LTRAIN_TP_SPLIT_BATCH=1  under tp without sequence parallelism, send each micro-batch of two
                           sequences or more through the blocks in two halves, interleaved so that
                           one half's row-parallel all-reduce runs beside the other half's products
                           (not under ZeRO-3 or full activation checkpointing: blocks run whole)
  LTRAIN_NORM_REBUILD=0|1  0: under activation_checkpointing: selective, keep each block norm's
                           output for the products that read it, instead of making it again in
                           backward; 1: make it again in backward under every recompute mode
  LTRAIN_FP8_WRITER_AMAX=0 under parallel.precision: fp8, quantize each product's input and output
                           gradient with an amax pass of its own, instead of the amax the kernel
                           that wrote it (a norm, SwiGLU, the GELU's gradient, RoPE's backward)
                           took on the way
  LTRAIN_FP8_PRODUCTS=fdw  under parallel.precision: fp8, which products run in FP8: f the forward,
                           d the input gradient, w the weight gradient (the others in bf16)
  LTRAIN_FP8_FAST_ACCUM=0  under parallel.precision: fp8, the forward products without Hopper's
                           fast accumulation (with its periodic promotion, as backward's)
  LTRAIN_FP8_GRADIENTS=F   under parallel.precision: fp8, quantize the output gradients in F: e4m3
                           (3 mantissa bits) or e5m2 (a wider range); by default e5m2 under
                           tensorwise scaling, e4m3 under rowwise
  LTRAIN_DP_HIGH_PRIORITY=1  run the data-parallel collectives on a high-priority CUDA stream
  LTRAIN_GEMM_SM_MARGIN=N  plan the cuBLASLt products of backward for N fewer SMs than the GPU has,
                           leaving them to the data-parallel reductions that overlap backward
  LTRAIN_GEMM_TUNE=0       take cuBLASLt's first candidate for each product instead of timing its
                           first 32 once, on the product's first call (training.deterministic
                           recipes always take the first)
  LTRAIN_GEMM_CANDIDATES=N time N of cuBLASLt's candidates instead of 32 (1 to 32)
  LTRAIN_DATA_TRACE=DIR    each rank appends the windows it reads to DIR/data-rank-R.tsv, a line a
                           sequence: sample index (the data position), source, start token, epoch
                           (to check that a resumed run reads what an uninterrupted one does)
  LTRAIN_STOCHASTIC_RESIDUAL=1
                           under precision bf16, add each block's branch to the residual stream in
                           fp32 and round the sum to bf16 stochastically (unbiased), not to nearest;
                           tp 1, no full activation checkpointing (to compare how it learns)

Fault injection (for testing recovery; never set in production):
  LTRAIN_FAULT_CHECKPOINT_WRITE=STEP[:RANK]
                           the save of step STEP fails while writing a file of rank RANK (every
                           rank when absent), after half of its bytes reached the disk: the step is
                           not committed, `latest` keeps naming the previous one, rank 0 prints
                           "checkpoint step-STEP failed: ...; step-M stays the newest committed",
                           and training goes on
  LTRAIN_FAULT_CHECKPOINT_STALL=STEP:SECONDS[:RANK]
                           the save of step STEP on rank RANK (every rank when absent) stops for
                           SECONDS before its first byte, reporting no progress: a save longer than
                           fault.hang_timeout_s is no hang; one longer than checkpoint.timeout_s is
                           reported as a stuck checkpoint save naming the rank
  LTRAIN_FAULT_SLOW_RANK=FACTOR:RANK
                           rank RANK's forward and backward take FACTOR times as long (it sleeps
                           for the difference): the coordinator names it a straggler
  LTRAIN_FAULT_KILL=STEP:RANK[,...]
                           rank RANK kills itself (SIGKILL) after completing step STEP, as first
                           started (neither its replacement under fault.recovery: in_place nor a
                           restarted generation does it again), printing the time; recovery:RANK:
                           as it begins to recover from a peer's failure (a second failure)
  LTRAIN_FAULT_PAUSE_RECOVERY=SECONDS
                           ranks first started pause SECONDS as they begin to recover in place
                           from a peer's failure (a drill of a coordinator lost meanwhile)
  LTRAIN_FAULT_STARTUP_STALL=SECONDS[:RANK]
                           rank RANK (every rank when absent) stops for SECONDS in its start-up,
                           after connecting and before building the model, without reporting
                           progress: a start-up longer than fault.hang_timeout_s is no hang; one
                           longer than fault.startup_timeout_s is reported as a stuck start-up

By hand, two ranks on one machine:
  LTRAIN_WORLD_SIZE=2 LTRAIN_RANK=0 LTRAIN_RDZV=file:///tmp/rdzv LTRAIN_RDZV_SCOPE=t1 ltrain-worker --recipe r.yaml &
  LTRAIN_WORLD_SIZE=2 LTRAIN_RANK=1 LTRAIN_RDZV=file:///tmp/rdzv LTRAIN_RDZV_SCOPE=t1 ltrain-worker --recipe r.yaml
(use a fresh scope or directory per run: stale keys from an old run would be read back).

Rank 0 prints "step S/N loss L lr R tok/s T step_ms M" lines and at the end "throughput: steps A-B
step_ms M tok/s T tok/s/device D tflops/device F" over the steps after the first three (less the
time spent in checkpoint saves), with "mfu P% peak_mem_gib G" on CUDA (MFU against 989 TFLOP/s,
FLOPs per token 6N + 12*L*d*T); on CUDA a step's line comes after the next step has been queued (the
host reads each loss one step late, and at checkpoints before saving); every rank prints once, after its first
step, "memory rank R: params B bytes, grads B bytes, optimizer B bytes, activations_peak B bytes".
Checkpoints go to <checkpoint_dir>/step-<N>/ (safetensors shards model-rank-R.safetensors and
optimizer-rank-R.safetensors of the ranks that hold distinct state, and meta.yaml: the manifest with
step, commit number, generation, job id, layout, data position, RNG state, recipe, and every file's
size and XXH3-64) with <checkpoint_dir>/latest; all but the newest checkpoint.keep commits are
pruned after each commit. A checkpoint directory belongs to the job that wrote it: a run whose
checkpoint directory holds another job's commits refuses to start (exit code 3). With
checkpoint.async (the default) the files are written by a background thread from a snapshot in host
memory while training goes on; rank 0 prints "checkpoint step-N written to DIR in X ms" when step N
is committed. A resume (checkpoint.resume_from, or a restarted generation) takes the newest commit
whose files verify as the ranks read them, saying why it skipped any newer one, and prints "resumed
from DIR at step N ..." with the time it took and the rate it read at; it may use any other
layout: data-parallel degree, ZeRO stage, tp, pp and virtual stages.
When the agent answers a progress report with a stop after a final checkpoint (ltrain stop
--checkpoint), the ranks agree through the rendezvous store on one step none has passed, train to
it, save and commit it like a periodic checkpoint, print "rank R: stopped after step S of N, with
its checkpoint committed: ..." and exit 0.
Exit code: 0 done (or stopped after a final checkpoint), 1 failed (reason on stderr), 2 bad usage,
3 refused to start and not to be restarted (another job's checkpoint directory, a checkpoint of
another format).
)";
}

namespace {

// A warm standby (--standby worker, which the agent starts for a job whose failed ranks it replaces in
// place): the process has loaded its libraries, most of a start's second, and waits on stdin for the
// rank it becomes. The agent writes the working directory and the rank's whole environment,
// NUL-separated, and closes the pipe. -1: go on as that rank; otherwise the exit code (0: the pipe
// closed with nothing, the standby is not needed).
int AwaitRank() {
  std::string payload;
  char buffer[65536];
  while (true) {
    const ssize_t n = ::read(0, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    payload.append(buffer, static_cast<size_t>(n));
  }
  if (payload.empty()) return 0;
  if (Status adopted = AdoptStandbyInput(payload); !adopted.ok()) {
    std::fprintf(stderr, "ltrain-worker: standby: %s\n", adopted.message().c_str());
    return kWorkerExitFailed;
  }
  return -1;
}

}  // namespace

int RunWorker(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines reach the agent as they happen
  if (argc > 1 && (std::string(argv[1]) == "export" || std::string(argv[1]) == "generate")) {
    return RunModelTool(argc, argv);
  }
  if (argc > 1 && std::string(argv[1]) == "--standby") {
    if (argc < 3 || std::string(argv[2]) != "worker") {
      std::fprintf(stderr, "ltrain-worker: --standby takes `worker`: wait on stdin for a rank's environment\n");
      return kWorkerExitUsage;
    }
    if (const int code = AwaitRank(); code >= 0) return code;
    argv[2] = argv[0];
    argv += 2;
    argc -= 2;
  }
  StatusOr<WorkerEnv> env = ParseWorkerEnv(ProcessEnvironment(), std::vector<std::string>(argv + 1, argv + argc));
  if (!env.ok()) {
    std::fprintf(stderr, "ltrain-worker: %s\n", env.status().message().c_str());
    return kWorkerExitUsage;
  }
  if (env->help) {
    std::fputs(WorkerUsage().c_str(), stdout);
    return 0;
  }
  Status status;
  try {
    status = Run(*env);
  } catch (const c10::OutOfMemoryError& e) {
    status = Internal(OutOfMemoryMessage(e));
  } catch (const c10::Error& e) {
    status = Internal(std::string("LibTorch error: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    status = Internal(std::string("unexpected error: ") + e.what());
  }
  std::fflush(stdout);
  if (!status.ok()) {
    std::fprintf(stderr, "ltrain-worker: rank %d: error: %s\n", env->rank, status.message().c_str());
    // A precondition no restart changes (another job's checkpoint directory, a checkpoint of another
    // format): the job fails at once.
    return status.code() == StatusCode::kFailedPrecondition ? kWorkerExitNoRestart : kWorkerExitFailed;
  }
  return 0;
}

}  // namespace ltrain::worker
