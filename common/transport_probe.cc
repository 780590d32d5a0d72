#include "common/transport_probe.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "common/strings.h"

namespace ltrain {
namespace {

using SteadyTime = std::chrono::steady_clock::time_point;

SteadyTime After(int timeout_ms) { return std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms); }

int RemainingMs(SteadyTime deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

// "2 s", "0.5 s".
std::string InSeconds(int ms) {
  char text[32];
  if (ms % 1000 == 0) {
    std::snprintf(text, sizeof(text), "%d s", ms / 1000);
  } else {
    std::snprintf(text, sizeof(text), "%.1f s", ms / 1000.0);
  }
  return text;
}

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(Socket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Socket& operator=(Socket&& other) noexcept {
    if (this != &other) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

// One coordinator's address of a target.
struct Endpoint {
  std::string given;  // as the target wrote it: "head:7070", "[::1]:7070", "unix:/run/c.sock"
  std::string host;   // "head", "::1"; the socket's path for unix:
  std::string port;
  bool unix_socket = false;
};

StatusOr<Endpoint> ParseEndpoint(const std::string& given) {
  Endpoint endpoint;
  endpoint.given = given;
  const size_t colon = given.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == given.size() ||
      (given.front() == '[' && given[colon - 1] != ']')) {
    return InvalidArgument("'" + given + "' is not HOST:PORT: give --coordinator HOST:PORT");
  }
  endpoint.host = given.substr(0, colon);
  endpoint.port = given.substr(colon + 1);
  if (endpoint.host.size() > 2 && endpoint.host.front() == '[' && endpoint.host.back() == ']') {
    endpoint.host = endpoint.host.substr(1, endpoint.host.size() - 2);
  }
  return endpoint;
}

// The addresses of a gRPC target as --coordinator takes it (see DiagnoseTransport).
StatusOr<std::vector<Endpoint>> ParseTarget(std::string target) {
  if (target.rfind("unix:", 0) == 0) {
    Endpoint endpoint;
    endpoint.given = target;
    endpoint.host = target.substr(std::strlen("unix:"));
    if (endpoint.host.rfind("//", 0) == 0) endpoint.host = endpoint.host.substr(2);  // unix:///abs/path
    endpoint.unix_socket = true;
    return std::vector<Endpoint>{endpoint};
  }
  for (const char* scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (target.rfind(scheme, 0) == 0) {
      target = target.substr(std::strlen(scheme));
      break;
    }
  }
  std::vector<Endpoint> endpoints;
  for (const std::string& one : SplitNonEmpty(target, ',')) {
    LTRAIN_ASSIGN_OR_RETURN(Endpoint endpoint, ParseEndpoint(one));
    endpoints.push_back(std::move(endpoint));
  }
  if (endpoints.empty()) return InvalidArgument("no coordinator address given: give --coordinator HOST:PORT");
  return endpoints;
}

std::string ConnectError(int error) {
  switch (error) {
    case ECONNREFUSED: return "connection refused";
    case ETIMEDOUT: return "timed out";
    case EHOSTUNREACH: return "no route to host";
    case ENETUNREACH: return "network unreachable";
    case ENOENT: return "no such socket file";
    default: return std::strerror(error);
  }
}

struct Connected {
  Socket socket;
  size_t endpoint = 0;  // the index of the endpoint that accepted
};

// A connection to whichever address of `endpoints` accepts first within `timeout_ms` (every one is
// dialled at once, so that a dead host ahead in a list delays nothing). nullopt when none does;
// `why` then says how each failed, in words.
std::optional<Connected> ConnectFirst(const std::vector<Endpoint>& endpoints, int timeout_ms, std::string* why) {
  struct Attempt {
    size_t endpoint;
    Socket socket;
    std::string failure;  // empty while the connect is under way
  };
  std::vector<Attempt> attempts;
  std::vector<std::string> failures(endpoints.size());
  for (size_t e = 0; e < endpoints.size(); ++e) {
    const Endpoint& endpoint = endpoints[e];
    std::vector<std::pair<sockaddr_storage, socklen_t>> addresses;
    if (endpoint.unix_socket) {
      sockaddr_un address{};
      address.sun_family = AF_UNIX;
      if (endpoint.host.size() >= sizeof(address.sun_path)) {
        failures[e] = "the socket path is too long";
        continue;
      }
      std::memcpy(address.sun_path, endpoint.host.data(), endpoint.host.size());
      sockaddr_storage storage{};
      std::memcpy(&storage, &address, sizeof(address));
      addresses.emplace_back(storage, static_cast<socklen_t>(sizeof(address)));
    } else {
      addrinfo hints{};
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* found = nullptr;
      if (const int rc = getaddrinfo(endpoint.host.c_str(), endpoint.port.c_str(), &hints, &found); rc != 0) {
        failures[e] = rc == EAI_NONAME || rc == EAI_NODATA
                          ? "no such host '" + endpoint.host + "'"
                          : "cannot resolve '" + endpoint.host + "': " + gai_strerror(rc);
        continue;
      }
      for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
        sockaddr_storage storage{};
        std::memcpy(&storage, a->ai_addr, a->ai_addrlen);
        addresses.emplace_back(storage, a->ai_addrlen);
      }
      freeaddrinfo(found);
    }
    for (const auto& [address, length] : addresses) {
      Attempt attempt{e, Socket(::socket(address.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)), ""};
      if (attempt.socket.fd() < 0) {
        attempt.failure = std::strerror(errno);
      } else if (::connect(attempt.socket.fd(), reinterpret_cast<const sockaddr*>(&address), length) == 0) {
        return Connected{std::move(attempt.socket), e};
      } else if (errno != EINPROGRESS) {
        attempt.failure = ConnectError(errno);
      }
      attempts.push_back(std::move(attempt));
    }
  }
  const SteadyTime deadline = After(timeout_ms);
  while (true) {
    std::vector<pollfd> polled;
    std::vector<size_t> which;
    for (size_t i = 0; i < attempts.size(); ++i) {
      if (!attempts[i].failure.empty()) continue;
      polled.push_back({attempts[i].socket.fd(), POLLOUT, 0});
      which.push_back(i);
    }
    if (polled.empty()) break;
    const int left = RemainingMs(deadline);
    if (left == 0) {
      for (size_t i : which) attempts[i].failure = "timed out after " + InSeconds(timeout_ms);
      break;
    }
    if (::poll(polled.data(), polled.size(), left) < 0 && errno != EINTR) {
      for (size_t i : which) attempts[i].failure = std::strerror(errno);
      break;
    }
    for (size_t k = 0; k < polled.size(); ++k) {
      if (polled[k].revents == 0) continue;
      Attempt& attempt = attempts[which[k]];
      int error = 0;
      socklen_t length = sizeof(error);
      if (getsockopt(attempt.socket.fd(), SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
      if (error == 0) return Connected{std::move(attempt.socket), attempt.endpoint};
      attempt.failure = ConnectError(error);
    }
  }
  // Each endpoint's failure is its first address's.
  for (const Attempt& attempt : attempts) {
    if (failures[attempt.endpoint].empty()) failures[attempt.endpoint] = attempt.failure;
  }
  if (endpoints.size() == 1) {
    *why = failures.front();
  } else {
    why->clear();
    for (size_t e = 0; e < endpoints.size(); ++e) {
      *why += (e ? "; " : "") + endpoints[e].given + ": " + failures[e];
    }
  }
  return std::nullopt;
}

// Sends all of `data` before `deadline`; false when the peer is gone or time ran out.
bool SendAll(int fd, const char* data, size_t size, SteadyTime deadline) {
  while (size > 0) {
    const ssize_t sent = ::send(fd, data, size, MSG_NOSIGNAL);
    if (sent > 0) {
      data += sent;
      size -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, RemainingMs(deadline)) <= 0) return false;
      continue;
    }
    return false;
  }
  return true;
}

enum class Received { kData, kClosed, kTimedOut };

// Waits for bytes until `deadline` and reads what is there into `out`.
Received ReceiveSome(int fd, SteadyTime deadline, std::string* out) {
  while (true) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, RemainingMs(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) return Received::kTimedOut;
    char buffer[16384];
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n > 0) {
      out->assign(buffer, static_cast<size_t>(n));
      return Received::kData;
    }
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    return Received::kClosed;  // an orderly close, or a reset
  }
}

// What an HTTP/2 client sends first: the connection preface and an empty SETTINGS frame.
const std::string& Http2Preface() {
  static const std::string preface = std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") +
                                     std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9);
  return preface;
}

// The first byte of a TLS record: change_cipher_spec, alert, handshake or application data. An HTTP/2
// frame starts with the high byte of its length, 0 for any frame a server sends first.
bool IsTlsRecord(unsigned char first_byte) { return first_byte >= 0x14 && first_byte <= 0x17; }

enum class PlainAnswer { kHttp2, kTls, kClosed, kTimedOut };

// Speaks HTTP/2 in clear text on `fd`, as a plaintext gRPC client does, and says what came back.
PlainAnswer ExchangePlaintext(int fd, int timeout_ms) {
  const SteadyTime deadline = After(timeout_ms);
  // A failed send is no answer yet: what the server sent before it closed is still to be read.
  SendAll(fd, Http2Preface().data(), Http2Preface().size(), deadline);
  std::string bytes;
  switch (ReceiveSome(fd, deadline, &bytes)) {
    case Received::kData:
      return IsTlsRecord(static_cast<unsigned char>(bytes[0])) ? PlainAnswer::kTls : PlainAnswer::kHttp2;
    case Received::kClosed: return PlainAnswer::kClosed;
    case Received::kTimedOut: return PlainAnswer::kTimedOut;
  }
  return PlainAnswer::kClosed;
}

// What a TLS client saw of the server.
struct TlsObservation {
  bool received = false;  // any byte from the server
  unsigned char first_byte = 0;
  bool closed = false;     // the server closed or reset the connection
  bool timed_out = false;  // it stopped answering
  bool handshake_done = false;
  bool certificate_requested = false;  // the server asked for a client certificate
  bool answered = false;               // HTTP/2 frames came back after the handshake
  long verify_result = X509_V_OK;      // the server certificate's, under the client's CA
  int alert = -1;                      // the fatal alert the server sent, if one
  std::string error;                   // OpenSSL's words for a failure
  std::string certificate_names;       // the server certificate's subject alternative names
  std::string setup_error;             // the client's own material could not be used
};

struct SslCtxFree {
  void operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }
};
struct SslFree {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};
struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* x509) const { X509_free(x509); }
};
struct KeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};

std::unique_ptr<BIO, BioFree> MemoryOf(const std::string& pem) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

std::vector<std::unique_ptr<X509, X509Free>> ReadCertificates(const std::string& pem) {
  std::vector<std::unique_ptr<X509, X509Free>> certificates;
  auto bio = MemoryOf(pem);
  while (X509* certificate = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    certificates.emplace_back(certificate);
  }
  ERR_clear_error();  // the end of the PEM text reads as an error
  return certificates;
}

// Loads the CA and the client's certificate and key into `ctx`; an error names what did not load.
std::string LoadClientMaterial(SSL_CTX* ctx, const SecurityMaterial& security, bool with_certificate) {
  if (!security.ca_pem.empty()) {
    auto authorities = ReadCertificates(security.ca_pem);
    if (authorities.empty()) return "the CA of --tls-ca holds no PEM certificate";
    for (const auto& authority : authorities) X509_STORE_add_cert(SSL_CTX_get_cert_store(ctx), authority.get());
  }
  if (!with_certificate || security.cert_pem.empty()) return "";
  auto chain = ReadCertificates(security.cert_pem);
  if (chain.empty() || SSL_CTX_use_certificate(ctx, chain.front().get()) != 1) {
    return "the certificate of --tls-cert is not a PEM certificate";
  }
  for (size_t i = 1; i < chain.size(); ++i) SSL_CTX_add1_chain_cert(ctx, chain[i].get());
  auto key_bio = MemoryOf(security.key_pem);
  std::unique_ptr<EVP_PKEY, KeyFree> key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (!key || SSL_CTX_use_PrivateKey(ctx, key.get()) != 1 || SSL_CTX_check_private_key(ctx) != 1) {
    ERR_clear_error();
    return "the key of --tls-key is not a PEM key of --tls-cert's certificate";
  }
  return "";
}

bool IsIpAddress(const std::string& host) {
  unsigned char address[sizeof(in6_addr)];
  return inet_pton(AF_INET, host.c_str(), address) == 1 || inet_pton(AF_INET6, host.c_str(), address) == 1;
}

// "DNS:head, IP:10.0.0.5": the names a certificate is for.
std::string SubjectAltNames(X509* certificate) {
  std::string names;
  auto* general = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(certificate, NID_subject_alt_name, nullptr, nullptr));
  if (general == nullptr) return names;
  for (int i = 0; i < sk_GENERAL_NAME_num(general); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(general, i);
    std::string one;
    if (name->type == GEN_DNS) {
      one = "DNS:" + std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(name->d.dNSName)),
                                 static_cast<size_t>(ASN1_STRING_length(name->d.dNSName)));
    } else if (name->type == GEN_IPADD) {
      char text[INET6_ADDRSTRLEN] = {0};
      const int length = ASN1_STRING_length(name->d.iPAddress);
      const unsigned char* bytes = ASN1_STRING_get0_data(name->d.iPAddress);
      if (length == 4 || length == 16) inet_ntop(length == 4 ? AF_INET : AF_INET6, bytes, text, sizeof(text));
      one = "IP:" + std::string(text);
    }
    if (!one.empty()) names += (names.empty() ? "" : ", ") + one;
  }
  GENERAL_NAMES_free(general);
  return names;
}

// The reason of the thread's last OpenSSL error, which is cleared.
std::string TakeOpenSslError() {
  std::string reason;
  while (const unsigned long error = ERR_get_error()) {
    if (const char* text = ERR_reason_error_string(error)) reason = text;
  }
  return reason;
}

// A TLS client over `fd` with OpenSSL, driven through memory buffers so that every byte the server
// sends is seen. `verify`: the server's certificate is checked against the client's CA and `host`
// (the result is recorded, never a reason to stop), and its certificate is offered. `talk`: after
// the handshake, the HTTP/2 preface goes out and the exchange lasts until the server answers.
TlsObservation ExchangeTls(int fd, const std::string& host, const SecurityMaterial& security, bool verify, bool talk,
                           int timeout_ms) {
  TlsObservation seen;
  ERR_clear_error();
  std::unique_ptr<SSL_CTX, SslCtxFree> ctx(SSL_CTX_new(TLS_client_method()));
  if (!ctx) {
    seen.setup_error = "cannot set up TLS: " + TakeOpenSslError();
    return seen;
  }
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_NONE, nullptr);
  if (verify) {
    seen.setup_error = LoadClientMaterial(ctx.get(), security, true);
    if (!seen.setup_error.empty()) return seen;
  }
  std::unique_ptr<SSL, SslFree> ssl(SSL_new(ctx.get()));
  BIO* in = BIO_new(BIO_s_mem());
  BIO* out = BIO_new(BIO_s_mem());
  if (!ssl || in == nullptr || out == nullptr) {
    BIO_free(in);
    BIO_free(out);
    seen.setup_error = "cannot set up TLS: " + TakeOpenSslError();
    return seen;
  }
  SSL_set_bio(ssl.get(), in, out);  // owned by `ssl` from here
  SSL_set_connect_state(ssl.get());
  static const unsigned char kAlpn[] = {2, 'h', '2'};
  SSL_set_alpn_protos(ssl.get(), kAlpn, sizeof(kAlpn));
  const bool ip = IsIpAddress(host);
  if (!ip && !host.empty()) SSL_set_tlsext_host_name(ssl.get(), host.c_str());
  if (verify) {
    if (ip) {
      X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl.get()), host.c_str());
    } else {
      SSL_set1_host(ssl.get(), host.c_str());
    }
  }
  SSL_set_app_data(ssl.get(), &seen);
  SSL_set_cert_cb(
      ssl.get(),
      [](SSL*, void* observation) {
        static_cast<TlsObservation*>(observation)->certificate_requested = true;
        return 1;
      },
      &seen);
  SSL_set_info_callback(ssl.get(), [](const SSL* s, int where, int value) {
    if ((where & SSL_CB_READ_ALERT) && (value >> 8) == SSL3_AL_FATAL) {
      static_cast<TlsObservation*>(SSL_get_app_data(s))->alert = value & 0xff;
    }
  });

  const SteadyTime deadline = After(timeout_ms);
  // What OpenSSL wrote goes to the server. A failed send is no answer yet: the server may have said
  // why before it closed, and what it said is still to be read.
  auto flush = [&]() {
    char buffer[16384];
    int n = 0;
    while ((n = BIO_read(out, buffer, sizeof(buffer))) > 0) {
      if (!SendAll(fd, buffer, static_cast<size_t>(n), deadline)) return;
    }
  };
  // What the server sends goes to OpenSSL; false when nothing more comes.
  auto receive = [&]() {
    std::string bytes;
    switch (ReceiveSome(fd, deadline, &bytes)) {
      case Received::kData:
        if (!seen.received) seen.first_byte = static_cast<unsigned char>(bytes[0]);
        seen.received = true;
        BIO_write(in, bytes.data(), static_cast<int>(bytes.size()));
        return true;
      case Received::kClosed: seen.closed = true; return false;
      case Received::kTimedOut: seen.timed_out = true; return false;
    }
    return false;
  };
  // One step of OpenSSL's: true to go on (it wants the server's next bytes, and they came).
  auto step = [&](int rc) {
    flush();
    const int error = SSL_get_error(ssl.get(), rc);
    if (error == SSL_ERROR_WANT_READ) return receive();
    if (error == SSL_ERROR_ZERO_RETURN) {
      seen.closed = true;
    } else {
      seen.error = TakeOpenSslError();
    }
    return false;
  };
  while (true) {
    const int rc = SSL_connect(ssl.get());
    if (rc == 1) {
      seen.handshake_done = true;
      break;
    }
    if (!step(rc)) break;
  }
  if (SSL_get0_peer_certificate(ssl.get()) != nullptr) {
    seen.verify_result = verify ? SSL_get_verify_result(ssl.get()) : X509_V_OK;
    seen.certificate_names = SubjectAltNames(SSL_get0_peer_certificate(ssl.get()));
  }
  if (seen.handshake_done && talk && seen.verify_result == X509_V_OK) {
    SSL_write(ssl.get(), Http2Preface().data(), static_cast<int>(Http2Preface().size()));
    while (true) {
      char buffer[1024];
      const int rc = SSL_read(ssl.get(), buffer, sizeof(buffer));
      if (rc > 0) {
        seen.answered = true;
        break;
      }
      if (!step(rc)) break;
    }
  }
  ERR_clear_error();
  return seen;
}

TransportDiagnosis Unreachable(const std::string& at, const std::string& why) {
  return {TransportFault::kUnreachable, "cannot reach the coordinator at " + at + ": " + why};
}

TransportDiagnosis ClosedWithoutAnswer(const std::string& at) {
  return Unreachable(at, "it accepted the connection and closed it without answering: nothing that speaks gRPC is "
                         "there, or it is shutting down");
}

TransportDiagnosis NoAnswer(const std::string& at, int timeout_ms) {
  return Unreachable(at, "it accepted the connection but did not answer within " + InSeconds(timeout_ms));
}

TransportDiagnosis ServerPlaintext(const std::string& at) {
  return {TransportFault::kServerPlaintext,
          "the coordinator at " + at + " serves no TLS: start it with --tls-cert and --tls-key, or connect without "
          "--tls-ca"};
}

TransportDiagnosis ServerTls(const std::string& at, bool wants_client_certificate) {
  return {TransportFault::kServerTls,
          "the coordinator at " + at + " serves TLS" +
              (wants_client_certificate ? " with client certificates (mutual TLS)" : "") +
              ": give its CA with --tls-ca FILE (or $LTRAIN_TLS_CA, or tls_ca in $LTRAIN_HOME/config.yaml)" +
              (wants_client_certificate ? ", and this client's certificate with --tls-cert and --tls-key" : "")};
}

TransportDiagnosis ServerCertificateRefused(const std::string& at, const std::string& host, const TlsObservation& tls) {
  const char* words = X509_verify_cert_error_string(tls.verify_result);
  switch (tls.verify_result) {
    case X509_V_ERR_HOSTNAME_MISMATCH:
    case X509_V_ERR_IP_ADDRESS_MISMATCH:
      return {TransportFault::kWrongHostName,
              "the certificate of the coordinator at " + at + " is not made for " + host +
                  (tls.certificate_names.empty() ? "" : " (it names " + tls.certificate_names + ")") +
                  ": make one that does with `ltrain coordinator --init-tls DIR --tls-hosts " + host +
                  " ...`, or give --coordinator a name it holds"};
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT:
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY:
    case X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE:
    case X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT:
    case X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN:
    case X509_V_ERR_CERT_SIGNATURE_FAILURE:  // a CA of the same name, but not the one that signed it
    case X509_V_ERR_UNABLE_TO_DECRYPT_CERT_SIGNATURE:
    case X509_V_ERR_UNABLE_TO_DECODE_ISSUER_PUBLIC_KEY:
    case X509_V_ERR_CERT_UNTRUSTED:
    case X509_V_ERR_CERT_REJECTED:
      return {TransportFault::kServerNotTrusted,
              "the coordinator at " + at + " is not trusted: its certificate is not signed by --tls-ca's CA (" +
                  words + "): give --tls-ca the CA that signed it (ca.pem of its `ltrain coordinator --init-tls` "
                  "directory)"};
    default:
      return {TransportFault::kServerNotTrusted,
              "the certificate of the coordinator at " + at + " is not valid: " + words +
                  ": give the coordinator a valid one (--tls-cert and --tls-key; `ltrain coordinator --init-tls` "
                  "writes a new set)"};
  }
}

// Whether the server's alert is about the client's certificate.
bool IsCertificateAlert(int alert) {
  switch (alert) {
    case SSL_AD_HANDSHAKE_FAILURE:
    case SSL_AD_BAD_CERTIFICATE:
    case SSL_AD_UNSUPPORTED_CERTIFICATE:
    case SSL_AD_CERTIFICATE_REVOKED:
    case SSL_AD_CERTIFICATE_EXPIRED:
    case SSL_AD_CERTIFICATE_UNKNOWN:
    case SSL_AD_UNKNOWN_CA:
    case SSL_AD_ACCESS_DENIED:
    case SSL_AD_DECRYPT_ERROR:
    case SSL_AD_CERTIFICATE_REQUIRED:
      return true;
    default:
      return false;
  }
}

TransportDiagnosis ClientCertificateRefused(const std::string& at, bool gave_certificate, int alert) {
  if (!gave_certificate) {
    return {TransportFault::kClientCertRequired,
            "the coordinator at " + at + " requires a client certificate (mutual TLS) that this client did not give "
            "(give --tls-cert and --tls-key)"};
  }
  const char* words = alert >= 0 ? SSL_alert_desc_string_long(alert) : nullptr;
  return {TransportFault::kClientCertRejected,
          "the coordinator at " + at + " does not accept this client's certificate" +
              (words != nullptr ? " (" + std::string(words) + ")" : "") +
              ": give --tls-cert and --tls-key a certificate signed by the CA of the coordinator's --tls-client-ca"};
}

std::optional<Socket> ConnectTo(const Endpoint& endpoint, int timeout_ms) {
  std::string why;
  std::optional<Connected> connected = ConnectFirst({endpoint}, timeout_ms, &why);
  if (!connected) return std::nullopt;
  return std::move(connected->socket);
}

// A client without --tls-ca speaks HTTP/2 in clear text: the server must too.
TransportDiagnosis DiagnosePlaintextClient(const Endpoint& endpoint, Socket socket, const SecurityMaterial& security,
                                           int timeout_ms) {
  const PlainAnswer answer = ExchangePlaintext(socket.fd(), timeout_ms);
  if (answer == PlainAnswer::kHttp2) return {};
  if (answer == PlainAnswer::kTimedOut) return NoAnswer(endpoint.given, timeout_ms);
  // A TLS server closes on clear text without a word (OpenSSL sends no alert to what is not TLS):
  // whether it is one, a handshake on a connection of its own tells.
  std::optional<Socket> again = ConnectTo(endpoint, timeout_ms);
  if (again) {
    const TlsObservation tls = ExchangeTls(again->fd(), endpoint.host, security, false, false, timeout_ms);
    if (tls.received && IsTlsRecord(tls.first_byte)) return ServerTls(endpoint.given, tls.certificate_requested);
  }
  if (answer == PlainAnswer::kTls) return ServerTls(endpoint.given, false);
  return ClosedWithoutAnswer(endpoint.given);
}

// A client with --tls-ca speaks TLS, checks the server's certificate against `host`, and offers its
// own certificate where it has one.
TransportDiagnosis DiagnoseTlsClient(const Endpoint& endpoint, const std::string& host, Socket socket,
                                     const SecurityMaterial& security, int timeout_ms) {
  const std::string& at = endpoint.given;
  const TlsObservation tls = ExchangeTls(socket.fd(), host, security, true, true, timeout_ms);
  if (!tls.setup_error.empty()) return {TransportFault::kUnknown, tls.setup_error};
  if (!tls.received) {
    if (tls.timed_out) return NoAnswer(at, timeout_ms);
    // A plaintext gRPC server sends its SETTINGS before it reads; closed without them, the server
    // may still be one that was quick to close: asked in its own language, it says so.
    std::optional<Socket> again = ConnectTo(endpoint, timeout_ms);
    if (again && ExchangePlaintext(again->fd(), timeout_ms) == PlainAnswer::kHttp2) return ServerPlaintext(at);
    return ClosedWithoutAnswer(at);
  }
  if (!IsTlsRecord(tls.first_byte)) return ServerPlaintext(at);
  if (tls.verify_result != X509_V_OK) return ServerCertificateRefused(at, host, tls);
  if (tls.answered) return {};
  const bool gave_certificate = !security.cert_pem.empty();
  // The server asked for a client certificate and then ended the connection: it wanted another one
  // (before TLS 1.3 within the handshake, since then right after it).
  if (tls.alert == SSL_AD_CERTIFICATE_REQUIRED ||
      (tls.certificate_requested && ((tls.alert >= 0 && IsCertificateAlert(tls.alert)) || tls.closed))) {
    return ClientCertificateRefused(at, gave_certificate, tls.alert);
  }
  if (tls.timed_out) {
    const char* how = tls.handshake_done ? "completed the TLS handshake" : "began the TLS handshake";
    return {TransportFault::kUnknown,
            "the coordinator at " + at + " " + how + " but did not answer within " + InSeconds(timeout_ms)};
  }
  std::string why = tls.alert >= 0 ? std::string("it sent the alert ") + SSL_alert_desc_string_long(tls.alert)
                    : !tls.error.empty() ? tls.error
                                         : "it closed the connection";
  return {TransportFault::kUnknown, "the TLS connection to the coordinator at " + at + " failed: " + why};
}

}  // namespace

TransportDiagnosis DiagnoseTransport(const std::string& target, const SecurityMaterial& security, int timeout_ms) {
  StatusOr<std::vector<Endpoint>> endpoints = ParseTarget(target);
  if (!endpoints.ok()) return {TransportFault::kUnknown, endpoints.status().message()};
  std::string why;
  std::optional<Connected> connected = ConnectFirst(*endpoints, timeout_ms, &why);
  if (!connected) return Unreachable(target, why);
  const Endpoint& endpoint = (*endpoints)[connected->endpoint];
  if (security.ca_pem.empty()) {
    return DiagnosePlaintextClient(endpoint, std::move(connected->socket), security, timeout_ms);
  }
  // gRPC names a channel by its first address: the name a certificate must hold (a unix socket's is
  // localhost).
  const std::string host = endpoints->front().unix_socket ? "localhost" : endpoints->front().host;
  return DiagnoseTlsClient(endpoint, host, std::move(connected->socket), security, timeout_ms);
}

}  // namespace ltrain
