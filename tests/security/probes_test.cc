// The security suite (label `security`): what another local user, `nobody` (through setpriv), can do
// to real ltrain processes of root's, on loopback. Each attack that once worked is tried again and must
// fail: commands through a coordinator started without a token, a token read from a launch's output,
// state read from files, a dashboard starved by slow connections, MASTER_PORT taken before rank 0
// binds it, an ended job's secret, rendezvous values without bound, writes through planted links, a
// process that leaves its job, a token in an address, the health service without a token. Then every
// bad input of the issue exits 2 with nothing changed on disk.
//
// The victim's files are under a folder others may traverse (0755), written with umask 022: only the
// modes ltrain gives them keep them private. The binaries are copied where nobody may run them.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "tests/support/etcd_cluster.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

constexpr uid_t kNobody = 65534;
constexpr int kRefused = 10;  // security_probe: the attempt was refused

class SecurityProbesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::geteuid(), 0u) << "the security suite runs its attacks as a second local user (nobody, through "
                                  "setpriv), which needs root: run ctest -L security as root";
    ASSERT_EQ(::access("/usr/bin/setpriv", X_OK), 0) << "setpriv is missing (Debian's util-linux)";
    ::umask(022);
    fs::permissions(dir_.path(), fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                     fs::perms::others_read | fs::perms::others_exec);
    fs::create_directories(Bin(""));
    for (const char* name : {"ltrain", "ltrain-worker", "ltrain-exec"}) {
      fs::copy_file(fs::path(LtrainBinary()).parent_path() / name, Bin(name));
    }
    fs::copy_file(SECURITY_PROBE, Bin("security_probe"));
    for (const auto& entry : fs::directory_iterator(Bin(""))) ::chmod(entry.path().c_str(), 0755);
    fs::create_directories(Nobody(""));
    ASSERT_EQ(::chown(Nobody("").c_str(), kNobody, kNobody), 0);
  }

  std::string Bin(const std::string& name) const { return dir_.Join("bin/" + name); }
  std::string Victim(const std::string& name) const { return dir_.Join("home/" + name); }
  std::string Nobody(const std::string& name) const { return dir_.Join("nobody/" + name); }
  std::map<std::string, std::string> VictimEnv() const {
    return {{"LTRAIN_HOME", dir_.Join("home")}, {"OMP_NUM_THREADS", "1"}};
  }

  // `argv` as nobody, with a home of its own and nothing of root's environment that matters.
  static std::vector<std::string> AsNobody(std::vector<std::string> argv) {
    argv.insert(argv.begin(), {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               "--inh-caps=-all", "--"});
    return argv;
  }
  std::map<std::string, std::string> NobodyEnv() const {
    return {{"HOME", Nobody("")}, {"LTRAIN_HOME", Nobody("ltrain")}, {"LTRAIN_TOKEN", ""},
            {"LTRAIN_TOKEN_FILE", ""}, {"OMP_NUM_THREADS", "1"}};
  }
  ProcessResult Attack(const std::vector<std::string>& argv, seconds timeout = seconds(60)) const {
    return RunProcess(AsNobody(argv), NobodyEnv(), timeout);
  }
  // A file nobody writes in its own folder.
  std::string NobodyWrites(const std::string& name, const std::string& text) const {
    const std::string path = Nobody(name);
    std::ofstream(path) << text;
    EXPECT_EQ(::chown(path.c_str(), kNobody, kNobody), 0);
    return path;
  }

  // A coordinator of root's on loopback with `extra` flags; its address.
  std::string StartCoordinator(std::unique_ptr<Subprocess>& process, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {Bin("ltrain"), "coordinator", "--listen", "127.0.0.1:0", "--port-file",
                                     dir_.Join("port"), "--state-dir", dir_.Join("home")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    process = std::make_unique<Subprocess>(argv, VictimEnv());
    const int port = WaitForPortFile(dir_.Join("port"));
    EXPECT_GT(port, 0) << process->Output();
    return "127.0.0.1:" + std::to_string(port);
  }

  std::string PrepareData() {
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    EXPECT_EQ(prepared.exit_code, 0) << prepared.output;
    return dir_.Join("data");
  }

  TempDir dir_;
};

// 1. A coordinator started without --token-file requires the token it made (0600, never printed): nobody
// submits nothing (its program would have run as root), reads no token, and gets no health answer.
TEST_F(SecurityProbesTest, ACoordinatorStartedWithoutATokenRunsNothingForAnotherUser) {
  std::unique_ptr<Subprocess> coordinator;
  const std::string address = StartCoordinator(coordinator);
  Subprocess agent({Bin("ltrain"), "agent", "--coordinator", address, "--node-id", "n1", "--work-dir",
                    dir_.Join("agent")},
                   VictimEnv());
  ASSERT_TRUE(agent.WaitForOutput("registered with", seconds(20))) << agent.Output();
  const std::string pwned = Nobody("pwned.txt");
  const std::string evil = NobodyWrites("evil.yaml", "name: evil\nentrypoint: {command: [/bin/sh, -c, \"id > " + pwned +
                                                         "\"]}\n");
  ProcessResult submitted = Attack({Bin("ltrain"), "launch", "--coordinator", address, evil});
  EXPECT_EQ(submitted.exit_code, 3) << submitted.output;
  EXPECT_NE(submitted.output.find("requires a bearer token"), std::string::npos) << submitted.output;
  ProcessResult stolen = Attack({Bin("ltrain"), "launch", "--coordinator", address, evil, "--token-file",
                                 Victim("token")});
  EXPECT_EQ(stolen.exit_code, 2) << stolen.output;
  EXPECT_NE(Attack({"/bin/cat", Victim("token")}).exit_code, 0) << "the token file is its owner's alone";
  EXPECT_EQ(Attack({Bin("security_probe"), "health", address}).exit_code, kRefused);
  EXPECT_EQ(Attack({Bin("security_probe"), "list", address, "0123456789abcdef0123456789abcdef01234567"}).exit_code,
            kRefused);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_FALSE(fs::exists(pwned)) << ReadFile(pwned);
  ProcessResult jobs = RunProcess({Bin("ltrain"), "list", "--coordinator", address}, VictimEnv());
  EXPECT_EQ(jobs.exit_code, 0) << jobs.output;
  EXPECT_EQ(jobs.output.find("evil"), std::string::npos) << jobs.output;
  EXPECT_NE(coordinator->Output().find("clients need the token in " + Victim("token")), std::string::npos);
}

// 2. A standalone launch's output (a log file others may read, as a Slurm output file is) holds no
// token: nothing in it opens the control plane or the dashboard's data, and its login link works once.
TEST_F(SecurityProbesTest, NothingInALaunchsOutputOpensTheControlPlane) {
  const std::string data = PrepareData();
  const std::string recipe = dir_.Write("long.yaml", TinyRecipe("long", data) + "training: {steps: 100000}\n");
  Subprocess launch({Bin("ltrain"), "launch", recipe, "--http-listen", "127.0.0.1:0"}, VictimEnv());
  ASSERT_TRUE(launch.WaitForOutput("/metrics with the read-only token of", seconds(60))) << launch.Output();
  const std::string output = launch.Output();
  const std::string log = dir_.Write("launch.log", output);
  ::chmod(log.c_str(), 0644);
  std::smatch address, http;
  ASSERT_TRUE(std::regex_search(output, address, std::regex(R"(local coordinator at (127\.0\.0\.1:\d+))"))) << output;
  ASSERT_TRUE(std::regex_search(output, http, std::regex(R"(http://127\.0\.0\.1:(\d+)(/login\?code=\w+))"))) << output;
  ProcessResult read = Attack({"/bin/cat", log});
  ASSERT_EQ(read.exit_code, 0) << read.output;
  // Whatever looks like a secret in it, tried as the control plane's token and the HTTP side's.
  const std::regex secret("[0-9a-f]{32,}");
  int tried = 0;
  for (std::sregex_iterator it(read.output.begin(), read.output.end(), secret), end; it != end; ++it, ++tried) {
    EXPECT_EQ(Attack({Bin("security_probe"), "list", address[1], it->str()}).exit_code, kRefused) << it->str();
    EXPECT_EQ(Attack({Bin("security_probe"), "http", http[1], "/api/jobs", it->str()}).exit_code, kRefused);
  }
  EXPECT_GE(tried, 1) << "the login code at least";
  EXPECT_NE(Attack({"/bin/cat", Victim("run/long-1.addr")}).exit_code, 0) << "the launch's token file";
  // The victim opens its link; after that it opens nothing for anyone.
  ProcessResult own = RunProcess({Bin("security_probe"), "http", http[1], http[2]});
  EXPECT_NE(own.output.find("HTTP/1.1 303"), std::string::npos) << own.output;
  ProcessResult again = Attack({Bin("security_probe"), "http", http[1], http[2]});
  EXPECT_NE(again.output.find("HTTP/1.1 401"), std::string::npos) << again.output;
  launch.Signal(SIGINT);
  launch.Wait(seconds(30));
}

// 3. With umask 022, nothing a job leaves is readable by another user: the state, its logs, recipe,
// metrics, TensorBoard events and checkpoints are 0600 in 0700 folders.
TEST_F(SecurityProbesTest, StateLogsAndCheckpointsAreTheirOwnersAlone) {
  const std::string data = PrepareData();
  const std::string recipe = dir_.Write("tiny.yaml", TinyRecipe("tiny", data) +
                                                         "training: {steps: 4, log_every: 1}\nparallel: {nproc_per_node: 2}\n"
                                                         "metrics: {tensorboard: true}\n");
  ProcessResult ran = RunProcess({Bin("ltrain"), "launch", recipe}, VictimEnv(), seconds(180));
  ASSERT_EQ(ran.exit_code, 0) << ran.output;
  int files = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir_.Join("home"))) {
    struct stat st {};
    ASSERT_EQ(::lstat(entry.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 077, 0u) << entry.path() << " is mode " << std::oct << (st.st_mode & 0777);
    if (!S_ISREG(st.st_mode)) continue;
    ++files;
    EXPECT_NE(Attack({"/bin/cat", entry.path().string()}).exit_code, 0) << entry.path() << " was read by nobody";
  }
  EXPECT_GE(files, 8) << "state.db, recipe.yaml, two logs, metrics.jsonl, events, shards, the manifest";
  ProcessResult sql = Attack({"/usr/bin/sqlite3", "-readonly", Victim("state.db"), "select count(*) from events"});
  EXPECT_NE(sql.exit_code, 0) << sql.output;
}

// 4. 200 connections that trickle header lines (a slowloris) leave the HTTP side answering within a
// second.
TEST_F(SecurityProbesTest, TheDashboardAnswersDuringASlowlorisOf200Sockets) {
  std::unique_ptr<Subprocess> coordinator;
  const std::string address = StartCoordinator(coordinator, {"--http-listen", "127.0.0.1:0", "--http-port-file",
                                                             dir_.Join("http-port")});
  const int http = WaitForPortFile(dir_.Join("http-port"));
  ASSERT_GT(http, 0) << coordinator->Output();
  std::string metrics_token;
  std::ifstream(Victim("metrics-token")) >> metrics_token;
  Subprocess slow(AsNobody({Bin("security_probe"), "slowloris", std::to_string(http), "200", "30"}), NobodyEnv());
  ASSERT_TRUE(slow.WaitForOutput("holding 200 connections", seconds(20))) << slow.Output();
  for (int i = 0; i < 5; ++i) {
    ProcessResult got = RunProcess({Bin("security_probe"), "http", std::to_string(http), "/metrics", metrics_token},
                                   {}, seconds(20));
    EXPECT_EQ(got.exit_code, 0) << got.output;
    EXPECT_LT(got.seconds, 1.0) << "answered in " << got.seconds << " s while 200 connections trickle";
  }
  slow.Signal(SIGKILL);
}

// 5. MASTER_PORT belongs to rank 0's proxy from before it is named to the end of the program: nobody
// cannot bind it, on its address or every address, and the job runs through.
TEST_F(SecurityProbesTest, NoOtherUserCanTakeMasterPort) {
  ProcessResult torch = RunProcess({"/usr/bin/python3", "-c", "import torch.distributed"}, {}, seconds(60));
  ASSERT_EQ(torch.exit_code, 0) << "this probe runs a PyTorch script: install Debian's python3-torch\n" << torch.output;
  const std::string master = dir_.Join("master.txt");
  const std::string go = dir_.Join("go");
  dir_.Write("ddp.py",
             "import os, time, torch, torch.distributed as dist\n"
             "if os.environ['RANK'] == '0':\n"
             "    open('" + master + ".tmp', 'w').write(os.environ['MASTER_ADDR'] + ' ' + os.environ['MASTER_PORT'])\n"
             "    os.rename('" + master + ".tmp', '" + master + "')\n"
             "    while not os.path.exists('" + go + "'): time.sleep(0.05)\n"
             "dist.init_process_group('gloo')\n"
             "t = torch.tensor([float(dist.get_rank() + 1)])\n"
             "dist.all_reduce(t)\n"
             "print(f'rank {dist.get_rank()} sum {t.item():g}', flush=True)\n");
  Subprocess run({Bin("ltrain"), "run", "--nproc-per-node", "2", "--workdir", dir_.path(), "--", "/usr/bin/python3", "ddp.py"},
                 VictimEnv());
  for (int i = 0; i < 600 && !fs::exists(master); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(fs::exists(master)) << run.Output();
  std::string host, port;
  std::ifstream(master) >> host >> port;
  for (const std::string& on : {host, std::string("0.0.0.0")}) {
    ProcessResult bound = Attack({Bin("security_probe"), "bind", on, port});
    EXPECT_EQ(bound.exit_code, kRefused) << bound.output;
  }
  std::ofstream(go) << "go\n";
  ProcessResult result = run.Wait(seconds(120));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("rank 0 sum 3"), std::string::npos) << result.output;
}

// 6. An ended job's secret reaches nothing, even copied; rendezvous values are bounded; a link planted
// where the agent writes is never followed; a process that leaves its job's process group ends with
// the job; --init-tls writes through no link.
TEST_F(SecurityProbesTest, SecretsBoundsLinksAndEscapedProcessesGetNowhere) {
  const std::string out = dir_.Join("out");
  fs::create_directories(out);
  // Links where the first job's files go, planted before it starts, to files of the victim's.
  const std::string gen = Victim("agent-local/jobs/esc-1/gen-0");
  fs::create_directories(gen);
  std::map<std::string, std::string> planted = {{gen + "/recipe.yaml", dir_.Write("target-recipe", "original\n")},
                                                {gen + "/rank-0.log", dir_.Write("target-log", "original\n")},
                                                {Victim("agent-local/jobs/esc-1/metrics.jsonl"),
                                                 dir_.Write("target-metrics", "original\n")}};
  for (const auto& [link, target] : planted) fs::create_symlink(target, link);
  const std::string script = "env > " + out + "/env.txt; setsid sleep 300 & echo $! > " + out +
                             "/escaped.pid; while [ ! -e " + out + "/go ]; do sleep 0.1; done";
  Subprocess run({Bin("ltrain"), "run", "--name", "esc", "--", "/bin/sh", "-c", script}, VictimEnv());
  for (int i = 0; i < 600 && !fs::exists(out + "/escaped.pid"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(fs::exists(out + "/escaped.pid")) << run.Output();
  std::map<std::string, std::string> env;
  {
    std::ifstream in(out + "/env.txt");
    for (std::string line; std::getline(in, line);) env[line.substr(0, line.find('='))] = line.substr(line.find('=') + 1);
  }
  std::string secret;
  std::ifstream(env["LTRAIN_AGENT_SECRET_FILE"]) >> secret;
  ASSERT_FALSE(secret.empty()) << env["LTRAIN_AGENT_SECRET_FILE"];
  const std::string agent = env["LTRAIN_AGENT"];
  const std::string scope = env["LTRAIN_RDZV_SCOPE"];
  // A copy of the secret while the job runs: 30 values of 3 MiB are all refused, each naming the bound.
  ProcessResult big = Attack({Bin("security_probe"), "kv-set", agent, secret, scope + "big", std::to_string(3 << 20), "30"});
  EXPECT_EQ(big.exit_code, kRefused) << big.output;
  EXPECT_NE(big.output.find("over the bound of 1048576"), std::string::npos) << big.output;
  pid_t escaped = 0;
  std::ifstream(out + "/escaped.pid") >> escaped;
  ASSERT_GT(escaped, 0);
  ASSERT_TRUE(ProcessAlive(escaped));
  std::ofstream(out + "/go") << "go\n";
  ProcessResult result = run.Wait(seconds(60));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  for (int i = 0; i < 50 && ProcessAlive(escaped); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(ProcessAlive(escaped)) << "the setsid child outlived its job";
  if (ProcessAlive(escaped)) ::kill(escaped, SIGKILL);
  ProcessResult after = Attack({Bin("security_probe"), "kv-get", agent, secret, scope + "x"});
  EXPECT_NE(after.exit_code, 0) << "an ended generation's secret, copied: " << after.output;
  EXPECT_FALSE(fs::exists(env["LTRAIN_AGENT_SECRET_FILE"])) << "its file goes with it";
  for (const auto& [link, target] : planted) EXPECT_EQ(ReadFile(target), "original\n") << link << " was followed";

  // --init-tls: a dangling link where the CA's key would go is refused, and nothing is written there.
  const std::string tls = dir_.Join("tls");
  fs::create_directories(tls);
  fs::create_symlink(dir_.Join("elsewhere/ca.key"), tls + "/ca.key");
  ProcessResult init = RunProcess({Bin("ltrain"), "coordinator", "--init-tls", tls});
  EXPECT_EQ(init.exit_code, 2) << init.output;
  EXPECT_NE(init.output.find("already holds ca.key"), std::string::npos) << init.output;
  EXPECT_FALSE(fs::exists(dir_.Join("elsewhere")));
}

// 6, continued: with TLS the HTTP side speaks only HTTPS; a token in an address opens nothing; the
// health service answers its token alone.
TEST_F(SecurityProbesTest, TheHttpSideIsHttpsWithTlsAndTakesNoTokenInItsAddress) {
  const std::string tls = dir_.Join("tls");
  ProcessResult init = RunProcess({Bin("ltrain"), "coordinator", "--init-tls", tls, "--tls-hosts", "127.0.0.1"});
  ASSERT_EQ(init.exit_code, 0) << init.output;
  std::unique_ptr<Subprocess> coordinator;
  const std::string address =
      StartCoordinator(coordinator, {"--tls-cert", tls + "/server.pem", "--tls-key", tls + "/server.key",
                                     "--token-file", tls + "/token", "--http-listen", "127.0.0.1:0",
                                     "--http-port-file", dir_.Join("http-port")});
  const int http = WaitForPortFile(dir_.Join("http-port"));
  ASSERT_GT(http, 0) << coordinator->Output();
  std::string token, metrics;
  std::ifstream(tls + "/token") >> token;
  std::ifstream(Victim("metrics-token")) >> metrics;
  ProcessResult plain = Attack({Bin("security_probe"), "http", std::to_string(http), "/metrics", metrics});
  EXPECT_EQ(plain.exit_code, kRefused) << "no plain HTTP answer on a TLS coordinator's port\n" << plain.output;
  const std::string url = "https://127.0.0.1:" + std::to_string(http);
  ProcessResult served = RunProcess({"/usr/bin/curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert",
                                     tls + "/ca.pem", "-H", "Authorization: Bearer " + metrics, url + "/metrics"});
  EXPECT_EQ(served.output, "200") << served.output;
  ProcessResult in_address = RunProcess({"/usr/bin/curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert",
                                         tls + "/ca.pem", url + "/api/jobs?token=" + token});
  EXPECT_EQ(in_address.output, "401") << "a token in an address opens nothing";
  ProcessResult referrer = RunProcess({"/usr/bin/curl", "-sS", "-D", "-", "-o", "/dev/null", "--cacert", tls + "/ca.pem",
                                       url + "/"});
  EXPECT_NE(referrer.output.find("Referrer-Policy: no-referrer"), std::string::npos) << referrer.output;
  ProcessResult rebinding = RunProcess({"/usr/bin/curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert",
                                        tls + "/ca.pem", "-H", "Host: evil.example", url + "/metrics", "-H",
                                        "Authorization: Bearer " + metrics});
  EXPECT_EQ(rebinding.output, "421") << "a Host that is not this coordinator's";
}

// 6, continued: the coordinators' state in etcd is behind TLS, client certificates and a user: nobody,
// who may read the CA but not the client key or the password, gets nothing from etcd.
TEST_F(SecurityProbesTest, EtcdHoldsTheStateBehindTlsClientCertificatesAndAUser) {
  ASSERT_FALSE(EtcdBinary().empty()) << "etcd is not installed: apt-get install etcd-server (deploy/setup.sh --tests)";
  ASSERT_EQ(::access("/usr/bin/etcdctl", X_OK), 0) << "etcdctl is not installed: apt-get install etcd-client";
  const std::string tls = dir_.Join("tls");
  ProcessResult made = RunProcess({Bin("ltrain"), "coordinator", "--init-tls", tls, "--tls-hosts", "127.0.0.1"});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  EtcdCluster etcd(dir_, 1, tls);
  ASSERT_TRUE(etcd.WaitReady()) << etcd.Output();
  for (const std::vector<std::string>& step : std::vector<std::vector<std::string>>{
           {"user", "add", "root", "--new-user-password=root-secret"}, {"user", "grant-role", "root", "root"},
           {"role", "add", "ltrain"}, {"role", "grant-permission", "ltrain", "--prefix=true", "readwrite", "sec"},
           {"user", "add", "ltrain", "--new-user-password=ltrain-secret"}, {"user", "grant-role", "ltrain", "ltrain"},
           {"auth", "enable"}}) {
    ProcessResult done = etcd.Ctl(step);
    ASSERT_EQ(done.exit_code, 0) << done.output;
  }
  const std::string password = dir_.Write("etcd-password", "ltrain-secret\n");
  ::chmod(password.c_str(), 0600);
  const std::string address = "127.0.0.1:" + std::to_string(FreePort());
  Subprocess coordinator({Bin("ltrain"), "coordinator", "--listen", address, "--state", etcd.Url() + "/sec",
                          "--state-dir", dir_.Join("home"), "--port-file", dir_.Join("port"), "--token-file",
                          tls + "/token", "--etcd-ca", tls + "/ca.pem", "--etcd-cert", tls + "/client.pem", "--etcd-key",
                          tls + "/client.key", "--etcd-user", "ltrain", "--etcd-password-file", password},
                         VictimEnv());
  ASSERT_GT(WaitForPortFile(dir_.Join("port"), seconds(30)), 0) << coordinator.Output();
  const std::string recipe = dir_.Write("r.yaml", "name: r\ndata: {path: /nonexistent}\ntraining: {steps: 1}\n");
  std::map<std::string, std::string> client = VictimEnv();
  client["LTRAIN_TOKEN_FILE"] = tls + "/token";
  ProcessResult submitted = RunProcess({Bin("ltrain"), "launch", "--coordinator", address, recipe, "--detach"}, client);
  ASSERT_EQ(submitted.exit_code, 0) << submitted.output;
  ProcessResult own = etcd.Ctl({"get", "--prefix", "--keys-only", "sec/jobs/"}, "root:root-secret");
  EXPECT_NE(own.output.find("r-1"), std::string::npos) << "the job is in etcd\n" << own.output;
  const std::string endpoint = "https://" + etcd.Endpoints().front();
  for (const std::vector<std::string>& credentials : std::vector<std::vector<std::string>>{
           {"--cacert", tls + "/ca.pem"},
           {"--cacert", tls + "/ca.pem", "--cert", tls + "/client.pem", "--key", tls + "/client.key"},
           {"--cacert", tls + "/ca.pem", "--user", "ltrain:guess"},
           {"--insecure-transport=true", "--insecure-skip-tls-verify=true"}}) {
    std::vector<std::string> argv = {"/usr/bin/etcdctl", "--endpoints", endpoint, "--command-timeout", "5s"};
    argv.insert(argv.end(), credentials.begin(), credentials.end());
    argv.insert(argv.end(), {"get", "--prefix", "sec/"});
    ProcessResult read = RunProcess(AsNobody(argv), {{"ETCDCTL_API", "3"}, {"HOME", Nobody("")}}, seconds(30));
    EXPECT_NE(read.exit_code, 0) << credentials.back() << "\n" << read.output;
    EXPECT_EQ(read.output.find("r-1"), std::string::npos) << read.output;
  }
  EXPECT_NE(Attack({"/bin/cat", tls + "/client.key"}).exit_code, 0);
  EXPECT_NE(Attack({"/bin/cat", password}).exit_code, 0);
  coordinator.Signal(SIGTERM);
  coordinator.Wait(seconds(10));
}

// 7. Each bad input of the issue exits 2, and nobody's files are as they were.
TEST_F(SecurityProbesTest, BadInputExitsTwoAndChangesNothing) {
  const std::string text = NobodyWrites("in.txt", ReadFile("/usr/share/common-licenses/GPL-3"));
  ProcessResult prepared = Attack({Bin("ltrain"), "data", "prepare", "--input", text, "--output", Nobody("data")});
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  const std::string tiny = NobodyWrites("tiny.yaml", TinyRecipe("tiny", Nobody("data")) +
                                                         "training: {steps: 2, micro_batch: 2, global_batch: 2}\n");
  ProcessResult trained = Attack({Bin("ltrain"), "launch", tiny}, seconds(180));
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string checkpoint = Nobody("ltrain/checkpoints/tiny-1");
  NobodyWrites("other.txt", "not a dataset\n");
  const std::string huge = NobodyWrites("huge.yaml", TinyRecipe("huge", Nobody("data")) +
                                                         "fault: {hang_timeout_s: '" + std::string(10 << 20, '7') + "x'}\n");
  std::string keys = "name: keys\ndata: {path: " + Nobody("data") + "}\nmetrics: {";
  for (int i = 0; i < 700000; ++i) keys += "k" + std::to_string(i) + ": 1, ";
  const std::string many = NobodyWrites("many.yaml", keys + "tensorboard: false}\n");
  const std::string dash = NobodyWrites("dash.yaml", "name: \"-rf\"\ndata: {path: " + Nobody("data") + "}\n");
  const std::string big = NobodyWrites("big.yaml", "name: big\ndata: {path: " + Nobody("data") +
                                                       "}\nmodel: {d_model: 1048576, layers: 1024, heads: 1024}\n");
  // What nobody's folder holds: every file's path, size and modification time.
  auto snapshot = [&] {
    std::map<std::string, std::pair<uintmax_t, int64_t>> files;
    for (const auto& e : fs::recursive_directory_iterator(Nobody(""))) {
      if (!e.is_regular_file()) continue;
      files[e.path().string()] = {e.file_size(), e.last_write_time().time_since_epoch().count()};
    }
    return files;
  };
  const auto before = snapshot();
  struct Case {
    std::vector<std::string> argv;
    const char* says;
    size_t at_most = 4096;  // bytes of output
  };
  const std::vector<Case> cases = {
      {{Bin("ltrain"), "data", "prepare", "--input", text, "--output", Nobody("data")}, "holds a dataset already"},
      {{Bin("ltrain"), "data", "prepare", "--input", text, "--output", Nobody("")}, "holds files that are not a dataset"},
      {{Bin("ltrain"), "data", "prepare", "--input", text, "--output", Nobody("new"), "--threads", "100000"}, "--threads"},
      {{Bin("ltrain"), "generate", checkpoint, "--temperature", "nan"}, "is not a finite number"},
      {{Bin("ltrain"), "generate", checkpoint, "--top-k", "inf"}, ""},
      {{Bin("ltrain"), "validate", dash}, "must begin with a letter, digit or '_'"},
      {{Bin("ltrain"), "launch", dash}, "must begin with a letter, digit or '_'"},
      {{Bin("ltrain"), "export", checkpoint, "--output", "/usr/share/ltrain-export"}, "give --output a folder you can write"},
      {{Bin("ltrain"), "validate", big}, "cannot train on 1 rank(s) in any layout"},
      {{Bin("ltrain"), "validate", huge}, "(10485761 bytes)"},
      {{Bin("ltrain"), "validate", many}, "more error(s) not shown", 100000},
  };
  for (const Case& c : cases) {
    ProcessResult result = Attack(c.argv);
    std::string shown;
    for (const std::string& word : c.argv) shown += " " + word.substr(0, 80);
    EXPECT_EQ(result.exit_code, 2) << shown << "\n" << result.output.substr(0, 2000);
    EXPECT_NE(result.output.find(c.says), std::string::npos) << shown << "\n" << result.output.substr(0, 2000);
    EXPECT_LE(result.output.size(), c.at_most) << shown << ": " << result.output.size() << " bytes of output";
  }
  EXPECT_EQ(snapshot(), before) << "a refused input changed nobody's files";
  EXPECT_FALSE(fs::exists(Nobody("new")));
  EXPECT_FALSE(fs::exists("/usr/share/ltrain-export"));
}

}  // namespace
}  // namespace ltrain::testing
