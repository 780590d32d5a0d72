// The Slurm allocation a command runs in, read from the environment sbatch/salloc/srun set, and
// the recipe layout it implies. Reading is pure: the environment and the expansion of a compressed
// node list ("n[1-3],gpu7") come in as functions, so tests pass fakes; ExpandHostnamesWithScontrol
// and EnvironmentVariable are the real ones.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain {

struct SlurmAllocation {
  std::string job_id;              // SLURM_JOB_ID
  std::vector<std::string> hosts;  // SLURM_JOB_NODELIST expanded, in Slurm's order; hosts[0] runs the batch script
  int nodes = 0;                   // SLURM_NNODES (checked against hosts)
  int gpus_per_node = 0;           // SLURM_GPUS_ON_NODE or SLURM_GPUS_PER_NODE; 0 when none or unknown
  int cpus_per_node = 0;           // SLURM_CPUS_ON_NODE or SLURM_JOB_CPUS_PER_NODE; 0 when unknown
};

// Returns the value of an environment variable, "" when unset.
using GetEnvFunction = std::function<std::string(const char* name)>;
// Expands a compressed Slurm node list into host names.
using ExpandHostnamesFunction = std::function<StatusOr<std::vector<std::string>>(const std::string& nodelist)>;

// Reads the allocation. FailedPrecondition outside an allocation (no SLURM_JOB_ID), InvalidArgument
// for a variable that does not parse or disagrees with another; every message names the variable.
StatusOr<SlurmAllocation> ReadSlurmAllocation(const GetEnvFunction& getenv,
                                              const ExpandHostnamesFunction& expand_hostnames);

// The real expander: runs `scontrol show hostnames NODELIST` (no shell) and returns its lines.
StatusOr<std::vector<std::string>> ExpandHostnamesWithScontrol(const std::string& nodelist);

// std::getenv as a GetEnvFunction.
std::string EnvironmentVariable(const char* name);

// Sets the job's nodes to the allocation's (a fixed size: min = max = nodes) and, on cuda with a
// known GPU count, one process per GPU; otherwise nproc_per_node stays as the recipe has it.
// The caller validates the result again (tp and pp must still divide the world size).
void ApplySlurmAllocation(const SlurmAllocation& allocation, Recipe* recipe);

// One line for the user: "Slurm job 42: 2 node(s) n1, n2; 4 GPU(s) and 16 CPU(s) per node".
std::string DescribeSlurmAllocation(const SlurmAllocation& allocation);

}  // namespace ltrain
