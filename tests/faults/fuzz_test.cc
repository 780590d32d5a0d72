// Inputs nobody meant: mutated recipes to the parser, malformed messages to every coordinator
// handler, malformed commands to the agent's supervisor and malformed calls to the agent's endpoint
// for workers, with a fixed seed (printed, so that a failure can be replayed). Nothing may crash or
// hang; a recipe is either refused with errors or accepted and round-trips; the coordinator and the
// agent still serve their real job afterwards. Under AddressSanitizer (the sanitizer configuration) a
// memory error fails the run.
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/reflection.h>
#include <google/protobuf/stubs/logging.h>

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "agent/agent.h"
#include "agent/fake_process_spawner.h"
#include "agent/supervisor.h"
#include "common/clock.h"
#include "common/logging.h"
#include "common/recipe.h"
#include "common/recipe_schema.h"
#include "launcher/coordinator.h"
#include "launcher/coordinator_server.h"
#include "launcher/state_store.h"
#include "ltrain/v1/ltrain.grpc.pb.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr uint64_t kSeed = 20261126;

// The seeds: every shipped recipe, and one that sets every key.
std::vector<std::string> RecipeCorpus() {
  std::vector<std::string> corpus;
  for (const auto& entry : fs::directory_iterator(fs::path(LTRAIN_SOURCE_DIR) / "recipes")) {
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    corpus.push_back(text.str());
  }
  corpus.push_back(RecipeToYaml(Recipe{}));
  return corpus;
}

// Values that break parsers: extremes, wrong types, YAML features, bytes that are not text.
const std::vector<std::string>& Nasty() {
  static const std::vector<std::string> values = {
      "-1", "0", "1e308", "-1e308", "nan", ".nan", ".inf", "-.inf", "99999999999999999999999", "0x7fffffff",
      "-9223372036854775808", "", "~", "null", "[]", "{}", "[1, [2, [3]]]", "{a: {b: {c: d}}}", "&anchor x",
      "*anchor", "!!binary aGk=", "!!str 5", "\"\\xff\\u0000\"", "'", "\"", ":", "- - -", "? x", "|\n  block",
      ">\n  folded", "\t", "\xff\xfe", "\xc3", std::string(1, '\0'), std::string(5000, 'a'), "../../etc/passwd",
      "step-1", "a\nb: c", "true", "false", "yes", "on", "1.5", "16.000000001"};
  return values;
}

std::string Mutate(const std::string& seed, std::mt19937_64& rng) {
  std::string s = seed;
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 7) {
      case 0:  // flip a byte
        if (!s.empty()) s[pick(s.size())] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1: {  // insert structural or odd bytes
        static const std::string kBytes = std::string(":{}[],&*!|>#'\"\n\t -?%@`\\") + std::string("\0\xff\x80", 3);
        s.insert(pick(s.size() + 1), 1, kBytes[pick(kBytes.size())]);
        break;
      }
      case 2: {  // delete a range
        const size_t at = pick(s.size() + 1);
        s.erase(at, pick(64));
        break;
      }
      case 3: {  // duplicate a range (repeated keys, nested sections)
        const size_t at = pick(s.size() + 1);
        const std::string piece = s.substr(at, pick(200));
        s.insert(pick(s.size() + 1), piece);
        break;
      }
      case 4: {  // a value replaced by a nasty one
        const size_t colon = s.find(": ", pick(s.size() + 1));
        if (colon == std::string::npos) break;
        const size_t end = s.find_first_of(",}\n", colon + 2);
        s.replace(colon + 2, (end == std::string::npos ? s.size() : end) - colon - 2, Nasty()[pick(Nasty().size())]);
        break;
      }
      case 5:  // truncated
        s.resize(pick(s.size() + 1));
        break;
      default: {  // a line of a key that does not exist, or a known key in the wrong place
        s.insert(pick(s.size() + 1), "\nzz_" + std::to_string(rng() % 100) + ": " + Nasty()[pick(Nasty().size())] + "\n");
        break;
      }
    }
  }
  if (s.size() > (64 << 10)) s.resize(64 << 10);
  return s;
}

TEST(FuzzTest, MutatedRecipesAreRefusedWithErrorsOrRoundTrip) {
  SetLogLevel(LogLevel::kError);
  std::mt19937_64 rng(kSeed);
  const std::vector<std::string> corpus = RecipeCorpus();
  std::vector<std::string> keys;
  for (const RecipeKeyDoc& key : DescribeRecipeKeys()) keys.push_back(key.path);
  constexpr int kRecipes = 100000;
  int accepted = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRecipes; ++i) {
    const std::string text = Mutate(corpus[rng() % corpus.size()], rng);
    std::vector<std::string> overrides;
    if (rng() % 10 == 0) overrides.push_back(keys[rng() % keys.size()] + "=" + Nasty()[rng() % Nasty().size()]);
    RecipeParseResult parsed = ParseRecipe(text, "fuzz.yaml", overrides);
    if (!parsed.ok()) {
      ASSERT_FALSE(parsed.ErrorText().empty()) << "seed " << kSeed << " case " << i << " refused without a word";
      continue;
    }
    ++accepted;
    ASSERT_EQ(JobNameProblem(parsed.recipe.name), "") << "seed " << kSeed << " case " << i;
    const std::string yaml = RecipeToYaml(parsed.recipe);
    RecipeParseResult again = ParseRecipe(yaml, "resolved.yaml");
    ASSERT_TRUE(again.ok()) << "seed " << kSeed << " case " << i << ": an accepted recipe does not round-trip:\n"
                            << again.ErrorText() << "\n" << yaml;
    ASSERT_EQ(RecipeToYaml(again.recipe), yaml) << "seed " << kSeed << " case " << i;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%d mutated recipes (seed %llu) in %.1f s: %d accepted, %d refused\n", kRecipes,
              static_cast<unsigned long long>(kSeed), seconds, accepted, kRecipes - accepted);
  EXPECT_GT(accepted, 0) << "the mutations never keep a recipe valid: they test only the first error";
}

// Fills `message` with random field values (by reflection): huge, empty, negative, enormous, not
// UTF-8, or names of the real job and node, so that handlers get past their first lookup.
void Randomize(Message* message, std::mt19937_64& rng, int depth) {
  const auto* descriptor = message->GetDescriptor();
  const Reflection* reflection = message->GetReflection();
  static const std::vector<std::string> kStrings = {
      "", "fuzz-1", "node-a", "exited", "killed", "running", "log", "fuzz-1/0/", "../../x", "\xff\xfe\xfd",
      std::string(20000, 'x'), "step-1", "\n\x1b[31m", "-1"};
  static const std::vector<int64_t> kInts = {0, 1, -1, 2, 7, std::numeric_limits<int32_t>::max(),
                                             std::numeric_limits<int32_t>::min(), std::numeric_limits<int64_t>::max(),
                                             std::numeric_limits<int64_t>::min(), 1000000007};
  auto str = [&] { return kStrings[rng() % kStrings.size()]; };
  auto num = [&] { return rng() % 4 == 0 ? static_cast<int64_t>(rng()) : kInts[rng() % kInts.size()]; };
  for (int f = 0; f < descriptor->field_count(); ++f) {
    const FieldDescriptor* field = descriptor->field(f);
    if (rng() % 3 == 0) continue;
    const int count = field->is_repeated() ? static_cast<int>(rng() % 4 == 0 ? 64 : rng() % 4) : 1;
    for (int k = 0; k < count; ++k) {
      const bool rep = field->is_repeated();
      switch (field->cpp_type()) {
        case FieldDescriptor::CPPTYPE_STRING:
          rep ? reflection->AddString(message, field, str()) : reflection->SetString(message, field, str());
          break;
        case FieldDescriptor::CPPTYPE_INT32:
          rep ? reflection->AddInt32(message, field, static_cast<int32_t>(num()))
              : reflection->SetInt32(message, field, static_cast<int32_t>(num()));
          break;
        case FieldDescriptor::CPPTYPE_INT64:
          rep ? reflection->AddInt64(message, field, num()) : reflection->SetInt64(message, field, num());
          break;
        case FieldDescriptor::CPPTYPE_UINT32:
          rep ? reflection->AddUInt32(message, field, static_cast<uint32_t>(num()))
              : reflection->SetUInt32(message, field, static_cast<uint32_t>(num()));
          break;
        case FieldDescriptor::CPPTYPE_UINT64:
          rep ? reflection->AddUInt64(message, field, static_cast<uint64_t>(num()))
              : reflection->SetUInt64(message, field, static_cast<uint64_t>(num()));
          break;
        case FieldDescriptor::CPPTYPE_DOUBLE: {
          const double values[] = {0.0, -1.0, 1e308, std::numeric_limits<double>::quiet_NaN(),
                                   std::numeric_limits<double>::infinity(), 3.5};
          const double v = values[rng() % 6];
          rep ? reflection->AddDouble(message, field, v) : reflection->SetDouble(message, field, v);
          break;
        }
        case FieldDescriptor::CPPTYPE_FLOAT: {
          const float v = rng() % 2 ? std::numeric_limits<float>::quiet_NaN() : -1.0f;
          rep ? reflection->AddFloat(message, field, v) : reflection->SetFloat(message, field, v);
          break;
        }
        case FieldDescriptor::CPPTYPE_BOOL:
          rep ? reflection->AddBool(message, field, rng() % 2) : reflection->SetBool(message, field, rng() % 2);
          break;
        case FieldDescriptor::CPPTYPE_ENUM: {
          const int v = static_cast<int>(num() % 16);
          rep ? reflection->AddEnumValue(message, field, v) : reflection->SetEnumValue(message, field, v);
          break;
        }
        case FieldDescriptor::CPPTYPE_MESSAGE:
          if (depth < 3) {
            Randomize(rep ? reflection->AddMessage(message, field) : reflection->MutableMessage(message, field), rng,
                      depth + 1);
          }
          break;
      }
    }
  }
}

template <typename M>
M Random(std::mt19937_64& rng) {
  M message;
  Randomize(&message, rng, 0);
  return message;
}

TEST(FuzzTest, MalformedMessagesToEveryCoordinatorHandlerCrashNothing) {
  SetLogLevel(LogLevel::kError);
  std::unique_ptr<launcher::StateStore> store = std::move(launcher::SqliteStateStore::Open(":memory:")).value();
  FakeClock clock;
  launcher::CoordinatorOptions options;
  options.state_dir = "/state";
  options.node_timeout_ms = 3000;
  launcher::Coordinator coordinator(store.get(), &clock, options);
  // A real node and a real running job, so that messages naming them reach past the lookups.
  v1::NodeFacts facts;
  facts.set_cpus(8);
  coordinator.NodeConnected("node-a", facts);
  StatusOr<v1::Job> job = coordinator.Submit("name: fuzz\ndata: {path: /d}\nparallel: {nproc_per_node: 2}\n", "fuzz.yaml");
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  ASSERT_EQ(job->id(), "fuzz-1");

  std::mt19937_64 rng(kSeed);
  constexpr int kMessages = 10000;
  struct Handler {
    const char* name;
    std::function<bool()> call;  // true: refused with an error
  };
  auto refused = [](const Status& s) { return !s.ok(); };
  const std::vector<Handler> handlers = {
      {"Heartbeat", [&] { return refused(coordinator.Heartbeat(Random<v1::HeartbeatRequest>(rng))); }},
      {"ReportProgress", [&] { return refused(coordinator.ReportProgress(Random<v1::ProgressReport>(rng))); }},
      {"ReportWorkerState", [&] { return refused(coordinator.ReportWorkerState(Random<v1::WorkerStateReport>(rng))); }},
      {"PushLogs", [&] { coordinator.PushLogs(Random<v1::PushLogsRequest>(rng)); return false; }},
      {"Submit", [&] { return !coordinator.Submit(Mutate(Random<v1::SubmitJobRequest>(rng).recipe_yaml(), rng), "x").ok(); }},
      {"GetJob", [&] { return !coordinator.GetJob(Random<v1::GetJobRequest>(rng).job_id()).ok(); }},
      {"Stop", [&] {
         const auto request = Random<v1::StopJobRequest>(rng);
         return !coordinator.Stop(request.job_id() == "fuzz-1" ? "fuzz-x" : request.job_id(), request.reason()).ok();
       }},
      {"Resume", [&] { return !coordinator.Resume(Random<v1::ResumeJobRequest>(rng).job_id()).ok(); }},
      {"GetLogs", [&] {
         const auto request = Random<v1::GetLogsRequest>(rng);
         return !coordinator.GetLogs(request.job_id(), request.rank(), request.since_unix_ms(), request.limit()).ok();
       }},
      {"KvSet", [&] {
         const auto request = Random<v1::KvSetRequest>(rng);
         return !coordinator.KvSet(request.key(), request.value()).ok();
       }},
      {"KvGet", [&] {
         const auto request = Random<v1::KvGetRequest>(rng);
         std::vector<std::string> keys(request.keys().begin(), request.keys().end());
         return !coordinator.KvGet(keys, 0).has_value();
       }},
      {"NodeConnected", [&] {
         const auto request = Random<v1::RegisterRequest>(rng);
         if (request.node_id() == "node-a") return false;  // the real node stays
         std::vector<v1::RunningWorker> running(request.running().begin(), request.running().end());
         coordinator.NodeDisconnected(request.node_id(), coordinator.NodeConnected(request.node_id(), request.facts(), running));
         return false;
       }},
  };
  const auto start = std::chrono::steady_clock::now();
  for (const Handler& handler : handlers) {
    int refusals = 0;
    const auto handler_start = std::chrono::steady_clock::now();
    for (int i = 0; i < kMessages; ++i) {
      if (handler.call()) ++refusals;
      if (i % 500 == 0) {
        clock.AdvanceMs(100);
        coordinator.Tick();
      }
    }
    std::printf("%-18s %d malformed messages in %.2f s, %d refused with an error\n", handler.name, kMessages,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - handler_start).count(), refusals);
  }
  std::printf("seed %llu, %.1f s in all\n", static_cast<unsigned long long>(kSeed),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  // Still serving: the real job can be read, listed and stopped.
  StatusOr<v1::Job> after = coordinator.GetJob("fuzz-1");
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  ASSERT_TRUE(coordinator.ListJobs(100).ok());
  (void)coordinator.Stop("fuzz-1", "end of the fuzz test");
  coordinator.Shutdown();
}

// A directory of its own under the system's temporary directory, removed at the end.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "ltrain-fuzz-XXXXXX").string();
    path_ = mkdtemp(pattern.data()) ? pattern : "";
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  fs::path path() const { return path_; }

 private:
  std::string path_;
};

class CountingOutbox : public agent::SupervisorOutbox {
 public:
  void Send(agent::SupervisorMessage message) override {
    if (const auto* report = std::get_if<v1::WorkerStateReport>(&message)) {
      if (report->exit_code() == kRefused && report->state() == "exited") ++refusals;
    }
    ++messages;
  }
  void RunningChanged(const std::vector<v1::RunningWorker>& running) override { most_running = std::max(most_running, running.size()); }
  static constexpr int kRefused = 3;  // kWorkerExitNoRestart
  int messages = 0;
  int refusals = 0;
  size_t most_running = 0;
};

// A start command the coordinator could have sent, with one part of it (or all) made random.
v1::Command MalformedCommand(std::mt19937_64& rng) {
  v1::Command command;
  if (rng() % 4 == 0) {
    Randomize(&command, rng, 0);
    return command;
  }
  if (rng() % 5 == 0) {
    v1::StopJobCommand* stop = command.mutable_stop();
    Randomize(stop, rng, 0);
    return command;
  }
  v1::StartJobCommand* start = command.mutable_start();
  const int generation = static_cast<int>(rng() % 3);
  start->set_job_id("fuzz-1");
  start->set_generation(generation);
  start->set_recipe_yaml("name: fuzz\n");
  start->set_world_size(2);
  start->set_local_world_size(2);
  start->set_rendezvous_scope("fuzz-1/" + std::to_string(generation) + "/");
  for (int rank = 0; rank < 2; ++rank) {
    v1::WorkerAssignment* worker = start->add_workers();
    worker->set_rank(rank);
    worker->set_local_rank(rank);
  }
  // One field at random replaced by a random value (or left valid, one time in eight).
  const auto* descriptor = start->GetDescriptor();
  const auto* reflection = start->GetReflection();
  if (rng() % 8 == 0) return command;
  const FieldDescriptor* field = descriptor->field(static_cast<int>(rng() % descriptor->field_count()));
  if (field->is_repeated()) {
    start->clear_workers();
    const int count = rng() % 4 == 0 ? 64 : static_cast<int>(rng() % 4);
    for (int k = 0; k < count; ++k) Randomize(start->add_workers(), rng, 1);
    return command;
  }
  v1::StartJobCommand random;
  Randomize(&random, rng, 0);
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      reflection->SetString(start, field, random.GetReflection()->GetString(random, field));
      break;
    case FieldDescriptor::CPPTYPE_INT32:
      reflection->SetInt32(start, field, random.GetReflection()->GetInt32(random, field));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      reflection->SetInt64(start, field, random.GetReflection()->GetInt64(random, field));
      break;
    default:
      break;
  }
  return command;
}

// Every path under `root`, as text.
std::vector<std::string> Tree(const fs::path& root) {
  std::vector<std::string> paths;
  for (const auto& entry : fs::recursive_directory_iterator(root)) paths.push_back(entry.path().string());
  return paths;
}

TEST(FuzzTest, MalformedCommandsToTheAgentsSupervisorCrashNothingAndWriteOnlyUnderItsWorkDir) {
  SetLogLevel(LogLevel::kError);
  ScratchDir scratch;
  ASSERT_FALSE(scratch.path().empty());
  const fs::path work_dir = scratch.path() / "nest" / "work";
  fs::create_directories(work_dir);
  agent::FakeProcessSpawner spawner;
  FakeClock clock;
  CountingOutbox outbox;
  agent::SupervisorOptions options;
  options.node_id = "node-a";
  options.work_dir = work_dir.string();
  options.worker_binary = "/bin/true";
  options.agent_address = "127.0.0.1:1";
  options.stop_grace_ms = 100;
  options.read_oom_kill_count = [] { return std::optional<int64_t>(0); };
  options.issue_worker_secret = [](const v1::StartJobCommand&) { return std::string("secret"); };
  agent::Supervisor supervisor(options, spawner, clock, outbox);

  std::mt19937_64 rng(kSeed);
  constexpr int kCommands = 10000;
  int starts = 0, stops = 0, refused = 0;
  const auto start_time = std::chrono::steady_clock::now();
  for (int i = 0; i < kCommands; ++i) {
    const v1::Command command = MalformedCommand(rng);
    if (command.has_start()) {
      ++starts;
      if (!agent::CheckStartCommand(command.start()).ok()) ++refused;
      supervisor.StartJob(command.start());
    } else if (command.has_stop()) {
      ++stops;
      supervisor.StopJob(command.stop().job_id(), command.stop().generation());
    }
    supervisor.Poll();
    if (i % 50 == 0) {
      // Every worker started so far ends (SIGTERM, then the grace), so that they do not pile up.
      supervisor.StopAll();
      supervisor.Poll();
      clock.AdvanceMs(200);
      supervisor.Poll();
    }
  }
  supervisor.KillAll();
  for (int i = 0; i < 10 && !supervisor.Idle(); ++i) supervisor.Poll();
  std::printf("agent supervisor   %d malformed commands (%d starts, %d refused; %d stops) in %.2f s; %d exit "
              "reports for refused starts; at most %zu workers at once\n",
              kCommands, starts, refused, stops,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count(), outbox.refusals,
              outbox.most_running);
  EXPECT_TRUE(supervisor.Idle());
  EXPECT_GT(refused, 0);
  EXPECT_LT(refused, starts) << "the mutations never leave a start valid: only the checks are tested";
  // Nothing outside the work directory, and under it only jobs/<usable id>/gen-<n>/.
  for (const std::string& path : Tree(scratch.path())) {
    const std::string relative = fs::relative(path, work_dir).string();
    if (path == (scratch.path() / "nest").string() || path == work_dir.string()) continue;
    ASSERT_EQ(relative.rfind("..", 0), std::string::npos) << "written outside the work directory: " << path;
    ASSERT_EQ(relative.rfind("jobs", 0), 0u) << path;
  }
  for (const auto& job : fs::directory_iterator(work_dir / "jobs")) {
    EXPECT_EQ(job.path().filename().string(), "fuzz-1") << "a directory for a job id the checks refuse";
  }
}

// The agent's endpoint for workers, for real: a coordinator and an agent in this process over
// loopback gRPC, and one job whose worker (a shell script that records its environment) gives the
// test its address and secret.
TEST(FuzzTest, MalformedCallsToTheAgentsEndpointForWorkersCrashNothing) {
  SetLogLevel(LogLevel::kError);
  ScratchDir scratch;
  ASSERT_FALSE(scratch.path().empty());
  const fs::path worker = scratch.path() / "worker.sh";
  {
    std::ofstream script(worker);
    script << "#!/bin/sh\nenv > \"$LTRAIN_RECIPE_FILE.env.tmp\" && mv \"$LTRAIN_RECIPE_FILE.env.tmp\" "
              "\"$LTRAIN_RECIPE_FILE.env\"\nexec sleep 600\n";
  }
  fs::permissions(worker, fs::perms::owner_all);
  launcher::CoordinatorServerOptions server_options;
  server_options.listen_address = "127.0.0.1:0";
  server_options.state_dir = (scratch.path() / "state").string();
  server_options.recover = false;
  server_options.security.token = NewToken();
  StatusOr<std::unique_ptr<launcher::CoordinatorServer>> server = launcher::CoordinatorServer::Start(server_options);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  agent::AgentOptions agent_options;
  agent_options.coordinator = (*server)->address();
  agent_options.node_id = "node-a";
  agent_options.security = server_options.security;
  agent_options.work_dir = (scratch.path() / "agent").string();
  agent_options.worker_binary = worker.string();
  agent_options.heartbeat_interval_s = 0.2;
  StatusOr<std::unique_ptr<agent::Agent>> node = agent::Agent::Start(agent_options);
  ASSERT_TRUE(node.ok()) << node.status().ToString();
  StatusOr<v1::Job> job = (*server)->coordinator().Submit(
      "name: fuzz\ndata: {path: /d}\nparallel: {nproc_per_node: 1}\nfault: {hang_timeout_s: 600}\n", "fuzz.yaml");
  ASSERT_TRUE(job.ok()) << job.status().ToString();

  const fs::path env_file = scratch.path() / "agent" / "jobs" / job->id() / "gen-0" / "recipe.yaml.env";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(env_file) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(fs::exists(env_file)) << "the job's worker did not start within 60 s";
  std::map<std::string, std::string> env;
  {
    std::ifstream in(env_file);
    std::string line;
    while (std::getline(in, line)) env[line.substr(0, line.find('='))] = line.substr(line.find('=') + 1);
  }
  std::string secret;
  std::ifstream(env["LTRAIN_AGENT_SECRET_FILE"]) >> secret;
  ASSERT_FALSE(secret.empty());
  const std::string scope = env["LTRAIN_RDZV_SCOPE"];
  ASSERT_EQ(scope, job->id() + "/0/");

  // Strings that are not UTF-8 are the point here: protobuf's line for each of them is not.
  google::protobuf::LogHandler* protobuf_log = google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  auto channel = grpc::CreateChannel(env["LTRAIN_AGENT"], grpc::InsecureChannelCredentials());
  auto rendezvous = v1::RendezvousService::NewStub(channel);
  auto workers = v1::WorkerService::NewStub(channel);
  std::mt19937_64 rng(kSeed);
  // (gRPC's client itself refuses header values that are not printable ASCII.)
  const std::vector<std::string> bearers = {"", "garbage", secret, secret + "x", std::string(5000, 'a'), "a b"};
  auto context_for = [&](grpc::ClientContext& context, const std::string& bearer) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    if (!bearer.empty()) context.AddMetadata("authorization", "Bearer " + bearer);
  };
  struct Call {
    const char* name;
    std::function<grpc::StatusCode(const std::string& bearer)> call;
  };
  const std::vector<Call> calls = {
      {"agent KvSet", [&](const std::string& bearer) {
         grpc::ClientContext context;
         context_for(context, bearer);
         v1::KvSetRequest request = Random<v1::KvSetRequest>(rng);
         if (rng() % 2) request.set_key(scope + request.key());
         v1::KvSetReply reply;
         return rendezvous->Set(&context, request, &reply).error_code();
       }},
      {"agent KvGet", [&](const std::string& bearer) {
         grpc::ClientContext context;
         context_for(context, bearer);
         v1::KvGetRequest request = Random<v1::KvGetRequest>(rng);
         if (rng() % 2) {
           for (auto& key : *request.mutable_keys()) key = scope + key;
         }
         // Enormous and negative waits one time in fifty; otherwise none, so that the calls are quick.
         if (rng() % 50 != 0) request.set_timeout_ms(static_cast<int64_t>(rng() % 3) - 1);
         v1::KvGetReply reply;
         return rendezvous->Get(&context, request, &reply).error_code();
       }},
      {"agent Progress", [&](const std::string& bearer) {
         grpc::ClientContext context;
         context_for(context, bearer);
         v1::RankProgress request = Random<v1::RankProgress>(rng);
         if (rng() % 2) {
           request.set_job_id(job->id());
           request.set_generation(0);
         }
         v1::ProgressAck ack;
         return workers->ReportProgress(&context, request, &ack).error_code();
       }},
  };
  constexpr int kCalls = 10000;
  for (const Call& call : calls) {
    std::map<grpc::StatusCode, int> codes;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) ++codes[call.call(bearers[rng() % bearers.size()])];
    std::string summary;
    for (const auto& [code, count] : codes) summary += " " + std::to_string(code) + ":" + std::to_string(count);
    std::printf("%-18s %d malformed calls in %.2f s; gRPC codes%s\n", call.name, kCalls,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), summary.c_str());
    EXPECT_GT(codes[grpc::StatusCode::UNAUTHENTICATED], 0) << "calls without the secret were let in";
  }

  // Still serving its worker: a key set in the job's scope comes back, and a key of another scope
  // is refused.
  {
    grpc::ClientContext context;
    context_for(context, secret);
    v1::KvSetRequest request;
    request.set_key(scope + "after");
    request.set_value("fine");
    v1::KvSetReply reply;
    ASSERT_TRUE(rendezvous->Set(&context, request, &reply).ok());
  }
  {
    grpc::ClientContext context;
    context_for(context, secret);
    v1::KvGetRequest request;
    request.add_keys(scope + "after");
    request.set_timeout_ms(1000);
    v1::KvGetReply reply;
    ASSERT_TRUE(rendezvous->Get(&context, request, &reply).ok());
    ASSERT_EQ(reply.values_size(), 1);
    EXPECT_EQ(reply.values(0), "fine");
  }
  {
    grpc::ClientContext context;
    context_for(context, secret);
    v1::KvSetRequest request;
    request.set_key("other-1/0/x");
    v1::KvSetReply reply;
    EXPECT_EQ(rendezvous->Set(&context, request, &reply).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  google::protobuf::SetLogHandler(protobuf_log);
  ASSERT_TRUE((*server)->coordinator().Stop(job->id(), "end of the fuzz test").ok());
  (*node)->Shutdown();
  (*server)->Shutdown();
}

}  // namespace
}  // namespace ltrain
