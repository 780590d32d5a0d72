// ltrain coordinator: the coordinator daemon, or --init-tls to write the files it and its clients need.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/logging.h"
#include "launcher/coordinator_server.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

struct CoordinatorArgs {
  std::string listen = "127.0.0.1:7070";
  std::string state_dir;
  std::string port_file;
  std::string http_listen;
  std::string http_port_file;
  double node_timeout_s = 3.0;
  double retain_days = 30;
  double state_max_mb = 0;
  std::string init_tls;
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

int RunCoordinator(const CoordinatorArgs& args, const SecurityMaterial& security) {
  std::string state_dir = args.state_dir.empty() ? LtrainHome() : args.state_dir;
  InterruptWatcher interrupts;
  launcher::CoordinatorServerOptions options;
  options.listen_address = args.listen;
  options.state_dir = state_dir;
  options.node_timeout_ms = static_cast<int64_t>(args.node_timeout_s * 1000);
  options.retain_ms = static_cast<int64_t>(args.retain_days * 24 * 3600 * 1000);
  options.state_max_bytes = static_cast<int64_t>(args.state_max_mb * 1024 * 1024);
  options.security = security;
  options.http_listen = args.http_listen;
  if (options.listen_address.rfind("127.", 0) != 0 && options.listen_address.rfind("localhost", 0) != 0) {
    if (security.token.empty()) {
      LTRAIN_LOG(kWarning, "coordinator") << "listening on " << args.listen
                                          << " without a token: anyone who reaches it can drive it; see --init-tls";
    } else if (security.cert_pem.empty()) {
      LTRAIN_LOG(kWarning, "coordinator") << "listening on " << args.listen
                                          << " without TLS: the token travels in clear text; see --init-tls";
    }
  }
  StatusOr<std::unique_ptr<launcher::CoordinatorServer>> server = launcher::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "ltrain coordinator: %s\n", server.status().message().c_str());
    return kExitUnavailable;
  }
  // The address it listens on (0.0.0.0 stays 0.0.0.0), with the port it got.
  const std::string host = args.listen.substr(0, args.listen.rfind(':'));
  LTRAIN_LOG(kInfo, "coordinator") << "listening on " << host << ":" << (*server)->port() << ", state in "
                                   << state_dir;
  // Written aside and renamed, so that whoever waits for the file never reads half a port.
  auto write_port = [](const std::string& path, int port) {
    if (path.empty()) return;
    std::ofstream tmp(path + ".tmp");
    tmp << port << "\n";
    tmp.close();
    fs::rename(path + ".tmp", path);
  };
  if ((*server)->http_port() != 0) {
    const std::string http_host = args.http_listen.substr(0, args.http_listen.rfind(':'));
    LTRAIN_LOG(kInfo, "coordinator") << "dashboard at http://" << http_host << ":" << (*server)->http_port()
                                     << "/ (with ?token=TOKEN when the coordinator has one), metrics at /metrics";
    write_port(args.http_port_file, (*server)->http_port());
  }
  write_port(args.port_file, (*server)->port());
  launcher::CoordinatorServer* raw = server->get();
  interrupts.Start([raw](int) { raw->Shutdown(); });
  raw->Wait();
  raw->Shutdown();
  return kExitOk;
}

}  // namespace

void AddCoordinatorCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<CoordinatorArgs>();
  CLI::App* cmd = app.add_subcommand("coordinator", "Run the coordinator daemon");
  cmd->add_option("--listen", args->listen, "HOST:PORT to serve on; port 0 picks a free one")->capture_default_str();
  cmd->add_option("--state-dir", args->state_dir, "Directory of state.db and default checkpoints ($LTRAIN_HOME)");
  cmd->add_option("--port-file", args->port_file, "Write the chosen port here once listening");
  cmd->add_option("--http-listen", args->http_listen,
                  "HOST:PORT to serve GET /metrics on (Prometheus' text format), with the RPCs' token when one is "
                  "set; port 0 picks a free one. Plain HTTP: keep it on loopback where the RPCs use TLS");
  cmd->add_option("--http-port-file", args->http_port_file, "Write the HTTP port here once listening");
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
