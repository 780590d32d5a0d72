#include "common/transport_security.h"

#include <fcntl.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

#include <grpcpp/support/client_interceptor.h>

#include "common/files.h"
#include "common/logging.h"
#include "common/strings.h"

namespace ltrain {
namespace {

StatusOr<std::string> ReadWhole(const std::string& path, const char* what) {
  StatusOr<std::string> text = ReadFileText(path);
  if (!text.ok()) return InvalidArgument("cannot read the " + std::string(what) + " file " + path);
  return text;
}

std::string FromEnv(const std::string& current, const char* name) {
  if (!current.empty()) return current;
  const char* value = std::getenv(name);
  return value ? value : "";
}

std::string Trim(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.pop_back();
  return text;
}

// Adds the bearer token to every call of a channel.
class TokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string& header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", header_});
    }
    methods->Proceed();
  }

 private:
  const std::string& header_;
};

class TokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string token) : header_("Bearer " + std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(header_);
  }

 private:
  std::string header_;
};

Status Run(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  std::vector<std::string> copy = argv;
  for (auto& a : copy) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) {
      dup2(devnull, STDOUT_FILENO);
      dup2(devnull, STDERR_FILENO);
    }
    execvp(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Internal("`" + argv[0] + " " + argv[1] + "` failed (is openssl installed?)");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<SecurityMaterial> LoadSecurity(SecurityOptions options) {
  options.tls_ca = FromEnv(options.tls_ca, "LTRAIN_TLS_CA");
  options.tls_cert = FromEnv(options.tls_cert, "LTRAIN_TLS_CERT");
  options.tls_key = FromEnv(options.tls_key, "LTRAIN_TLS_KEY");
  options.tls_client_ca = FromEnv(options.tls_client_ca, "LTRAIN_TLS_CLIENT_CA");
  options.token_file = FromEnv(options.token_file, "LTRAIN_TOKEN_FILE");
  SecurityMaterial material;
  auto read = [](const std::string& path, const char* what, std::string* out) -> Status {
    if (path.empty()) return Status::Ok();
    LTRAIN_ASSIGN_OR_RETURN(std::string text, ReadWhole(path, what));
    *out = std::move(text);
    return Status::Ok();
  };
  for (auto [path, what, out] : {std::tuple{&options.tls_ca, "TLS CA", &material.ca_pem},
                                 std::tuple{&options.tls_cert, "TLS certificate", &material.cert_pem},
                                 std::tuple{&options.tls_key, "TLS key", &material.key_pem},
                                 std::tuple{&options.tls_client_ca, "TLS client CA", &material.client_ca_pem},
                                 std::tuple{&options.token_file, "token", &material.token}}) {
    LTRAIN_RETURN_IF_ERROR(read(*path, what, out));
  }
  if (material.cert_pem.empty() != material.key_pem.empty()) {
    return InvalidArgument("a TLS certificate needs its key and a key its certificate: pass both --tls-cert and --tls-key");
  }
  material.token = Trim(material.token);
  if (const char* token = std::getenv("LTRAIN_TOKEN"); token && *token) material.token = token;
  std::error_code ec;
  if (material.token.empty() && !options.default_token_file.empty() &&
      std::filesystem::exists(options.default_token_file, ec)) {
    LTRAIN_RETURN_IF_ERROR(read(options.default_token_file, "token", &material.token));
    material.token = Trim(material.token);
    material.token_by_default = !material.token.empty();
  }
  const char* insecure = std::getenv("LTRAIN_INSECURE");
  material.insecure = options.insecure || (insecure != nullptr && std::string(insecure) == "1");
  return material;
}

namespace {

// "localhost:7070", "127.0.0.1:7070", "[::1]:7070", "unix:/path", "ipv4:127.0.0.1:7070".
bool IsLoopbackOne(std::string target) {
  if (target.rfind("unix:", 0) == 0) return true;
  for (const char* scheme : {"ipv4:", "ipv6:", "dns:///", "dns:"}) {
    if (target.rfind(scheme, 0) == 0) target = target.substr(std::strlen(scheme));
  }
  std::string host = target;
  if (!host.empty() && host[0] == '[') {
    host = host.substr(1, host.find(']') == std::string::npos ? std::string::npos : host.find(']') - 1);
  } else if (host.find(':') != std::string::npos && host.find(':') == host.rfind(':')) {
    host = host.substr(0, host.find(':'));
  }
  const bool ipv4_loopback =
      host.rfind("127.", 0) == 0 && host.find_first_not_of("0123456789.") == std::string::npos;
  return host == "localhost" || host == "::1" || ipv4_loopback;
}

}  // namespace

bool IsLoopbackAddress(const std::string& address) { return IsLoopbackOne(address); }

StatusOr<std::string> LoadOrCreateTokenFile(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      return FailedPrecondition(path + " is not a regular file (a link or another kind): remove it, and the "
                                "coordinator makes a new token there");
    }
    if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
      return FailedPrecondition("the token file " + path + " may be read by others (mode " +
                                std::to_string((st.st_mode >> 6) & 7) + std::to_string((st.st_mode >> 3) & 7) +
                                std::to_string(st.st_mode & 7) + ", or another owner): `chmod 600 " + path +
                                "`, or remove it for a new one");
    }
    LTRAIN_ASSIGN_OR_RETURN(std::string token, ReadWhole(path, "token"));
    token = Trim(token);
    if (token.size() < 16) return FailedPrecondition("the token file " + path + " holds fewer than 16 characters");
    return token;
  }
  std::string token = NewToken();
  LTRAIN_ASSIGN_OR_RETURN(int fd, OpenForWriting(path, O_EXCL, 0600));
  Status written = WriteAll(fd, token + "\n", path);
  ::close(fd);
  if (!written.ok()) {
    ::unlink(path.c_str());
    return written;
  }
  return token;
}

namespace {

// Every address of a list ("HOST:PORT,HOST:PORT", or gRPC's "ipv4:A:P,A:P") is on loopback.
bool IsLoopbackTarget(const std::string& target) {
  if (target.find(',') == std::string::npos) return IsLoopbackOne(target);
  std::string list = target;
  for (const char* scheme : {"ipv4:", "ipv6:"}) {
    if (list.rfind(scheme, 0) == 0) list = list.substr(std::strlen(scheme));
  }
  for (const std::string& one : SplitNonEmpty(list, ',')) {
    if (!IsLoopbackOne(one)) return false;
  }
  return true;
}

}  // namespace

Status CheckTokenTransport(const std::string& target, const SecurityMaterial& security) {
  if (security.token.empty() || !security.ca_pem.empty() || security.insecure || IsLoopbackTarget(target)) {
    return Status::Ok();
  }
  return FailedPrecondition("refusing to send the token to " + target +
                            " in clear text: anyone on the way could read it; give the CA of the coordinator's "
                            "certificate (--tls-ca or LTRAIN_TLS_CA) to use TLS, or pass --insecure "
                            "(LTRAIN_INSECURE=1) on a network you trust");
}

StatusOr<std::string> ListTarget(const std::string& target, grpc::ChannelArguments* args) {
  if (target.find(',') == std::string::npos || target.find(':') == std::string::npos) return target;
  if (target.rfind("ipv4:", 0) == 0 || target.rfind("ipv6:", 0) == 0) return target;
  // Every address of every host, IPv4 first; one scheme for all (IPv4 ones mapped when any host
  // has IPv6 only).
  std::vector<std::pair<std::string, std::string>> v4, v6;  // address, port
  for (const std::string& one : SplitNonEmpty(target, ',')) {
    size_t colon = one.rfind(':');
    if (colon == std::string::npos || colon == 0) return InvalidArgument("'" + one + "' in '" + target + "' is not HOST:PORT");
    std::string host = one.substr(0, colon);
    const std::string port = one.substr(colon + 1);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
      return InvalidArgument("cannot resolve '" + host + "' of '" + target + "': " + gai_strerror(rc));
    }
    bool any_v4 = false;
    std::vector<std::pair<std::string, std::string>> own_v6;
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      char text[INET6_ADDRSTRLEN] = {0};
      if (a->ai_family == AF_INET) {
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text, sizeof(text));
        if (!any_v4) v4.emplace_back(text, port);  // one address a host: the first
        any_v4 = true;
      } else if (a->ai_family == AF_INET6 && own_v6.empty()) {
        inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text, sizeof(text));
        own_v6.emplace_back(text, port);
      }
    }
    freeaddrinfo(found);
    if (!any_v4) v6.insert(v6.end(), own_v6.begin(), own_v6.end());
  }
  std::string list;
  if (v6.empty()) {
    for (const auto& [address, port] : v4) list += (list.empty() ? "ipv4:" : ",") + address + ":" + port;
  } else {
    for (const auto& [address, port] : v4) list += (list.empty() ? "ipv6:" : ",") + ("[::ffff:" + address + "]:") + port;
    for (const auto& [address, port] : v6) list += (list.empty() ? "ipv6:" : ",") + ("[" + address + "]:") + port;
  }
  // The first coordinator names the channel (and is the name a certificate must carry). Every
  // address is connected to at once and the calls go to those that accept, the leader alone (a
  // standby does not listen): a dead host ahead in the list delays nothing. A connect gives up after
  // 2 s, and one that broke is tried again soon.
  args->SetString(GRPC_ARG_DEFAULT_AUTHORITY, SplitNonEmpty(target, ',').front());
  args->SetLoadBalancingPolicyName("round_robin");
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 2000);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  return list;
}

std::shared_ptr<grpc::ChannelCredentials> ClientCredentials(const std::string& ca_pem, const std::string& cert_pem,
                                                            const std::string& key_pem) {
  if (ca_pem.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ca_pem;
  ssl.pem_cert_chain = cert_pem;
  ssl.pem_private_key = key_pem;
  return grpc::SslCredentials(ssl);
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& given, const SecurityMaterial& security,
                                           grpc::ChannelArguments args) {
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      ClientCredentials(security.ca_pem, security.cert_pem, security.key_pem);
  // Control-plane messages are small and steady: no bandwidth-delay probes (a ping after each).
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  StatusOr<std::string> listed = ListTarget(given, &args);
  if (!listed.ok()) LTRAIN_LOG(kError, "rpc") << listed.status().message();
  const std::string target = listed.ok() ? *listed : given;
  if (Status clear = CheckTokenTransport(target, security); !clear.ok()) {
    LTRAIN_LOG(kError, "tls") << clear.message();
    return grpc::CreateCustomChannel(target, credentials, args);
  }
  if (security.token.empty()) return grpc::CreateCustomChannel(target, credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<TokenInterceptorFactory>(security.token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, credentials, args, std::move(interceptors));
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const SecurityMaterial& security) {
  if (security.cert_pem.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(security.client_ca_pem.empty()
                                            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = security.client_ca_pem;
  ssl.pem_key_cert_pairs.push_back({security.key_pem, security.cert_pem});
  return grpc::SslServerCredentials(ssl);
}

grpc::Status CheckBearerToken(const grpc::ServerContextBase& context, const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  const std::string expected = "Bearer " + token;
  auto found = context.client_metadata().find("authorization");
  if (found != context.client_metadata().end() &&
      SameSecret(std::string_view(found->second.data(), found->second.size()), expected)) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      found == context.client_metadata().end()
                          ? "this coordinator requires a bearer token: pass --token-file FILE or set LTRAIN_TOKEN (a "
                            "coordinator started without one keeps the one it made in its state directory, token; "
                            "its user's commands on its host read $LTRAIN_HOME/token by default)"
                          : "the bearer token was not accepted: check --token-file or LTRAIN_TOKEN");
}

bool SameSecret(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string NewToken() {
  std::random_device random;
  const char* hex = "0123456789abcdef";
  std::string token;
  for (int i = 0; i < 40; ++i) token += hex[random() % 16];
  return token;
}

Status InitTls(const std::string& dir, const std::vector<std::string>& hosts) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (Status made = CreateDirectories(dir); !made.ok()) return InvalidArgument(made.message());
  auto path = [&](const char* name) { return (fs::path(dir) / name).string(); };
  // Never over files a deployment already uses: clients trust the CA, and a new one would lock them
  // out. A symbolic link counts as a file there (it is never followed, dangling or not).
  std::string present;
  for (const char* name : {"ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key", "token"}) {
    if (fs::symlink_status(path(name), ec).type() != fs::file_type::not_found) {
      present += (present.empty() ? "" : ", ") + std::string(name);
    }
  }
  if (!present.empty()) {
    return FailedPrecondition(dir + " already holds " + present +
                              ": --init-tls never overwrites them (clients trust that CA); remove them first or "
                              "choose another directory");
  }
  // Keys and the token are private from the moment they exist: every file is created 0600 (openssl
  // inherits the mask), in a directory of this call's own (0700, a new name: nothing planted can be
  // in it), and renamed into `dir` at the end (a rename replaces a name, never follows it). The
  // public certificates are opened up afterwards.
  const mode_t old_mask = ::umask(077);
  struct RestoreMask {
    mode_t mask;
    ~RestoreMask() { ::umask(mask); }
  } restore{old_mask};
  std::string scratch_template = path(".init-tls-XXXXXX");
  if (::mkdtemp(scratch_template.data()) == nullptr) {
    return InvalidArgument("cannot create a directory in " + dir + ": " + std::strerror(errno));
  }
  const std::string scratch = scratch_template;
  struct RemoveScratch {
    std::string dir;
    ~RemoveScratch() { RemoveTree(dir); }
  } remove_scratch{scratch};
  auto work = [&](const char* name) { return (fs::path(scratch) / name).string(); };
  std::string san = "subjectAltName=";
  for (size_t i = 0; i < hosts.size(); ++i) {
    bool ip = hosts[i].find_first_not_of("0123456789.") == std::string::npos || hosts[i].find(':') != std::string::npos;
    san += (i ? "," : "") + std::string(ip ? "IP:" : "DNS:") + hosts[i];
  }
  const std::vector<std::vector<std::string>> steps = {
      {"openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "825",
       "-subj", "/CN=ltrain CA", "-keyout", work("ca.key"), "-out", work("ca.pem")},
      {"openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj",
       "/CN=ltrain coordinator", "-keyout", work("server.key"), "-out", work("server.csr")},
      {"openssl", "x509", "-req", "-in", work("server.csr"), "-CA", work("ca.pem"), "-CAkey", work("ca.key"),
       "-CAcreateserial", "-days", "825", "-extfile", work("server.ext"), "-out", work("server.pem")},
      {"openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj",
       "/CN=ltrain client", "-keyout", work("client.key"), "-out", work("client.csr")},
      {"openssl", "x509", "-req", "-in", work("client.csr"), "-CA", work("ca.pem"), "-CAkey", work("ca.key"),
       "-CAcreateserial", "-days", "825", "-out", work("client.pem")},
  };
  LTRAIN_RETURN_IF_ERROR(WriteFileText(work("server.ext"), san + "\n"));
  for (const auto& step : steps) {
    LTRAIN_RETURN_IF_ERROR(Run(step));
  }
  LTRAIN_RETURN_IF_ERROR(WriteFileText(work("token"), NewToken() + "\n", 0600));
  for (const char* certificate : {"ca.pem", "server.pem", "client.pem"}) ::chmod(work(certificate).c_str(), 0644);
  for (const char* name : {"ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key", "token"}) {
    // RENAME_NOREPLACE: a name that appeared in `dir` meanwhile is kept, and this call fails.
    if (::renameat2(AT_FDCWD, work(name).c_str(), AT_FDCWD, path(name).c_str(), RENAME_NOREPLACE) != 0) {
      return FailedPrecondition("cannot move " + std::string(name) + " into " + dir + ": " + std::strerror(errno));
    }
  }
  return Status::Ok();
}

}  // namespace ltrain
