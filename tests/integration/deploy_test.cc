// The deployment files, exercised: the systemd units of deploy/systemd pass `systemd-analyze
// verify`, and the command lines of the systemd units and of the Kubernetes manifests of deploy/k8s,
// with their paths moved into a temporary directory, start a coordinator and an agent that
// register with each other over TLS with a bearer token. The manifests hold the objects the README
// promises (state on a PersistentVolumeClaim, a Service in front of the coordinator, agents that
// request GPUs).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

class DeployTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(RunProcess({LtrainBinary(), "coordinator", "--init-tls", dir_.Join("tls")}).exit_code, 0);
  }

  // The daemons' paths, moved under the test's directory.
  std::string Path(const std::string& token) const {
    const std::string tls = "/etc/ltrain/tls/";
    if (token.rfind(tls, 0) == 0) return dir_.Join("tls/" + token.substr(tls.size()));
    if (token == "/var/lib/ltrain") return dir_.Join("state");
    if (token == "/var/lib/ltrain-agent") return dir_.Join("agent");
    return token;
  }

  // Starts the coordinator with `args` (listening on a free loopback port) and then the agent with
  // `agent_args` (`coordinator_address` replaced by where the coordinator listens); true once the
  // agent says it registered.
  void RunPair(std::vector<std::string> args, std::vector<std::string> agent_args, const std::string& coordinator_address) {
    for (size_t i = 0; i + 1 < args.size(); ++i) {
      if (args[i] == "--listen") args[i + 1] = "127.0.0.1:0";
    }
    const std::string port_file = dir_.Join("port");
    fs::remove(port_file);
    args.insert(args.begin(), LtrainBinary());
    args.insert(args.end(), {"--port-file", port_file});
    Subprocess coordinator(args);
    const int port = WaitForPortFile(port_file);
    ASSERT_GT(port, 0) << coordinator.Output();
    for (std::string& a : agent_args) {
      if (a == coordinator_address) a = "127.0.0.1:" + std::to_string(port);
    }
    agent_args.insert(agent_args.begin(), LtrainBinary());
    Subprocess agent(agent_args);
    EXPECT_TRUE(agent.WaitForOutput(" registered with 127.0.0.1:" + std::to_string(port), seconds(20)))
        << "agent:\n" << agent.Output() << "\ncoordinator:\n" << coordinator.Output();
    agent.Signal(SIGTERM);
    agent.Wait(seconds(15));
    coordinator.Signal(SIGTERM);
    coordinator.Wait(seconds(15));
  }

  TempDir dir_;
};

// KEY=VALUE lines of an environment file.
std::map<std::string, std::string> ReadEnvFile(const std::string& path) {
  std::map<std::string, std::string> env;
  std::istringstream in(ReadFile(path));
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find('=');
    if (line.empty() || line[0] == '#' || eq == std::string::npos) continue;
    env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

// The ExecStart= command of a unit (continuation lines joined), split into words, ${VAR}s expanded.
std::vector<std::string> ExecStart(const std::string& unit, const std::map<std::string, std::string>& env) {
  std::istringstream in(ReadFile(unit));
  std::string command;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (!inside && line.rfind("ExecStart=", 0) != 0) continue;
    if (!inside) line = line.substr(std::string("ExecStart=").size());
    inside = !line.empty() && line.back() == '\\';
    command += " " + (inside ? line.substr(0, line.size() - 1) : line);
    if (!inside) break;
  }
  std::vector<std::string> words;
  std::istringstream split(command);
  for (std::string w; split >> w;) {
    if (w.size() > 3 && w.rfind("${", 0) == 0 && w.back() == '}') {
      auto it = env.find(w.substr(2, w.size() - 3));
      EXPECT_NE(it, env.end()) << unit << ": " << w << " is not set in ltrain.env";
      if (it != env.end()) w = it->second;
    }
    words.push_back(w);
  }
  return words;
}

// The full path of `program` on $PATH, or "".
std::string Which(const std::string& program) {
  std::istringstream path(std::getenv("PATH") != nullptr ? std::getenv("PATH") : "/usr/bin:/bin");
  for (std::string dir; std::getline(path, dir, ':');) {
    const std::string candidate = dir + "/" + program;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

TEST_F(DeployTest, SystemdUnitsVerifyAndTheirCommandsRegisterAnAgent) {
  const std::string analyze = Which("systemd-analyze");
  ASSERT_FALSE(analyze.empty()) << "systemd-analyze is not installed (deploy/setup.sh --tests installs it)";
  const std::string units = SourceDir() + "/deploy/systemd";
  // verify wants the ExecStart binary to exist: the unit as installed, with the built binary.
  for (const std::string name : {"ltrain-coordinator.service", "ltrain-agent.service"}) {
    std::string text = ReadFile(units + "/" + name);
    const std::string installed = "/usr/local/bin/ltrain";
    for (size_t at; (at = text.find(installed)) != std::string::npos;) text.replace(at, installed.size(), LtrainBinary());
    const std::string copy = dir_.Write(name, text);
    ProcessResult verify = RunProcess({analyze, "verify", copy});
    EXPECT_EQ(verify.exit_code, 0) << name << ":\n" << verify.output;
  }

  std::map<std::string, std::string> env = ReadEnvFile(units + "/ltrain.env");
  env["LTRAIN_BIND_ADDRESS"] = "127.0.0.1";
  std::vector<std::string> coordinator = ExecStart(units + "/ltrain-coordinator.service", env);
  std::vector<std::string> agent = ExecStart(units + "/ltrain-agent.service", env);
  ASSERT_GE(coordinator.size(), 2u);
  ASSERT_GE(agent.size(), 2u);
  EXPECT_EQ(coordinator[0], "/usr/local/bin/ltrain");
  EXPECT_EQ(coordinator[1], "coordinator");
  EXPECT_EQ(agent[1], "agent");
  coordinator.erase(coordinator.begin());
  agent.erase(agent.begin());
  for (std::string& w : coordinator) w = Path(w);
  for (std::string& w : agent) w = Path(w);
  RunPair(coordinator, agent, env["LTRAIN_COORDINATOR"]);
}

TEST_F(DeployTest, KubernetesManifestsHoldTheirObjectsAndTheirCommandsRegisterAnAgent) {
  const std::string k8s = SourceDir() + "/deploy/k8s";
  std::map<std::string, YAML::Node> objects;
  for (const std::string file : {"coordinator.yaml", "agent.yaml"}) {
    for (const YAML::Node& doc : YAML::LoadAllFromFile(k8s + "/" + file)) {
      objects[doc["kind"].as<std::string>() + "/" + doc["metadata"]["name"].as<std::string>()] = doc;
    }
  }
  ASSERT_TRUE(objects.count("PersistentVolumeClaim/ltrain-state"));
  ASSERT_TRUE(objects.count("Deployment/ltrain-coordinator"));
  ASSERT_TRUE(objects.count("Service/ltrain-coordinator"));
  ASSERT_TRUE(objects.count("DaemonSet/ltrain-agent"));

  const YAML::Node pod = objects["Deployment/ltrain-coordinator"]["spec"]["template"]["spec"];
  const YAML::Node container = pod["containers"][0];
  // The state directory is the claim's volume; the Service sends its port to the container's.
  std::string state_volume;
  for (const YAML::Node& v : pod["volumes"]) {
    if (v["persistentVolumeClaim"]) {
      EXPECT_EQ(v["persistentVolumeClaim"]["claimName"].as<std::string>(), "ltrain-state");
      state_volume = v["name"].as<std::string>();
    }
  }
  std::vector<std::string> coordinator = container["args"].as<std::vector<std::string>>();
  std::string state_dir;
  for (size_t i = 0; i + 1 < coordinator.size(); ++i) {
    if (coordinator[i] == "--state-dir") state_dir = coordinator[i + 1];
  }
  bool state_mounted = false;
  for (const YAML::Node& m : container["volumeMounts"]) {
    state_mounted = state_mounted || (m["name"].as<std::string>() == state_volume && m["mountPath"].as<std::string>() == state_dir);
  }
  EXPECT_TRUE(state_mounted) << "--state-dir " << state_dir << " is not the claim's mount";
  EXPECT_EQ(objects["Service/ltrain-coordinator"]["spec"]["ports"][0]["targetPort"].as<int>(),
            container["ports"][0]["containerPort"].as<int>());

  const YAML::Node agent_container = objects["DaemonSet/ltrain-agent"]["spec"]["template"]["spec"]["containers"][0];
  EXPECT_GT(agent_container["resources"]["limits"]["nvidia.com/gpu"].as<int>(), 0);
  std::vector<std::string> agent = agent_container["args"].as<std::vector<std::string>>();
  ASSERT_FALSE(coordinator.empty());
  ASSERT_FALSE(agent.empty());
  EXPECT_EQ(coordinator[0], "coordinator");
  EXPECT_EQ(agent[0], "agent");

  // $(VAR) is Kubernetes' expansion of the container's environment (here: the node's name and address).
  std::string service_address;
  for (size_t i = 0; i + 1 < agent.size(); ++i) {
    if (agent[i] == "--coordinator") service_address = agent[i + 1];
  }
  for (std::string& w : coordinator) w = Path(w);
  for (std::string& w : agent) {
    if (w == "$(NODE_NAME)") w = "node-a";
    if (w == "$(NODE_IP)") w = "127.0.0.1";
    w = Path(w);
  }
  RunPair(coordinator, agent, service_address);
}

}  // namespace
}  // namespace ltrain::testing
