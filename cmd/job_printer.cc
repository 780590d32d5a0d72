#include "cmd/job_printer.h"

#include <cctype>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>

#include <google/protobuf/util/json_util.h>

#include "common/logging.h"
#include "common/recipe.h"
#include "common/signal_name.h"
#include "launcher/log_view.h"
#include "launcher/state_store.h"

namespace ltrain::cli {
namespace {

// Identical lines of several ranks fold into one when they come within this many ms of each other.
constexpr int64_t kFoldWindowMs = 2000;

// printf's column formats, kept as the tables have always used them, into a string.
__attribute__((format(printf, 2, 3))) void Appendf(std::string* out, const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list again;
  va_copy(again, args);
  int size = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  if (size > 0) {
    size_t start = out->size();
    out->resize(start + static_cast<size_t>(size) + 1);
    std::vsnprintf(out->data() + start, static_cast<size_t>(size) + 1, format, again);
    out->resize(start + static_cast<size_t>(size));
  }
  va_end(again);
}

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

void AppendJsonString(std::string* out, const std::string& text) {
  *out += '"';
  for (unsigned char c : text) {
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          Appendf(out, "\\u%04x", c);
        } else {
          *out += static_cast<char>(c);
        }
    }
  }
  *out += '"';
}

void AppendJsonNumber(std::string* out, double value) {
  if (!std::isfinite(value)) {
    *out += "null";
    return;
  }
  char text[40];
  std::snprintf(text, sizeof(text), "%.17g", value);
  // The shortest form that reads back the same, as most tools print it.
  for (int digits = 1; digits <= 17; ++digits) {
    char shorter[40];
    std::snprintf(shorter, sizeof(shorter), "%.*g", digits, value);
    if (std::strtod(shorter, nullptr) == value) {
      std::snprintf(text, sizeof(text), "%s", shorter);
      break;
    }
  }
  *out += text;
}

// An enum value's name without its type's prefix: JOB_STATE_RUNNING is "RUNNING".
std::string EnumName(const google::protobuf::EnumValueDescriptor* value) {
  std::string prefix;
  for (char c : value->type()->name()) {
    if (std::isupper(static_cast<unsigned char>(c)) && !prefix.empty()) prefix += '_';
    prefix += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  prefix += '_';
  return value->name().rfind(prefix, 0) == 0 ? value->name().substr(prefix.size()) : value->name();
}

void AppendJsonMessage(std::string* out, const Message& message, bool pretty, int depth);

void AppendJsonValue(std::string* out, const Message& message, const FieldDescriptor* field, int index, bool pretty,
                     int depth) {
  const Reflection* r = message.GetReflection();
  const bool rep = field->is_repeated();
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      *out += std::to_string(rep ? r->GetRepeatedInt32(message, field, index) : r->GetInt32(message, field));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      *out += std::to_string(rep ? r->GetRepeatedInt64(message, field, index) : r->GetInt64(message, field));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      *out += std::to_string(rep ? r->GetRepeatedUInt32(message, field, index) : r->GetUInt32(message, field));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      *out += std::to_string(rep ? r->GetRepeatedUInt64(message, field, index) : r->GetUInt64(message, field));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      AppendJsonNumber(out, rep ? r->GetRepeatedDouble(message, field, index) : r->GetDouble(message, field));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      AppendJsonNumber(out, rep ? r->GetRepeatedFloat(message, field, index) : r->GetFloat(message, field));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      *out += (rep ? r->GetRepeatedBool(message, field, index) : r->GetBool(message, field)) ? "true" : "false";
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      AppendJsonString(out, EnumName(rep ? r->GetRepeatedEnum(message, field, index) : r->GetEnum(message, field)));
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      AppendJsonString(out, rep ? r->GetRepeatedString(message, field, index) : r->GetString(message, field));
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      AppendJsonMessage(out, rep ? r->GetRepeatedMessage(message, field, index) : r->GetMessage(message, field),
                        pretty, depth + 1);
      break;
  }
}

void AppendJsonMessage(std::string* out, const Message& message, bool pretty, int depth) {
  const auto* descriptor = message.GetDescriptor();
  if (descriptor->file()->package() == "google.protobuf") {
    // Struct, ListValue, Value: already plain JSON values.
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = pretty;
    std::string json;
    (void)google::protobuf::util::MessageToJsonString(message, &json, options);
    while (!json.empty() && json.back() == '\n') json.pop_back();
    *out += json;
    return;
  }
  const std::string indent = pretty ? "\n" + std::string(2 * (depth + 1), ' ') : "";
  const std::string close = pretty ? "\n" + std::string(2 * depth, ' ') : "";
  const Reflection* r = message.GetReflection();
  *out += '{';
  for (int f = 0; f < descriptor->field_count(); ++f) {
    const FieldDescriptor* field = descriptor->field(f);
    if (f > 0) *out += ',';
    *out += indent;
    AppendJsonString(out, field->name());
    *out += pretty ? ": " : ":";
    if (!field->is_repeated()) {
      // A field declared `optional` that is not set (Job.replacing_rank: none) is null, not 0.
      if (field->has_optional_keyword() && !r->HasField(message, field)) {
        *out += "null";
        continue;
      }
      AppendJsonValue(out, message, field, -1, pretty, depth);
      continue;
    }
    const int size = r->FieldSize(message, field);
    *out += '[';
    for (int i = 0; i < size; ++i) {
      if (i > 0) *out += pretty ? ", " : ",";
      AppendJsonValue(out, message, field, i, pretty, depth + 1);
    }
    *out += ']';
  }
  *out += close + '}';
}

}  // namespace

std::string FormatJson(const google::protobuf::Message& message, bool pretty) {
  std::string out;
  AppendJsonMessage(&out, message, pretty, 0);
  return out;
}

std::string FormatAge(int64_t then_unix_ms, int64_t now_unix_ms) {
  int64_t seconds = (now_unix_ms - then_unix_ms) / 1000;
  if (seconds < 120) return std::to_string(seconds) + "s ago";
  if (seconds < 7200) return std::to_string(seconds / 60) + "m ago";
  if (seconds < 172800) return std::to_string(seconds / 3600) + "h ago";
  return std::to_string(seconds / 86400) + "d ago";
}

std::string FirstLine(const std::string& text, size_t max) {
  std::string line = text.substr(0, text.find('\n'));
  return line.size() > max ? line.substr(0, max - 3) + "..." : line;
}

std::string FormatJobTable(const std::vector<v1::Job>& jobs, int64_t now_unix_ms) {
  if (jobs.empty()) return "no jobs yet; start one with `ltrain launch RECIPE`\n";
  std::string out;
  Appendf(&out, "%-28s %-10s %5s %8s %10s %-9s  %s\n", "JOB", "STATE", "RANKS", "STEP", "LOSS", "CREATED", "CAUSE");
  for (const auto& job : jobs) {
    char loss[32] = "-";
    if (job.last_step() > 0) std::snprintf(loss, sizeof(loss), "%.4f", job.last_loss());
    Appendf(&out, "%-28s %-10s %5d %8lld %10s %-9s  %s\n", job.id().c_str(), launcher::JobStateName(job.state()),
            job.world_size(), static_cast<long long>(job.last_step()), loss,
            FormatAge(job.created_unix_ms(), now_unix_ms).c_str(), FirstLine(job.cause(), 60).c_str());
  }
  return out;
}

std::string FormatNodeTable(const std::vector<v1::NodeStatus>& nodes) {
  if (nodes.empty()) return "no nodes yet; start `ltrain agent --coordinator HOST:PORT` on each node\n";
  std::string out;
  Appendf(&out, "%-20s %-24s %5s %5s %-5s %10s  %s\n", "NODE", "HOST", "CPUS", "GPUS", "STATE", "HEARTBEAT", "JOBS");
  for (const auto& node : nodes) {
    char age[32];
    std::snprintf(age, sizeof(age), "%.1fs ago", static_cast<double>(node.heartbeat_age_ms()) / 1000.0);
    std::string jobs;
    for (const auto& job : node.jobs()) jobs += (jobs.empty() ? "" : ",") + job;
    Appendf(&out, "%-20s %-24s %5d %5d %-5s %10s  %s\n", TerminalSafe(node.node_id()).c_str(),
            TerminalSafe(node.facts().hostname()).c_str(), node.facts().cpus(), node.facts().gpus(),
            node.connected() ? "up" : "lost", age, jobs.empty() ? "-" : jobs.c_str());
  }
  return out;
}

std::string FormatJobDetail(const v1::Job& job, int64_t now_unix_ms) {
  std::string out;
  Appendf(&out, "job:            %s\n", job.id().c_str());
  Appendf(&out, "state:          %s\n", launcher::JobStateName(job.state()));
  Appendf(&out, "created:        %s\n", FormatAge(job.created_unix_ms(), now_unix_ms).c_str());
  Appendf(&out, "generation:     %d (restarts: %d)\n", job.generation(), job.restarts());
  Appendf(&out, "ranks:          %d on %d node(s)\n", job.world_size(), job.nodes_now());
  if (job.total_steps() > 0) {
    Appendf(&out, "step:           %lld/%lld\n", static_cast<long long>(job.last_step()),
            static_cast<long long>(job.total_steps()));
  } else {
    Appendf(&out, "step:           %lld\n", static_cast<long long>(job.last_step()));
  }
  if (job.last_step() > 0) Appendf(&out, "loss:           %.4f\n", job.last_loss());
  if (job.val_step() > 0) {
    Appendf(&out, "val loss:       %.4f (after step %lld)\n", job.val_loss(), static_cast<long long>(job.val_step()));
  }
  if (job.tokens_per_s() > 0) Appendf(&out, "tokens/s:       %.0f\n", job.tokens_per_s());
  if (job.mfu() > 0) Appendf(&out, "mfu:            %.1f%%\n", 100.0 * job.mfu());
  if (job.has_moe()) {
    // model.moe: how the last step's assignments fell on the experts.
    const v1::MoeFigures& f = job.moe();
    Appendf(&out, "moe load:       busiest expert %.2fx an even share (block %d); %.2fx over the %d MoE blocks",
            f.load_max(), f.worst_layer(), f.load_mean(), f.layers_size());
    if (f.aux_loss() >= 0) Appendf(&out, "; balance loss %.3g", f.aux_loss());
    if (f.z_loss() >= 0) Appendf(&out, "; z-loss %.3g", f.z_loss());
    if (f.drop_rate() >= 0) {
      Appendf(&out, "; %.2f%% of assignments dropped", 100.0 * f.drop_rate());
    }
    out += "\n";
  }
  if (job.has_fp8()) {
    // parallel.precision fp8: the amax range of each operand kind over rank 0's last step's products.
    const v1::Fp8Figures& f = job.fp8();
    Appendf(&out, "fp8 amax:       activations %.3g to %.3g, weights %.3g to %.3g, gradients %.3g to %.3g (%d operands)\n",
            f.activation_amax_min(), f.activation_amax_max(), f.weight_amax_min(), f.weight_amax_max(),
            f.gradient_amax_min(), f.gradient_amax_max(), f.products());
    if (f.overflow_steps() > 0) {
      Appendf(&out, "fp8 overflows:  %lld steps (the last: step %lld)\n", static_cast<long long>(f.overflow_steps()),
              static_cast<long long>(f.last_overflow_step()));
    } else {
      Appendf(&out, "fp8 overflows:  none\n");
    }
  }
  if (job.checkpoint_save_ms() > 0) {
    Appendf(&out, "last save:      %.1f s (%.2f GB)\n", job.checkpoint_save_ms() / 1000.0,
            static_cast<double>(job.checkpoint_save_bytes()) / 1e9);
  }
  if (job.checkpoint_load_ms() > 0) Appendf(&out, "last load:      %.1f s\n", job.checkpoint_load_ms() / 1000.0);
  if (job.has_limits() && job.limits().step().seconds() > 0) {
    // Each limit with how it came about: the recipe's figure, or derived from the run.
    Appendf(&out, "hang limits:    step %.0f s (%s)\n", job.limits().step().seconds(), job.limits().step().how().c_str());
    Appendf(&out, "                start-up %.0f s (%s)\n", job.limits().startup().seconds(),
            job.limits().startup().how().c_str());
    Appendf(&out, "                checkpoint %.0f s (%s)\n", job.limits().checkpoint().seconds(),
            job.limits().checkpoint().how().c_str());
  }
  if (job.members_size() > 0) {
    std::string members;
    for (int32_t r : job.members()) members += (members.empty() ? "" : ",") + std::to_string(r);
    Appendf(&out, "members:        ranks %s go on (the others left with a lost node; membership epoch %d)\n",
            members.c_str(), job.membership_epoch());
  }
  if (job.recoveries() > 0) {
    Appendf(&out, "in place:       %d recover%s, work lost: %lld step%s; the last took %.1f s (failure to next step)\n",
            job.recoveries(), job.recoveries() == 1 ? "y" : "ies", static_cast<long long>(job.lost_steps()),
            job.lost_steps() == 1 ? "" : "s", job.last_recovery_ms() / 1000.0);
  }
  {
    const v1::RankInfo* most = nullptr;
    for (const auto& rank : job.ranks()) {
      if (rank.memory_bytes() > 0 && (most == nullptr || rank.memory_bytes() > most->memory_bytes())) most = &rank;
    }
    if (most != nullptr) {
      Appendf(&out, "memory:         up to %.2f GiB a rank (rank %d)\n",
              static_cast<double>(most->memory_bytes()) / (1 << 30), most->rank());
    }
  }
  if (job.eta_s() > 0) {
    int64_t eta = static_cast<int64_t>(job.eta_s());
    Appendf(&out, "eta:            %lldh%02lldm%02llds\n", static_cast<long long>(eta / 3600),
            static_cast<long long>(eta / 60 % 60), static_cast<long long>(eta % 60));
  }
  if (job.last_committed_step() > 0) {
    Appendf(&out, "last committed: step %lld (%s)\n", static_cast<long long>(job.last_committed_step()),
            job.last_committed_path().c_str());
  } else {
    out += "last committed: none yet\n";
  }
  if (!job.cause().empty()) Appendf(&out, "cause:          %s\n", job.cause().c_str());
  if (!job.last_failure().empty() && job.last_failure() != job.cause()) {
    Appendf(&out, "last failure:   %s\n", job.last_failure().c_str());
  }
  if (job.nodes_size() > 0) {
    Appendf(&out, "\n%-14s %-20s %-10s %s\n", "NODE", "HOST", "CONNECTED", "HEARTBEAT");
    for (const auto& node : job.nodes()) {
      Appendf(&out, "%-14s %-20s %-10s %.1fs ago\n", node.node_id().c_str(), node.hostname().c_str(),
              node.connected() ? "yes" : "no", node.heartbeat_age_ms() / 1000.0);
    }
  }
  if (job.ranks_size() > 0) {
    Appendf(&out, "\n%5s %-14s %8s %-8s %5s %8s %-11s %9s  %s\n", "RANK", "NODE", "PID", "STATE", "EXIT", "STEP",
            "PHASE", "PROGRESS", "LOG");
    for (const auto& rank : job.ranks()) {
      std::string exit = rank.signal() ? SignalName(rank.signal()) : std::to_string(rank.exit_code());
      if (rank.state() == "running" || rank.state() == "starting") exit = "-";
      char age[32] = "-";
      if (!rank.phase().empty()) std::snprintf(age, sizeof(age), "%.1fs ago", rank.progress_age_ms() / 1000.0);
      Appendf(&out, "%5d %-14s %8lld %-8s %5s %8lld %-11s %9s  %s\n", rank.rank(), rank.node_id().c_str(),
              static_cast<long long>(rank.pid()), rank.state().c_str(), exit.c_str(),
              static_cast<long long>(rank.last_step()), rank.phase().empty() ? "-" : rank.phase().c_str(), age,
              rank.log_path().c_str());
    }
    for (const auto& rank : job.ranks()) {
      if (!rank.work().empty()) Appendf(&out, "rank %d: %s\n", rank.rank(), rank.work().c_str());
    }
    for (const auto& rank : job.ranks()) {
      if (rank.straggler()) {
        Appendf(&out, "rank %d on %s: straggler, %.1f ms of its own work a step\n", rank.rank(), rank.node_id().c_str(),
                rank.compute_ms());
      }
    }
  }
  return out;
}

std::string FormatLogLines(const std::vector<v1::Event>& lines, LogFormat format) {
  std::string out;
  if (format == LogFormat::kJson) {
    for (const auto& line : lines) out += FormatJson(line, /*pretty=*/false) + "\n";
    return out;
  }
  std::vector<launcher::RankLine> ranked;
  for (const auto& line : lines) ranked.push_back({line.unix_ms(), line.rank(), line.message()});
  for (const auto& folded : launcher::FoldLogLines(ranked, kFoldWindowMs)) {
    // The coordinator's own lines (rank -1) mark where a new generation of the job begins.
    const std::string prefix = folded.ranks == std::vector<int>{-1} ? "----" : launcher::RankPrefix(folded.ranks);
    Appendf(&out, "%s %s\n", prefix.c_str(), TerminalSafe(folded.text).c_str());
  }
  return out;
}

std::string FormatFollowedEvent(const v1::Event& event, bool quiet) {
  std::string out;
  if (event.kind() == "log") {
    // Quiet keeps rank 0's step lines (loss, throughput); the coordinator's lines (rank -1) repeat
    // what its events say.
    const bool step_line = event.rank() == 0 && event.message().rfind("step ", 0) == 0;
    if (event.rank() >= 0 && (!quiet || step_line)) {
      Appendf(&out, "[rank %d] %s\n", event.rank(), TerminalSafe(event.message()).c_str());
    }
  } else if (event.kind() != "rank_started" || !quiet) {
    Appendf(&out, "ltrain: %s\n", TerminalSafe(event.message(), /*keep_newlines=*/true).c_str());
  }
  return out;
}

std::string FormatContinueHint(const v1::Job& job, const std::string& coordinator) {
  // A program under ltrain run has its recipe's entrypoint.command; its checkpoints are its own.
  const bool program = !ParseRecipe(job.recipe_yaml(), job.id()).recipe.entrypoint.command.empty();
  const std::string resume = "ltrain resume " + job.id() + (coordinator.empty() ? "" : " --coordinator " + coordinator);
  std::string from;
  if (program) {
    from = "starts the program again";
  } else if (job.last_committed_step() > 0) {
    from = "continues it from its checkpoint of step " + std::to_string(job.last_committed_step());
  } else {
    from = "starts it again from the start (it committed no checkpoint)";
  }
  return "ltrain: `" + resume + "` " + from + "; to have such failures restart it by themselves, " +
         (program ? "give `ltrain run` --max-restarts N" : "set fault.max_restarts in the recipe") + "\n";
}

}  // namespace ltrain::cli
