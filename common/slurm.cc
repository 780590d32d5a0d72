#include "common/slurm.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/strings.h"

extern char** environ;

namespace ltrain {
namespace {

// A non-negative decimal count; `name` and `value` go into the error.
StatusOr<int> ParseCount(const char* name, const std::string& value, const std::string& text) {
  if (text.empty() || text.size() > 9 || !std::all_of(text.begin(), text.end(), ::isdigit)) {
    return InvalidArgument(std::string(name) + "=" + value + ": '" + text + "' is not a non-negative integer");
  }
  return std::stoi(text);
}

// "4", "gpu:4", "a100:4", "gpu:a100:2,gpu:v100:2" (summed), "gpu:4(IDX:0-3)".
StatusOr<int> ParseGpuCount(const char* name, const std::string& value) {
  int total = 0;
  for (std::string entry : Split(value, ',')) {
    entry = entry.substr(0, entry.find('('));
    LTRAIN_ASSIGN_OR_RETURN(int count, ParseCount(name, value, entry.substr(entry.rfind(':') + 1)));
    total += count;
  }
  return total;
}

// "72(x2),36": the fewest CPUs any node of the allocation has.
StatusOr<int> ParseCpusPerNode(const char* name, const std::string& value) {
  int fewest = 0;
  for (const std::string& entry : Split(value, ',')) {
    LTRAIN_ASSIGN_OR_RETURN(int count, ParseCount(name, value, entry.substr(0, entry.find('('))));
    fewest = fewest == 0 ? count : std::min(fewest, count);
  }
  return fewest;
}

// The first of `names` that is set, with its name; {nullptr, ""} when none is.
std::pair<const char*, std::string> FirstSet(const GetEnvFunction& getenv, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    std::string value = getenv(name);
    if (!value.empty()) return {name, value};
  }
  return {nullptr, ""};
}

}  // namespace

StatusOr<SlurmAllocation> ReadSlurmAllocation(const GetEnvFunction& getenv,
                                              const ExpandHostnamesFunction& expand_hostnames) {
  SlurmAllocation allocation;
  allocation.job_id = FirstSet(getenv, {"SLURM_JOB_ID", "SLURM_JOBID"}).second;
  if (allocation.job_id.empty()) {
    return FailedPrecondition("not inside a Slurm allocation: SLURM_JOB_ID is not set; run under sbatch or salloc");
  }
  auto [nodelist_name, nodelist] = FirstSet(getenv, {"SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  if (nodelist.empty()) {
    return FailedPrecondition("Slurm job " + allocation.job_id +
                              ": SLURM_JOB_NODELIST is not set; run under sbatch or salloc, not a bare srun step");
  }
  StatusOr<std::vector<std::string>> hosts = expand_hostnames(nodelist);
  if (!hosts.ok()) {
    return Status(hosts.status().code(),
                  std::string(nodelist_name) + "=" + nodelist + " cannot be expanded: " + hosts.status().message());
  }
  if (hosts->empty()) return InvalidArgument(std::string(nodelist_name) + "=" + nodelist + " names no host");
  allocation.hosts = std::move(hosts).value();
  allocation.nodes = static_cast<int>(allocation.hosts.size());

  auto [nodes_name, nodes_value] = FirstSet(getenv, {"SLURM_JOB_NUM_NODES", "SLURM_NNODES"});
  if (nodes_name != nullptr) {
    LTRAIN_ASSIGN_OR_RETURN(int nodes, ParseCount(nodes_name, nodes_value, nodes_value));
    if (nodes != allocation.nodes) {
      return InvalidArgument(std::string(nodes_name) + "=" + nodes_value + " disagrees with " + nodelist_name + "=" +
                             nodelist + ", which names " + std::to_string(allocation.nodes) + " host(s)");
    }
  }

  // SLURM_GPUS_ON_NODE is what this node was given; SLURM_GPUS_PER_NODE is what --gpus-per-node asked.
  auto [gpus_name, gpus_value] = FirstSet(getenv, {"SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"});
  if (gpus_name != nullptr) {
    LTRAIN_ASSIGN_OR_RETURN(int gpus, ParseGpuCount(gpus_name, gpus_value));
    allocation.gpus_per_node = gpus;
  }

  std::string cpus_on_node = getenv("SLURM_CPUS_ON_NODE");
  std::string cpus_per_node = getenv("SLURM_JOB_CPUS_PER_NODE");
  if (!cpus_on_node.empty()) {
    LTRAIN_ASSIGN_OR_RETURN(int cpus, ParseCount("SLURM_CPUS_ON_NODE", cpus_on_node, cpus_on_node));
    allocation.cpus_per_node = cpus;
  } else if (!cpus_per_node.empty()) {
    LTRAIN_ASSIGN_OR_RETURN(int cpus, ParseCpusPerNode("SLURM_JOB_CPUS_PER_NODE", cpus_per_node));
    allocation.cpus_per_node = cpus;
  }
  return allocation;
}

StatusOr<std::vector<std::string>> ExpandHostnamesWithScontrol(const std::string& nodelist) {
  if (nodelist.empty() || nodelist[0] == '-') return InvalidArgument("'" + nodelist + "' is not a node list");
  // A list without ranges is its names: no scontrol needed (ltrain in a container image that has no
  // Slurm, given the list its host expanded).
  if (nodelist.find('[') == std::string::npos) return SplitNonEmpty(nodelist, ',');
  int fds[2];
  if (pipe(fds) != 0) return Internal(std::string("pipe: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  std::string program = "scontrol", show = "show", hostnames = "hostnames", list = nodelist;
  char* argv[] = {program.data(), show.data(), hostnames.data(), list.data(), nullptr};
  pid_t pid = -1;
  int spawned = posix_spawnp(&pid, "scontrol", &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (spawned != 0) {
    close(fds[0]);
    return Unavailable(std::string("cannot run scontrol: ") + std::strerror(spawned) +
                       "; is Slurm's client (package slurm-client) installed and on PATH?");
  }
  std::string output;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    output.append(buffer, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  while (!output.empty() && output.back() == '\n') output.pop_back();
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return InvalidArgument("`scontrol show hostnames " + nodelist + "` failed: " + output);
  }
  return SplitNonEmpty(output, '\n');
}

std::string EnvironmentVariable(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

void ApplySlurmAllocation(const SlurmAllocation& allocation, Recipe* recipe) {
  recipe->parallel.nodes = allocation.nodes;
  recipe->parallel.nodes_min = allocation.nodes;
  recipe->parallel.nodes_max = allocation.nodes;
  if (recipe->parallel.device == Device::kCuda && allocation.gpus_per_node > 0) {
    recipe->parallel.nproc_per_node = allocation.gpus_per_node;
  }
}

std::string DescribeSlurmAllocation(const SlurmAllocation& allocation) {
  std::string text = "Slurm job " + allocation.job_id + ": " + std::to_string(allocation.nodes) + " node(s) ";
  for (size_t i = 0; i < allocation.hosts.size(); ++i) text += (i ? ", " : "") + allocation.hosts[i];
  std::vector<std::string> per_node;
  if (allocation.gpus_per_node > 0) per_node.push_back(std::to_string(allocation.gpus_per_node) + " GPU(s)");
  if (allocation.cpus_per_node > 0) per_node.push_back(std::to_string(allocation.cpus_per_node) + " CPU(s)");
  if (!per_node.empty()) {
    text += "; " + per_node[0] + (per_node.size() > 1 ? " and " + per_node[1] : "") + " per node";
  }
  return text;
}

}  // namespace ltrain
