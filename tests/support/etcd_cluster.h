// A real etcd cluster on loopback for tests (Debian's etcd-server), and etcdctl against it.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/subprocess.h"

namespace ltrain::testing {

inline std::string EtcdBinary() {
  for (const char* path : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "";
}

// `members` etcd processes forming one cluster on loopback; with `tls` (a folder of `ltrain
// coordinator --init-tls`), clients speak TLS and must show a certificate of its CA.
class EtcdCluster {
 public:
  EtcdCluster(const TempDir& dir, int members, const std::string& tls = "") : tls_(tls) {
    std::string initial;
    for (int i = 0; i < members; ++i) {
      client_ports_.push_back(FreePort());
      peer_ports_.push_back(FreePort());
      initial += (i ? "," : "") + Name(i) + "=http://127.0.0.1:" + std::to_string(peer_ports_[i]);
    }
    for (int i = 0; i < members; ++i) {
      const std::string client = (tls.empty() ? "http" : "https") + std::string("://127.0.0.1:") +
                                 std::to_string(client_ports_[i]);
      const std::string peer = "http://127.0.0.1:" + std::to_string(peer_ports_[i]);
      std::vector<std::string> argv = {
          EtcdBinary(), "--name", Name(i), "--data-dir", dir.Join(Name(i)), "--listen-client-urls", client,
          "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
          "--initial-cluster", initial, "--initial-cluster-state", "new", "--initial-cluster-token", dir.path()};
      if (!tls.empty()) {
        argv.insert(argv.end(), {"--cert-file", tls + "/server.pem", "--key-file", tls + "/server.key",
                                 "--trusted-ca-file", tls + "/ca.pem", "--client-cert-auth"});
      }
      processes_.push_back(std::make_unique<Subprocess>(argv));
    }
  }
  // Every member serves clients (what a deployment has before coordinators start).
  bool WaitReady() const {
    for (const auto& process : processes_) {
      if (!process->WaitForOutput("ready to serve client requests", std::chrono::seconds(30))) return false;
    }
    return true;
  }
  ~EtcdCluster() {
    for (auto& process : processes_) process->Signal(SIGKILL);
  }
  std::string Url() const {
    std::string url = "etcd://";
    for (size_t i = 0; i < client_ports_.size(); ++i) {
      url += (i ? "," : "") + std::string("127.0.0.1:") + std::to_string(client_ports_[i]);
    }
    return url;
  }
  std::vector<std::string> Endpoints() const {
    std::vector<std::string> endpoints;
    for (int port : client_ports_) endpoints.push_back("127.0.0.1:" + std::to_string(port));
    return endpoints;
  }
  // etcdctl against the cluster (over its TLS, with a client certificate), as `user` when given.
  ProcessResult Ctl(std::vector<std::string> args, const std::string& user = "") const {
    std::string endpoints;
    for (const std::string& e : Endpoints()) endpoints += (endpoints.empty() ? "" : ",") + ("https://" + e);
    std::vector<std::string> argv = {"/usr/bin/etcdctl", "--endpoints", endpoints, "--cacert", tls_ + "/ca.pem",
                                     "--cert", tls_ + "/client.pem", "--key", tls_ + "/client.key"};
    if (!user.empty()) argv.insert(argv.end(), {"--user", user});
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProcess(argv, {{"ETCDCTL_API", "3"}}, std::chrono::seconds(30));
  }
  Subprocess& member(int i) { return *processes_[i]; }
  std::string Output() const {
    std::string all;
    for (size_t i = 0; i < processes_.size(); ++i) all += "--- " + Name(i) + "\n" + processes_[i]->Output();
    return all;
  }

 private:
  static std::string Name(int i) { return "m" + std::to_string(i); }
  std::string tls_;
  std::vector<int> client_ports_, peer_ports_;
  std::vector<std::unique_ptr<Subprocess>> processes_;
};

}  // namespace ltrain::testing
