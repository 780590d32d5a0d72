// Reading a Slurm allocation from a fake environment and a fake node-list expander, and the layout
// it gives a recipe.
#include "common/slurm.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <map>

namespace ltrain {
namespace {

class SlurmAllocationTest : public ::testing::Test {
 protected:
  GetEnvFunction Env() {
    return [this](const char* name) {
      auto found = env_.find(name);
      return found == env_.end() ? std::string() : found->second;
    };
  }
  // Knows two lists; anything else is an error, as scontrol reports one.
  ExpandHostnamesFunction Expander() {
    return [this](const std::string& nodelist) -> StatusOr<std::vector<std::string>> {
      expanded_.push_back(nodelist);
      if (nodelist == "gpu[01-02]") return std::vector<std::string>{"gpu01", "gpu02"};
      if (nodelist == "n1") return std::vector<std::string>{"n1"};
      if (nodelist == "empty") return std::vector<std::string>{};
      return InvalidArgument("`scontrol show hostnames " + nodelist + "` failed: Invalid hostlist");
    };
  }
  StatusOr<SlurmAllocation> Read() { return ReadSlurmAllocation(Env(), Expander()); }

  std::map<std::string, std::string> env_ = {
      {"SLURM_JOB_ID", "4242"}, {"SLURM_JOB_NODELIST", "gpu[01-02]"}, {"SLURM_NNODES", "2"}};
  std::vector<std::string> expanded_;
};

TEST_F(SlurmAllocationTest, ReadsJobNodesAndHostsInSlurmOrder) {
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_TRUE(allocation.ok()) << allocation.status().ToString();
  EXPECT_EQ(allocation->job_id, "4242");
  EXPECT_EQ(allocation->hosts, (std::vector<std::string>{"gpu01", "gpu02"}));
  EXPECT_EQ(allocation->nodes, 2);
  EXPECT_EQ(allocation->gpus_per_node, 0);
  EXPECT_EQ(allocation->cpus_per_node, 0);
  EXPECT_EQ(expanded_, std::vector<std::string>{"gpu[01-02]"});
}

TEST_F(SlurmAllocationTest, OutsideAnAllocationSaysHowToGetOne) {
  env_.clear();
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_FALSE(allocation.ok());
  EXPECT_EQ(allocation.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(allocation.status().message(),
            "not inside a Slurm allocation: SLURM_JOB_ID is not set; run under sbatch or salloc");
  EXPECT_TRUE(expanded_.empty());
}

TEST_F(SlurmAllocationTest, MissingNodeListIsAnError) {
  env_.erase("SLURM_JOB_NODELIST");
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_FALSE(allocation.ok());
  EXPECT_NE(allocation.status().message().find("SLURM_JOB_NODELIST is not set"), std::string::npos)
      << allocation.status().message();
}

TEST_F(SlurmAllocationTest, OlderVariableNamesAreRead) {
  env_ = {{"SLURM_JOBID", "7"}, {"SLURM_NODELIST", "n1"}, {"SLURM_JOB_NUM_NODES", "1"}};
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_TRUE(allocation.ok()) << allocation.status().ToString();
  EXPECT_EQ(allocation->job_id, "7");
  EXPECT_EQ(allocation->hosts, std::vector<std::string>{"n1"});
}

TEST_F(SlurmAllocationTest, ExpanderFailureNamesTheVariable) {
  env_["SLURM_JOB_NODELIST"] = "gpu[01-";
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_FALSE(allocation.ok());
  EXPECT_EQ(allocation.status().message(),
            "SLURM_JOB_NODELIST=gpu[01- cannot be expanded: `scontrol show hostnames gpu[01-` failed: Invalid hostlist");
}

TEST_F(SlurmAllocationTest, EmptyExpansionIsAnError) {
  env_["SLURM_JOB_NODELIST"] = "empty";
  env_.erase("SLURM_NNODES");
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_FALSE(allocation.ok());
  EXPECT_EQ(allocation.status().message(), "SLURM_JOB_NODELIST=empty names no host");
}

TEST_F(SlurmAllocationTest, NodeCountMustMatchTheNodeList) {
  env_["SLURM_NNODES"] = "3";
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_FALSE(allocation.ok());
  EXPECT_EQ(allocation.status().message(),
            "SLURM_NNODES=3 disagrees with SLURM_JOB_NODELIST=gpu[01-02], which names 2 host(s)");
  env_["SLURM_NNODES"] = "two";
  allocation = Read();
  ASSERT_FALSE(allocation.ok());
  EXPECT_EQ(allocation.status().message(), "SLURM_NNODES=two: 'two' is not a non-negative integer");
}

TEST_F(SlurmAllocationTest, NodeCountDefaultsToTheHosts) {
  env_.erase("SLURM_NNODES");
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_TRUE(allocation.ok()) << allocation.status().ToString();
  EXPECT_EQ(allocation->nodes, 2);
}

TEST_F(SlurmAllocationTest, GpusPerNodeInEveryForm) {
  const std::vector<std::pair<std::string, int>> forms = {
      {"4", 4}, {"gpu:4", 4}, {"a100:8", 8}, {"gpu:a100:2,gpu:v100:2", 4}, {"gpu:4(IDX:0-3)", 4}, {"0", 0}};
  for (const auto& [value, gpus] : forms) {
    env_["SLURM_GPUS_PER_NODE"] = value;
    StatusOr<SlurmAllocation> allocation = Read();
    ASSERT_TRUE(allocation.ok()) << value << ": " << allocation.status().ToString();
    EXPECT_EQ(allocation->gpus_per_node, gpus) << value;
  }
}

TEST_F(SlurmAllocationTest, GpusOnNodeWinsOverWhatWasAsked) {
  env_["SLURM_GPUS_PER_NODE"] = "gpu:8";
  env_["SLURM_GPUS_ON_NODE"] = "4";
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_TRUE(allocation.ok()) << allocation.status().ToString();
  EXPECT_EQ(allocation->gpus_per_node, 4);
}

TEST_F(SlurmAllocationTest, BadGpuCountNamesTheVariable) {
  env_["SLURM_GPUS_ON_NODE"] = "gpu:many";
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_FALSE(allocation.ok());
  EXPECT_EQ(allocation.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(allocation.status().message(), "SLURM_GPUS_ON_NODE=gpu:many: 'many' is not a non-negative integer");
}

TEST_F(SlurmAllocationTest, CpusPerNode) {
  env_["SLURM_JOB_CPUS_PER_NODE"] = "72(x1),36";
  StatusOr<SlurmAllocation> allocation = Read();
  ASSERT_TRUE(allocation.ok()) << allocation.status().ToString();
  EXPECT_EQ(allocation->cpus_per_node, 36) << "the fewest any node has";
  env_["SLURM_CPUS_ON_NODE"] = "16";
  allocation = Read();
  ASSERT_TRUE(allocation.ok()) << allocation.status().ToString();
  EXPECT_EQ(allocation->cpus_per_node, 16);
}

TEST(ApplySlurmAllocationTest, CudaRunsOneProcessPerGpuOnEveryNode) {
  Recipe recipe;
  recipe.parallel.device = Device::kCuda;
  recipe.parallel.nodes = 1;
  recipe.parallel.nodes_min = 1;
  recipe.parallel.nodes_max = 4;
  SlurmAllocation allocation{"1", {"a", "b"}, 2, 4, 32};
  ApplySlurmAllocation(allocation, &recipe);
  EXPECT_EQ(recipe.parallel.nodes, 2);
  EXPECT_EQ(recipe.parallel.nodes_min, 2);
  EXPECT_EQ(recipe.parallel.nodes_max, 2);
  EXPECT_EQ(recipe.parallel.nproc_per_node, 4);
  EXPECT_EQ(recipe.parallel.world_size(), 8);
}

TEST(ApplySlurmAllocationTest, CpuOrUnknownGpusKeepTheRecipesProcessesPerNode) {
  Recipe cpu;
  cpu.parallel.nproc_per_node = 3;
  ApplySlurmAllocation(SlurmAllocation{"1", {"a", "b"}, 2, 4, 32}, &cpu);
  EXPECT_EQ(cpu.parallel.nodes, 2);
  EXPECT_EQ(cpu.parallel.nproc_per_node, 3);

  Recipe cuda;
  cuda.parallel.device = Device::kCuda;
  cuda.parallel.nproc_per_node = 2;
  ApplySlurmAllocation(SlurmAllocation{"1", {"a"}, 1, 0, 0}, &cuda);
  EXPECT_EQ(cuda.parallel.nproc_per_node, 2);
}

TEST(DescribeSlurmAllocationTest, OneLine) {
  EXPECT_EQ(DescribeSlurmAllocation(SlurmAllocation{"42", {"n1", "n2"}, 2, 4, 16}),
            "Slurm job 42: 2 node(s) n1, n2; 4 GPU(s) and 16 CPU(s) per node");
  EXPECT_EQ(DescribeSlurmAllocation(SlurmAllocation{"7", {"n1"}, 1, 0, 0}), "Slurm job 7: 1 node(s) n1");
}

// The real expander against Slurm's own scontrol, where it is installed. scontrol wants a
// configuration even to expand a list; a two-line one is enough and no daemon is asked.
TEST(ExpandHostnamesWithScontrolTest, ExpandsACompressedList) {
  ASSERT_EQ(system("command -v scontrol >/dev/null 2>&1"), 0)
      << "scontrol is not installed (deploy/setup.sh --tests installs Slurm)";
  char path[] = "/tmp/ltrain-slurm-conf-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  std::string conf = "ClusterName=unit\nSlurmctldHost=localhost\n";
  ASSERT_EQ(write(fd, conf.data(), conf.size()), static_cast<ssize_t>(conf.size()));
  close(fd);
  setenv("SLURM_CONF", path, 1);
  StatusOr<std::vector<std::string>> hosts = ExpandHostnamesWithScontrol("n[1-3],gpu7");
  ASSERT_TRUE(hosts.ok()) << hosts.status().ToString();
  EXPECT_EQ(*hosts, (std::vector<std::string>{"n1", "n2", "n3", "gpu7"}));
  EXPECT_FALSE(ExpandHostnamesWithScontrol("-x").ok());
  unsetenv("SLURM_CONF");
  unlink(path);
}

// A list without ranges needs no scontrol: ltrain in a container image without Slurm is given the list
// its host expanded (deploy/slurm/README.md, "In a container").
TEST(ExpandHostnamesWithScontrolTest, AListWithoutRangesIsItsNamesWithoutScontrol) {
  const char* path = std::getenv("PATH");
  const std::string saved = path ? path : "";
  setenv("PATH", "/nonexistent", 1);
  StatusOr<std::vector<std::string>> hosts = ExpandHostnamesWithScontrol("n1,n2,gpu7");
  setenv("PATH", saved.c_str(), 1);
  ASSERT_TRUE(hosts.ok()) << hosts.status().ToString();
  EXPECT_EQ(*hosts, (std::vector<std::string>{"n1", "n2", "gpu7"}));
}

}  // namespace
}  // namespace ltrain
