// ltrain coordinator: the coordinator daemon, or --init-tls to write the files it and its clients need.
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <utility>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/files.h"
#include "common/logging.h"
#include "launcher/coordinator_server.h"
#include "launcher/etcd_client.h"
#include "launcher/etcd_state_store.h"
#include "launcher/leader_election.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

struct CoordinatorArgs {
  std::string listen = "127.0.0.1:7070";
  std::string state_dir;
  std::string state;  // empty: SQLite under state_dir; etcd://...: an etcd cluster
  std::string port_file;
  std::string http_listen;
  std::string http_port_file;
  std::string metrics_token_file;  // empty: <state dir>/metrics-token
  std::vector<std::string> http_hosts;
  double node_timeout_s = 3.0;
  double retain_days = 30;
  double state_max_mb = 0;
  std::string init_tls;
  std::string etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password_file;
  std::vector<std::string> tls_hosts = {"localhost", "127.0.0.1"};
};

int InitTlsFiles(const std::string& dir, const std::vector<std::string>& hosts) {
  Status made = InitTls(dir, hosts);
  if (!made.ok()) {
    std::fprintf(stderr, "ltrain coordinator --init-tls: %s\n", made.message().c_str());
    return made.code() == StatusCode::kFailedPrecondition ? kExitInvalid : kExitUnavailable;
  }
  const char* d = dir.c_str();
  std::printf("wrote ca.pem, server.pem/.key, client.pem/.key and token into %s. Start with:\n"
              "  ltrain coordinator --tls-cert %s/server.pem --tls-key %s/server.key --token-file %s/token "
              "[--tls-client-ca %s/ca.pem]\n"
              "and give agents and the CLI: --tls-ca %s/ca.pem --token-file %s/token "
              "[--tls-cert %s/client.pem --tls-key %s/client.key]\n",
              d, d, d, d, d, d, d, d, d);
  return kExitOk;
}

// The address standbys and users are told a leader listens on: HOST:PORT as given, a wildcard
// host replaced by this machine's name.
std::string AdvertisedAddress(const std::string& listen, int port) {
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host == "0.0.0.0" || host == "[::]" || host.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    host = name;
  }
  return host + ":" + std::to_string(port);
}

// The token the coordinator requires: the one given (--token-file, LTRAIN_TOKEN, config.yaml), else the
// one in the state directory, made there on the first start. Never printed: where it is, is.
std::optional<std::string> CoordinatorToken(const CoordinatorArgs& args, const SecurityMaterial& security,
                                            const std::string& state_dir) {
  if (!security.token.empty() && !security.token_by_default) return security.token;
  if (!args.state.empty()) {
    std::fprintf(stderr, "ltrain coordinator: several coordinators on one etcd state must require one token: give each "
                         "--token-file FILE with the same file (`ltrain coordinator --init-tls DIR` writes one, "
                         "DIR/token)\n");
    return std::nullopt;
  }
  const std::string path = (fs::path(state_dir) / "token").string();
  Status made = CreateDirectories(state_dir);
  StatusOr<std::string> token = made.ok() ? LoadOrCreateTokenFile(path) : StatusOr<std::string>(made);
  if (!token.ok()) {
    std::fprintf(stderr, "ltrain coordinator: %s\n", token.status().message().c_str());
    return std::nullopt;
  }
  LTRAIN_LOG(kInfo, "coordinator") << "clients need the token in " << path
                                   << " (0600): this user's agents and commands on this host read it by default when "
                                      "the state directory is $LTRAIN_HOME; elsewhere give them --token-file with a "
                                      "copy";
  return *token;
}

// Why serving `listen` as configured is refused (beyond loopback in clear text without
// --insecure), or "" when it may go on; a warning for every user when it goes on insecurely.
std::string RefuseCleartext(const std::string& flag, const std::string& listen, const SecurityMaterial& security,
                            std::string* warning) {
  if (listen.empty() || IsLoopbackAddress(listen) || !security.cert_pem.empty()) return "";
  if (!security.insecure) {
    return flag + " " + listen + " is beyond loopback, and this coordinator has no TLS: the token and every job's "
           "data would cross the network in clear text, where anyone on the path can read the token and run "
           "commands on every node. Give --tls-cert and --tls-key (`ltrain coordinator --init-tls DIR` writes "
           "them), listen on 127.0.0.1, or pass --insecure on a network you trust";
  }
  *warning = "this coordinator serves " + listen + " without TLS (--insecure): its token and every job's data "
             "cross the network in clear text";
  return "";
}

int RunCoordinator(const CoordinatorArgs& args, const SecurityMaterial& given) {
  std::string state_dir = args.state_dir.empty() ? LtrainHome() : args.state_dir;
  SecurityMaterial security = given;
  std::string warning;
  for (const auto& [flag, listen] : {std::pair{"--listen", args.listen}, std::pair{"--http-listen", args.http_listen}}) {
    if (std::string refused = RefuseCleartext(flag, listen, security, &warning); !refused.empty()) {
      std::fprintf(stderr, "ltrain coordinator: %s\n", refused.c_str());
      return kExitInvalid;
    }
  }
  if (!warning.empty()) LTRAIN_LOG(kWarning, "coordinator") << warning;
  std::optional<std::string> token = CoordinatorToken(args, security, state_dir);
  if (!token) return kExitInvalid;
  security.token = *token;
  InterruptWatcher interrupts;
  launcher::CoordinatorServerOptions options;
  options.warning = warning;
  options.listen_address = args.listen;
  options.state_dir = state_dir;
  options.node_timeout_ms = static_cast<int64_t>(args.node_timeout_s * 1000);
  // A fault for tests: the rendezvous answered as late as an overloaded coordinator would.
  if (const char* delay = std::getenv("LTRAIN_FAULT_RENDEZVOUS_DELAY"); delay != nullptr && *delay != '\0') {
    char* end = nullptr;
    const long long ms = std::strtoll(delay, &end, 10);
    if (*end != '\0' || ms < 0) {
      std::fprintf(stderr, "ltrain coordinator: LTRAIN_FAULT_RENDEZVOUS_DELAY=%s: give milliseconds, 0 or more\n", delay);
      return kExitInvalid;
    }
    options.rendezvous_answer_delay_ms = ms;
    LTRAIN_LOG(kWarning, "coordinator") << "LTRAIN_FAULT_RENDEZVOUS_DELAY: every rendezvous Get is answered " << ms
                                        << " ms late at the earliest";
  }
  options.retain_ms = static_cast<int64_t>(args.retain_days * 24 * 3600 * 1000);
  options.state_max_bytes = static_cast<int64_t>(args.state_max_mb * 1024 * 1024);
  options.security = security;
  options.http_listen = args.http_listen;
  options.http_host_names = args.http_hosts;
  std::string metrics_token_file;
  if (!args.http_listen.empty()) {
    metrics_token_file = args.metrics_token_file.empty() ? MetricsTokenFile(state_dir) : args.metrics_token_file;
    Status made = CreateDirectories(fs::path(metrics_token_file).parent_path().string());
    StatusOr<std::string> metrics = made.ok() ? LoadOrCreateTokenFile(metrics_token_file) : StatusOr<std::string>(made);
    if (!metrics.ok()) {
      std::fprintf(stderr, "ltrain coordinator: --metrics-token-file: %s\n", metrics.status().message().c_str());
      return kExitInvalid;
    }
    options.metrics_token = *metrics;
  }

  // What ends this run: a signal (while standing by it ends the campaign), or the lead lost.
  struct Lifecycle {
    std::mutex mu;
    std::condition_variable cv;
    bool stopping = false;
    bool lost = false;
    bool serving = false;
    launcher::LeaderElection* election = nullptr;
    // A leader that lost its lease stops serving at once: another coordinator leads by now, and the
    // fence already refuses this one's writes. Started again, it stands by.
    void StepDown(const std::string& why) {
      std::lock_guard<std::mutex> lock(mu);
      if (lost) return;
      lost = true;
      LTRAIN_LOG(kError, "coordinator") << "stepping down: " << why;
      cv.notify_all();
    }
  };
  Lifecycle life;
  // After `life` (the election's lost-lead callback reads it), before the interrupt callback's handle
  // (which reads both): the handle goes first, the election before `life`.
  std::unique_ptr<launcher::StateStore> store;
  std::unique_ptr<launcher::LeaderElection> election;
  InterruptWatcher::Watching watching = interrupts.Start([&life](int) {
    std::lock_guard<std::mutex> lock(life.mu);
    life.stopping = true;
    if (!life.serving && life.election) life.election->Cancel();
    life.cv.notify_all();
  });

  // With etcd: the state there, and the lead taken before listening, so that clients given every
  // coordinator's address reach the leader alone (a standby does not listen).
  if (!args.state.empty()) {
    StatusOr<launcher::EtcdUrl> url = launcher::ParseEtcdUrl(args.state);
    if (!url.ok()) {
      std::fprintf(stderr, "ltrain coordinator: --state: %s\n", url.status().message().c_str());
      return kExitInvalid;
    }
    const int port = std::atoi(args.listen.substr(args.listen.rfind(':') + 1).c_str());
    if (port == 0) {
      std::fprintf(stderr, "ltrain coordinator: with --state etcd://... give --listen a fixed port: agents and the "
                           "CLI are given every coordinator's HOST:PORT and reach whichever leads\n");
      return kExitInvalid;
    }
    StatusOr<launcher::EtcdSecurity> etcd_security = launcher::LoadEtcdSecurity(
        args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user, args.etcd_password_file);
    if (!etcd_security.ok()) {
      std::fprintf(stderr, "ltrain coordinator: %s\n", etcd_security.status().message().c_str());
      return kExitInvalid;
    }
    if (etcd_security->ca_pem.empty()) {
      for (const std::string& endpoint : url->endpoints) {
        if (IsLoopbackAddress(endpoint)) continue;
        if (!security.insecure) {
          std::fprintf(stderr, "ltrain coordinator: etcd at %s is beyond loopback, and --etcd-ca is not given: every "
                               "job's record would cross the network in clear text. Give --etcd-ca (and --etcd-cert, "
                               "--etcd-key for its --client-cert-auth), or pass --insecure on a network you trust\n",
                       endpoint.c_str());
          return kExitInvalid;
        }
        LTRAIN_LOG(kWarning, "coordinator") << "etcd at " << endpoint << " is reached in clear text (--insecure)";
        break;
      }
    }
    StatusOr<std::unique_ptr<launcher::EtcdClient>> client =
        launcher::EtcdClient::Connect(url->endpoints, 10000, *etcd_security, url->prefix + "/leader");
    if (!client.ok()) {
      std::fprintf(stderr, "ltrain coordinator: %s\n", client.status().message().c_str());
      return kExitUnavailable;
    }
    std::shared_ptr<launcher::EtcdClient> shared = std::move(client).value();
    auto etcd_store = std::make_unique<launcher::EtcdStateStore>(shared, url->prefix);
    launcher::LeaderElectionOptions election_options;
    election_options.key = url->prefix + "/leader";
    election_options.value = AdvertisedAddress(args.listen, port);
    election = std::make_unique<launcher::LeaderElection>(shared, election_options);
    {
      std::lock_guard<std::mutex> lock(life.mu);
      if (life.stopping) return kExitOk;
      life.election = election.get();
    }
    LTRAIN_LOG(kInfo, "coordinator") << "state in " << args.state << "; campaigning to lead as "
                                     << election_options.value;
    StatusOr<int64_t> fence = election->Campaign([](const std::string& leader) {
      LTRAIN_LOG(kInfo, "coordinator") << "standing by: " << leader << " leads";
    });
    if (!fence.ok()) {
      // Stopped while standing by: nothing was served, nothing to hand over.
      LTRAIN_LOG(kInfo, "coordinator") << "stopped while standing by";
      return kExitOk;
    }
    LTRAIN_LOG(kInfo, "coordinator") << "leading as " << election_options.value;
    election->OnLost([&life](const std::string& why) { life.StepDown(why); });
    etcd_store->SetFence(election_options.key, *fence, [&life](const std::string& why) { life.StepDown(why); });
    store = std::move(etcd_store);
    options.show_events_once_stored = true;
    options.state_name = args.state;
  }

  StatusOr<std::unique_ptr<launcher::CoordinatorServer>> server =
      launcher::CoordinatorServer::Start(options, std::move(store));
  if (!server.ok()) {
    std::fprintf(stderr, "ltrain coordinator: %s\n", server.status().message().c_str());
    return kExitUnavailable;
  }
  // The address it listens on (0.0.0.0 stays 0.0.0.0), with the port it got.
  const std::string host = args.listen.substr(0, args.listen.rfind(':'));
  LTRAIN_LOG(kInfo, "coordinator") << "listening on " << host << ":" << (*server)->port() << ", state in "
                                   << (options.state_name.empty() ? state_dir + "/state.db" : options.state_name);
  // Written aside and renamed, so that whoever waits for the file never reads half a port.
  auto write_port = [](const std::string& path, int port) {
    if (path.empty()) return;
    if (Status written = WriteFileAtomically(path, std::to_string(port) + "\n"); !written.ok()) {
      LTRAIN_LOG(kError, "coordinator") << written.message();
    }
  };
  if ((*server)->http_port() != 0) {
    const std::string http_host = args.http_listen.substr(0, args.http_listen.rfind(':'));
    LTRAIN_LOG(kInfo, "coordinator") << "dashboard at " << (security.cert_pem.empty() ? "http" : "https") << "://"
                                     << http_host << ":" << (*server)->http_port()
                                     << "/ (`ltrain dashboard` prints a one-time login link); /metrics with the "
                                        "read-only token in "
                                     << metrics_token_file;
    write_port(args.http_port_file, (*server)->http_port());
  }
  write_port(args.port_file, (*server)->port());
  {
    std::unique_lock<std::mutex> lock(life.mu);
    life.serving = true;
    life.cv.wait(lock, [&life] { return life.stopping || life.lost; });
  }
  (*server)->Shutdown();
  if (life.lost) return kExitUnavailable;
  // A standby leads at once rather than after the lease's TTL.
  if (election) election->Resign();
  return kExitOk;
}

}  // namespace

void AddCoordinatorCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<CoordinatorArgs>();
  CLI::App* cmd = app.add_subcommand("coordinator", "Run the coordinator daemon");
  cmd->add_option("--listen", args->listen, "HOST:PORT to serve on; port 0 picks a free one")->capture_default_str();
  cmd->add_option("--state-dir", args->state_dir, "Directory of state.db and default checkpoints ($LTRAIN_HOME)");
  cmd->add_option("--state", args->state,
                  "Keep jobs, nodes and commits in an etcd cluster instead of state.db: "
                  "etcd://HOST:PORT[,HOST:PORT...][/PREFIX]. Several coordinators on one such state elect a leader; "
                  "the others stand by and take over within seconds when it dies. Give each a fixed --listen port "
                  "and give agents and the CLI every coordinator's address: --coordinator HOST:PORT,HOST:PORT");
  cmd->add_option("--etcd-ca", args->etcd_ca, "With --state etcd://: the CA of the etcd members' certificates: TLS");
  cmd->add_option("--etcd-cert", args->etcd_cert,
                  "With --state etcd://: this coordinator's client certificate, for etcd's --client-cert-auth");
  cmd->add_option("--etcd-key", args->etcd_key, "The key of --etcd-cert");
  cmd->add_option("--etcd-user", args->etcd_user, "With --state etcd://: the etcd user to authenticate as");
  cmd->add_option("--etcd-password-file", args->etcd_password_file, "The file that holds --etcd-user's password");
  cmd->add_option("--port-file", args->port_file, "Write the chosen port here once listening");
  cmd->add_option("--http-listen", args->http_listen,
                  "HOST:PORT to serve the dashboard and GET /metrics on (Prometheus' text format); port 0 picks a "
                  "free one. HTTPS with --tls-cert/--tls-key; beyond loopback without them only with --insecure. "
                  "The dashboard opens through a one-time link (`ltrain dashboard`), /metrics takes the read-only "
                  "token of --metrics-token-file");
  cmd->add_option("--http-port-file", args->http_port_file, "Write the HTTP port here once listening");
  cmd->add_option("--metrics-token-file", args->metrics_token_file,
                  "The read-only token /metrics takes (Prometheus: authorization: {credentials_file: FILE}); made "
                  "0600 when missing (default: STATE_DIR/metrics-token)");
  cmd->add_option("--http-host", args->http_hosts,
                  "A name the dashboard is reached by (the Host header), besides its addresses, localhost and this "
                  "host's name; others are refused. Repeat for several");
  cmd->add_option("--tls-client-ca", ctx.security_options().tls_client_ca,
                  "Require client certificates signed by this CA: mutual TLS ($LTRAIN_TLS_CLIENT_CA)");
  cmd->add_option("--init-tls", args->init_tls,
                  "Write a CA, server and client certificates and a token into DIR, then exit");
  cmd->add_option("--tls-hosts", args->tls_hosts, "Names and addresses the server certificate is for (--init-tls)")
      ->capture_default_str();
  cmd->add_option("--node-timeout", args->node_timeout_s, "Seconds without heartbeat before a node is lost")
      ->capture_default_str();
  cmd->add_option("--retain-days", args->retain_days,
                  "Days a finished job's record, events and logs (and any job's log lines) are kept; 0 keeps them")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--state-max-mb", args->state_max_mb,
                  "Cap on state.db in MiB (0: none). At the cap the coordinator takes no new jobs, says why, and "
                  "takes them again once retention has made room")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  ctx.Bind(cmd, [args, &ctx] {
    if (!args->init_tls.empty()) return InitTlsFiles(args->init_tls, args->tls_hosts);
    return RunCoordinator(*args, ctx.security());
  });
}

}  // namespace ltrain::cli
