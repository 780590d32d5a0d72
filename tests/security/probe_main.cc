// security_probe: what the security suite's second local user (nobody) runs against real ltrain
// processes, besides the ltrain command itself. Each subcommand tries one thing and says what came
// back; the exit code says whether the attempt got in: 0 it did, 10 it was refused, 1 an error of the
// probe itself.
//   health HOST:PORT [TOKEN]               grpc.health.v1 Check
//   list HOST:PORT TOKEN                   JobService.ListJobs with TOKEN as the bearer
//   kv-set HOST:PORT SECRET KEY BYTES N    N rendezvous sets of BYTES bytes through an agent, as a worker
//   kv-get HOST:PORT SECRET KEY            one rendezvous get through an agent, as a worker
//   http PORT PATH [TOKEN]                 GET over plain HTTP on loopback; 0 for 200
//   slowloris PORT N SECONDS               N connections that send a header line a second, for SECONDS
//   bind HOST PORT                         binds and listens on HOST:PORT; 0 when it could
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "grpc/health/v1/health.grpc.pb.h"
#include "ltrain/v1/ltrain.grpc.pb.h"

namespace {

constexpr int kGotIn = 0, kRefused = 10, kProbeError = 1;

int Verdict(const grpc::Status& status, const std::string& what) {
  std::printf("%s: %s %s\n", what.c_str(), status.ok() ? "OK" : "refused:", status.error_message().c_str());
  if (status.ok()) return kGotIn;
  return status.error_code() == grpc::StatusCode::UNAUTHENTICATED ? kRefused : kProbeError;
}

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

template <typename Context>
void Bearer(Context& context, const std::string& token) {
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
}

int Connected(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int Http(int port, const std::string& path, const std::string& token) {
  const int fd = Connected(port);
  if (fd < 0) return kProbeError;
  timeval ten{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &ten, sizeof(ten));
  std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n";
  if (!token.empty()) request += "Authorization: Bearer " + token + "\r\n";
  request += "\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) return kProbeError;
  std::string response;
  char chunk[4096];
  for (ssize_t n; (n = read(fd, chunk, sizeof(chunk))) > 0;) response.append(chunk, static_cast<size_t>(n));
  close(fd);
  std::printf("%s\n", response.substr(0, 200).c_str());
  if (response.rfind("HTTP/1.", 0) != 0) return kRefused;  // no HTTP answer (an HTTPS port)
  return std::atoi(response.c_str() + 9) == 200 ? kGotIn : kRefused;
}

int Slowloris(int port, int count, double seconds) {
  std::vector<int> fds;
  for (int i = 0; i < count; ++i) {
    const int fd = Connected(port);
    if (fd < 0) continue;
    const std::string start = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    if (write(fd, start.data(), start.size()) < 0) {
      close(fd);
      continue;
    }
    fds.push_back(fd);
  }
  std::printf("holding %zu connections\n", fds.size());
  std::fflush(stdout);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (int line = 0; std::chrono::steady_clock::now() < end; ++line) {
    const std::string header = "X-Slow-" + std::to_string(line) + ": 1\r\n";
    for (int fd : fds) (void)!send(fd, header.data(), header.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  for (int fd : fds) close(fd);
  return fds.empty() ? kRefused : kGotIn;
}

int Bind(const std::string& host, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  inet_pton(AF_INET, host.c_str(), &address.sin_addr);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || listen(fd, 16) != 0) {
    std::printf("bind %s:%d: %s\n", host.c_str(), port, std::strerror(errno));
    close(fd);
    return kRefused;
  }
  std::printf("bound %s:%d\n", host.c_str(), port);
  close(fd);
  return kGotIn;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> a(argv + 1, argv + argc);
  auto arg = [&](size_t i) { return i < a.size() ? a[i] : std::string(); };
  const std::string command = arg(0);
  if (command == "health" && a.size() >= 2) {
    auto stub = grpc::health::v1::Health::NewStub(Channel(arg(1)));
    grpc::ClientContext context;
    Bearer(context, arg(2));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    return Verdict(stub->Check(&context, request, &response), "health");
  }
  if (command == "list" && a.size() >= 3) {
    auto stub = ltrain::v1::JobService::NewStub(Channel(arg(1)));
    grpc::ClientContext context;
    Bearer(context, arg(2));
    ltrain::v1::ListJobsRequest request;
    ltrain::v1::ListJobsReply reply;
    return Verdict(stub->ListJobs(&context, request, &reply), "list");
  }
  if (command == "kv-set" && a.size() >= 6) {
    auto stub = ltrain::v1::RendezvousService::NewStub(Channel(arg(1)));
    int stored = 0;
    for (int i = 0; i < std::atoi(arg(5).c_str()); ++i) {
      grpc::ClientContext context;
      Bearer(context, arg(2));
      ltrain::v1::KvSetRequest request;
      request.set_key(arg(3) + std::to_string(i));
      request.set_value(std::string(std::strtoul(arg(4).c_str(), nullptr, 10), 'x'));
      ltrain::v1::KvSetReply reply;
      const grpc::Status status = stub->Set(&context, request, &reply);
      if (!status.ok()) return Verdict(status, "kv-set");
      if (reply.status().code() != 0) {
        std::printf("kv-set %d refused: %s\n", i, reply.status().message().c_str());
        continue;
      }
      ++stored;
    }
    std::printf("kv-set: %d stored\n", stored);
    return stored > 0 ? kGotIn : kRefused;
  }
  if (command == "kv-get" && a.size() >= 4) {
    auto stub = ltrain::v1::RendezvousService::NewStub(Channel(arg(1)));
    grpc::ClientContext context;
    Bearer(context, arg(2));
    ltrain::v1::KvGetRequest request;
    request.add_keys(arg(3));
    request.set_timeout_ms(100);
    ltrain::v1::KvGetReply reply;
    return Verdict(stub->Get(&context, request, &reply), "kv-get");
  }
  if (command == "http" && a.size() >= 3) return Http(std::atoi(arg(1).c_str()), arg(2), arg(3));
  if (command == "slowloris" && a.size() >= 4) {
    return Slowloris(std::atoi(arg(1).c_str()), std::atoi(arg(2).c_str()), std::atof(arg(3).c_str()));
  }
  if (command == "bind" && a.size() >= 3) return Bind(arg(1), std::atoi(arg(2).c_str()));
  std::fprintf(stderr, "security_probe: see the comment at the top of tests/security/probe_main.cc\n");
  return kProbeError;
}
