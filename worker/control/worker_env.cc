#include "worker/control/worker_env.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <stdexcept>

namespace ltrain::worker {

EnvLookup ProcessEnvironment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

EnvLookup EnvironmentOf(const std::vector<std::string>& entries) {
  std::map<std::string, std::string> values;
  for (const std::string& entry : entries) {
    const size_t eq = entry.find('=');
    if (eq != std::string::npos) values[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return [values](const std::string& name) -> std::optional<std::string> {
    auto it = values.find(name);
    if (it == values.end()) return std::nullopt;
    return it->second;
  };
}

namespace {

std::string Get(const EnvLookup& env, const char* name, const std::string& fallback = "") {
  std::optional<std::string> v = env(name);
  return v && !v->empty() ? *v : fallback;
}

}  // namespace

std::string EnvString(const char* name, const std::string& fallback) { return Get(ProcessEnvironment(), name, fallback); }

namespace {

template <typename Int>
Status ParseEnvInt(const EnvLookup& env, const char* name, Int* out) {
  std::string v = Get(env, name);
  if (v.empty()) return Status::Ok();
  try {
    size_t used = 0;
    const long long parsed = std::stoll(v, &used);
    if (used != v.size() || parsed < std::numeric_limits<Int>::min() || parsed > std::numeric_limits<Int>::max()) {
      throw std::invalid_argument(v);
    }
    *out = static_cast<Int>(parsed);
  } catch (const std::exception&) {
    return InvalidArgument(std::string(name) + "='" + v + "' is not an integer");
  }
  return Status::Ok();
}

}  // namespace

Status EnvInt(const EnvLookup& env, const char* name, int* out) { return ParseEnvInt(env, name, out); }
Status EnvInt(const EnvLookup& env, const char* name, int64_t* out) { return ParseEnvInt(env, name, out); }

Status EnvSwitch(const EnvLookup& env, const char* name, int* out) {
  const std::string v = Get(env, name);
  if (v.empty()) return Status::Ok();
  if (v != "0" && v != "1") return InvalidArgument(std::string(name) + "='" + v + "': expected 0 or 1");
  *out = v == "1" ? 1 : 0;
  return Status::Ok();
}

std::string ProfileWindow::PathFor(int rank) const {
  std::string out = path;
  for (size_t at = out.find("{rank}"); at != std::string::npos; at = out.find("{rank}", at)) {
    out.replace(at, 6, std::to_string(rank));
  }
  return out;
}

StatusOr<ProfileWindow> ParseProfileWindow(const std::string& value, const std::string& ranks) {
  auto bad = [&] {
    return InvalidArgument("LTRAIN_PROFILE=" + value +
                           ": expected STEP[:PATH] or FIRST-LAST[:PATH] (1-based steps), e.g. LTRAIN_PROFILE=10 (every "
                           "rank, profile-rank-N.json in the job's directory), LTRAIN_PROFILE=10:/tmp/step10.json "
                           "(rank 0) or LTRAIN_PROFILE=10-12:/tmp/steps10-12-rank{rank}.json (every rank)");
  };
  const size_t colon = value.find(':');
  if (colon + 1 == value.size()) return bad();
  const std::string steps = value.substr(0, colon);
  const size_t dash = steps.find('-');
  // Digits only (no sign, no space), at most `digits` of them, at least `min`.
  auto number = [](const std::string& text, int64_t* out, size_t digits = 15, int64_t min = 1) {
    if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos || text.size() > digits) return false;
    *out = std::stoll(text);
    return *out >= min;
  };
  ProfileWindow window;
  window.path = colon == std::string::npos ? "profile-rank-{rank}.json" : value.substr(colon + 1);
  if (!number(steps.substr(0, dash), &window.first)) return bad();
  window.last = window.first;
  if (dash != std::string::npos && !number(steps.substr(dash + 1), &window.last)) return bad();
  if (window.last < window.first) {
    return InvalidArgument("LTRAIN_PROFILE=" + value + ": the last step " + std::to_string(window.last) +
                           " comes before the first " + std::to_string(window.first));
  }
  const bool per_rank = window.path.find("{rank}") != std::string::npos;
  if (ranks.empty()) {
    if (!per_rank) window.ranks = std::set<int>{0};
    return window;
  }
  if (ranks != "all") {
    // "0,4-7"
    std::set<int> chosen;
    size_t at = 0;
    while (at <= ranks.size()) {
      const size_t comma = std::min(ranks.find(',', at), ranks.size());
      const std::string item = ranks.substr(at, comma - at);
      const size_t range = item.find('-');
      int64_t low = 0, high = 0;
      if (!number(item.substr(0, range), &low, 9, 0) ||
          (range != std::string::npos && !number(item.substr(range + 1), &high, 9, 0))) {
        return InvalidArgument("LTRAIN_PROFILE_RANKS=" + ranks + ": expected all, or ranks and ranges such as 0,4-7");
      }
      if (range == std::string::npos) high = low;
      if (high < low || high - low > 1'000'000) {
        return InvalidArgument("LTRAIN_PROFILE_RANKS=" + ranks + ": the range " + item + " is empty or too large");
      }
      for (int64_t r = low; r <= high; ++r) chosen.insert(static_cast<int>(r));
      at = comma + 1;
    }
    window.ranks = std::move(chosen);
  }
  if (!per_rank && (!window.ranks || window.ranks->size() > 1)) {
    return InvalidArgument("LTRAIN_PROFILE=" + value + " with LTRAIN_PROFILE_RANKS=" + ranks +
                           ": several ranks would write the same file; put {rank} in the path (" + window.path +
                           ")");
  }
  return window;
}

StatusOr<WorkerEnv> ParseWorkerEnv(const EnvLookup& environment, const std::vector<std::string>& args) {
  WorkerEnv env;
  env.job_id = Get(environment, "LTRAIN_JOB_ID");
  for (auto [name, field] : {std::pair{"LTRAIN_RANK", &env.rank}, {"LTRAIN_WORLD_SIZE", &env.world_size},
                             {"LTRAIN_LOCAL_RANK", &env.local_rank},
                             {"LTRAIN_LOCAL_WORLD_SIZE", &env.local_world_size},
                             {"LTRAIN_GENERATION", &env.generation}, {"LTRAIN_EPOCH", &env.epoch}}) {
    LTRAIN_RETURN_IF_ERROR(EnvInt(environment, name, field));
  }
  LTRAIN_RETURN_IF_ERROR(EnvInt(environment, "LTRAIN_COMMITTED_STEP", &env.committed_step));
  env.recipe_file = Get(environment, "LTRAIN_RECIPE_FILE");
  env.rdzv = Get(environment, "LTRAIN_RDZV");
  env.rdzv_scope = Get(environment, "LTRAIN_RDZV_SCOPE", env.job_id.empty() ? "manual" : env.job_id);
  env.checkpoint_dir = Get(environment, "LTRAIN_CHECKPOINT_DIR");
  env.agent = Get(environment, "LTRAIN_AGENT");
  if (const std::string secret_file = Get(environment, "LTRAIN_AGENT_SECRET_FILE"); !secret_file.empty()) {
    std::ifstream in(secret_file);
    if (!(in >> env.agent_secret)) {
      return InvalidArgument("LTRAIN_AGENT_SECRET_FILE=" + secret_file + " cannot be read: the agent refuses a worker without it");
    }
  }
  env.bind_addr = Get(environment, "LTRAIN_BIND_ADDR", "127.0.0.1");
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    auto value = [&](const std::string& flag) -> StatusOr<std::string> {
      if (arg.size() > flag.size() && arg.compare(0, flag.size() + 1, flag + "=") == 0) {
        return arg.substr(flag.size() + 1);
      }
      if (i + 1 >= args.size()) return InvalidArgument(flag + " needs a value");
      return args[++i];
    };
    if (arg == "--help" || arg == "-h") {
      env.help = true;
    } else if (arg == "--recipe" || arg.rfind("--recipe=", 0) == 0) {
      LTRAIN_ASSIGN_OR_RETURN(std::string v, value("--recipe"));
      env.recipe_file = v;
    } else if (arg == "--export-params" || arg.rfind("--export-params=", 0) == 0) {
      LTRAIN_ASSIGN_OR_RETURN(std::string v, value("--export-params"));
      env.export_params = v;
    } else if (arg == "--set" || arg.rfind("--set=", 0) == 0) {
      LTRAIN_ASSIGN_OR_RETURN(std::string v, value("--set"));
      if (v.find('=') == std::string::npos) return InvalidArgument("--set " + v + ": expected key=value");
      env.overrides.push_back(v);
    } else {
      return InvalidArgument("unknown argument '" + arg + "' (see --help)");
    }
  }
  return env;
}

StatusOr<Recipe> LoadWorkerRecipe(const WorkerEnv& env) {
  if (env.recipe_file.empty()) return InvalidArgument("no recipe: pass --recipe FILE or set LTRAIN_RECIPE_FILE");
  RecipeParseResult parsed = LoadRecipeFile(env.recipe_file, env.overrides);
  if (!parsed.ok()) return InvalidArgument(parsed.ErrorText());
  return parsed.recipe;
}

Status AdoptStandbyInput(const std::string& input) {
  const std::string directory = input.substr(0, input.find('\0'));
  if (::chdir(directory.c_str()) != 0) {
    return Unavailable("cannot enter " + directory + ": " + std::strerror(errno));
  }
  ::clearenv();
  for (size_t begin = directory.size() + 1; begin < input.size();) {
    size_t end = input.find('\0', begin);
    if (end == std::string::npos) end = input.size();
    const std::string entry = input.substr(begin, end - begin);
    const size_t eq = entry.find('=');
    if (eq != std::string::npos && eq > 0) ::setenv(entry.substr(0, eq).c_str(), entry.substr(eq + 1).c_str(), 1);
    begin = end + 1;
  }
  return Status::Ok();
}

}  // namespace ltrain::worker
