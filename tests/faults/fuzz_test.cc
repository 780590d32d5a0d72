// Inputs nobody meant: mutated recipes to the parser and malformed messages to every coordinator
// handler, in-process with a fixed seed (printed, so that a failure can be replayed). Nothing may
// crash or hang; a recipe is either refused with errors or accepted and round-trips; the coordinator
// still serves its real job afterwards. Under AddressSanitizer (the sanitizer configuration) a
// memory error fails the run.
#include <gtest/gtest.h>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/reflection.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/logging.h"
#include "common/recipe.h"
#include "common/recipe_schema.h"
#include "launcher/coordinator.h"
#include "launcher/state_store.h"

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
         coordinator.KvSet(request.key(), request.value());
         return false;
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

}  // namespace
}  // namespace ltrain
