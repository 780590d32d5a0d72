// GET over HTTP/1.0 on loopback, for tests and benchmarks of the coordinator's HTTP side (/metrics,
// the dashboard's API): no library beyond the sockets.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <utility>

namespace ltrain::testing {

// GET from 127.0.0.1:`port` over HTTP/1.0: the status and the body (0 and "" when the server cannot be
// reached); the response's header lines into `headers` when given.
// `extra`: header lines to send ("Cookie: a=b\r\n").
inline std::pair<int, std::string> HttpGet(int port, const std::string& path, const std::string& token = "",
                                    std::string* headers = nullptr, const std::string& extra = "") {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  timeval ten{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &ten, sizeof(ten));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return {0, ""};
  }
  std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n";
  if (!token.empty()) request += "Authorization: Bearer " + token + "\r\n";
  request += extra + "\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return {0, ""};
  }
  std::string response;
  char chunk[65536];
  for (ssize_t n; (n = read(fd, chunk, sizeof(chunk))) > 0;) response.append(chunk, static_cast<size_t>(n));
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || body == std::string::npos) return {0, response};
  if (headers != nullptr) *headers = response.substr(0, body);
  return {std::atoi(response.c_str() + 9), response.substr(body + 4)};
}

}  // namespace ltrain::testing
