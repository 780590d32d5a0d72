// What DiagnoseTransport names when a client cannot talk with a coordinator: one cause each, against
// in-process gRPC servers on loopback (port 0, milliseconds) and sockets that accept and close.
#include "common/transport_probe.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <thread>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include "common/files.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

// A socket bound to a loopback port; listening or not.
class LoopbackSocket {
 public:
  explicit LoopbackSocket(bool listen) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&address), length), 0);
    EXPECT_EQ(::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length), 0);
    port_ = ntohs(address.sin_port);
    if (listen) {
      EXPECT_EQ(::listen(fd_, 16), 0);
    }
  }
  ~LoopbackSocket() { ::close(fd_); }
  int fd() const { return fd_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_;
  int port_ = 0;
};

// Accepts every connection and closes it at once, without a byte.
class Slammer {
 public:
  Slammer() : socket_(true), thread_([this] {
    while (true) {
      const int fd = ::accept(socket_.fd(), nullptr, nullptr);
      if (fd < 0) return;  // shut down
      ::close(fd);
    }
  }) {}
  ~Slammer() {
    ::shutdown(socket_.fd(), SHUT_RDWR);  // ends the accept
    thread_.join();
  }
  std::string address() const { return socket_.address(); }

 private:
  LoopbackSocket socket_;
  std::thread thread_;
};

// A gRPC server with no methods (every call is UNIMPLEMENTED): the transport is all that is tested.
class Server {
 public:
  explicit Server(std::shared_ptr<grpc::ServerCredentials> credentials) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", credentials, &port);
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
    EXPECT_GT(port, 0);
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  ~Server() { server_->Shutdown(std::chrono::system_clock::now()); }
  const std::string& address() const { return address_; }

 private:
  grpc::CallbackGenericService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

struct Pem {
  std::string ca, server_cert, server_key, client_cert, client_key;
};

class TransportProbeTest : public ::testing::Test {
 protected:
  // Three sets from InitTls: the coordinator's, another CA's, and one for another host's name.
  static void SetUpTestSuite() {
    std::string pattern = (fs::path(::testing::TempDir()) / "transport-probe-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = new std::string(pattern);
    ours_ = new Pem(Make("ours", {"127.0.0.1", "localhost"}));
    other_ = new Pem(Make("other", {"127.0.0.1"}));
    elsewhere_ = new Pem(Make("elsewhere", {"other.example"}));
  }
  static void TearDownTestSuite() {
    RemoveTree(*dir_);
    delete dir_;
    delete ours_;
    delete other_;
    delete elsewhere_;
  }

  static Pem Make(const std::string& name, const std::vector<std::string>& hosts) {
    const std::string dir = *dir_ + "/" + name;
    Status made = InitTls(dir, hosts);
    EXPECT_TRUE(made.ok()) << made.message();
    auto read = [&](const char* file) {
      StatusOr<std::string> text = ReadFileText(dir + "/" + file);
      EXPECT_TRUE(text.ok()) << file;
      return text.ok() ? *text : "";
    };
    return {read("ca.pem"), read("server.pem"), read("server.key"), read("client.pem"), read("client.key")};
  }

  // A TLS server with `pem`'s certificate; mutual TLS when `client_ca` is given.
  static std::shared_ptr<grpc::ServerCredentials> Tls(const Pem& pem, const std::string& client_ca = "") {
    SecurityMaterial server;
    server.cert_pem = pem.server_cert;
    server.key_pem = pem.server_key;
    server.client_ca_pem = client_ca;
    return MakeServerCredentials(server);
  }

  // A client that trusts `ca`, with the client certificate of `certificate` where given.
  static SecurityMaterial Client(const std::string& ca, const Pem* certificate = nullptr) {
    SecurityMaterial client;
    client.ca_pem = ca;
    if (certificate != nullptr) {
      client.cert_pem = certificate->client_cert;
      client.key_pem = certificate->client_key;
    }
    return client;
  }

  static std::string* dir_;
  static Pem* ours_;
  static Pem* other_;
  static Pem* elsewhere_;
};

std::string* TransportProbeTest::dir_ = nullptr;
Pem* TransportProbeTest::ours_ = nullptr;
Pem* TransportProbeTest::other_ = nullptr;
Pem* TransportProbeTest::elsewhere_ = nullptr;

// Every message names one cause, never a list of them.
void ExpectOneCause(const TransportDiagnosis& diagnosis) {
  EXPECT_EQ(diagnosis.message.find("either"), std::string::npos) << diagnosis.message;
  EXPECT_EQ(diagnosis.message.find(", or it"), std::string::npos) << diagnosis.message;
}

TEST_F(TransportProbeTest, NothingListeningIsUnreachableAndSaysConnectionRefused) {
  LoopbackSocket bound(false);  // a port of this test's that takes no connections
  for (const SecurityMaterial& client : {SecurityMaterial{}, Client(ours_->ca)}) {
    const TransportDiagnosis diagnosis = DiagnoseTransport(bound.address(), client);
    EXPECT_EQ(diagnosis.fault, TransportFault::kUnreachable);
    EXPECT_EQ(diagnosis.message, "cannot reach the coordinator at " + bound.address() + ": connection refused");
  }
}

TEST_F(TransportProbeTest, AListIsUnreachableOnlyWhenEveryAddressIs) {
  LoopbackSocket first(false), second(false);
  const TransportDiagnosis none = DiagnoseTransport(first.address() + "," + second.address(), SecurityMaterial{});
  EXPECT_EQ(none.fault, TransportFault::kUnreachable);
  EXPECT_NE(none.message.find(first.address() + ": connection refused; " + second.address() + ": connection refused"),
            std::string::npos)
      << none.message;

  Server tls(Tls(*ours_));
  EXPECT_EQ(DiagnoseTransport(first.address() + "," + tls.address(), Client(ours_->ca)).fault, TransportFault::kNone);
  const TransportDiagnosis plain =
      DiagnoseTransport("ipv4:" + first.address() + "," + tls.address(), SecurityMaterial{});
  EXPECT_EQ(plain.fault, TransportFault::kServerTls) << plain.message;
  EXPECT_NE(plain.message.find("the coordinator at " + tls.address() + " serves TLS"), std::string::npos)
      << "the address that answered is named\n" << plain.message;
}

TEST_F(TransportProbeTest, AServerThatClosesAtOnceIsUnreachable) {
  Slammer slammer;
  for (const SecurityMaterial& client : {SecurityMaterial{}, Client(ours_->ca)}) {
    const TransportDiagnosis diagnosis = DiagnoseTransport(slammer.address(), client);
    EXPECT_EQ(diagnosis.fault, TransportFault::kUnreachable) << diagnosis.message;
    EXPECT_NE(diagnosis.message.find("closed it without answering"), std::string::npos) << diagnosis.message;
    EXPECT_EQ(diagnosis.message.find("TLS"), std::string::npos) << diagnosis.message;
  }
}

TEST_F(TransportProbeTest, MatchingEndsAreFine) {
  Server plain(grpc::InsecureServerCredentials());
  EXPECT_EQ(DiagnoseTransport(plain.address(), SecurityMaterial{}).fault, TransportFault::kNone);
  Server tls(Tls(*ours_));
  EXPECT_EQ(DiagnoseTransport(tls.address(), Client(ours_->ca)).message, "");
  EXPECT_EQ(DiagnoseTransport(tls.address(), Client(ours_->ca, ours_)).message, "")
      << "a certificate the server did not ask for is no fault";
  Server mutual(Tls(*ours_, ours_->ca));
  EXPECT_EQ(DiagnoseTransport(mutual.address(), Client(ours_->ca, ours_)).message, "");
}

TEST_F(TransportProbeTest, TlsOnOneSideOnlyIsNamed) {
  Server plain(grpc::InsecureServerCredentials());
  const TransportDiagnosis no_tls = DiagnoseTransport(plain.address(), Client(ours_->ca, ours_));
  EXPECT_EQ(no_tls.fault, TransportFault::kServerPlaintext) << no_tls.message;
  EXPECT_EQ(no_tls.message, "the coordinator at " + plain.address() +
                                " serves no TLS: start it with --tls-cert and --tls-key, or connect without --tls-ca");

  Server tls(Tls(*ours_));
  const TransportDiagnosis tls_only = DiagnoseTransport(tls.address(), SecurityMaterial{});
  EXPECT_EQ(tls_only.fault, TransportFault::kServerTls) << tls_only.message;
  EXPECT_NE(tls_only.message.find("serves TLS: give its CA with --tls-ca FILE"), std::string::npos) << tls_only.message;
  EXPECT_EQ(tls_only.message.find("--tls-cert"), std::string::npos) << "it asks for no client certificate";
  ExpectOneCause(tls_only);

  Server mutual(Tls(*ours_, ours_->ca));
  const TransportDiagnosis mutual_only = DiagnoseTransport(mutual.address(), SecurityMaterial{});
  EXPECT_EQ(mutual_only.fault, TransportFault::kServerTls) << mutual_only.message;
  EXPECT_NE(
      mutual_only.message.find("serves TLS with client certificates (mutual TLS): give its CA with --tls-ca FILE"),
      std::string::npos)
      << mutual_only.message;
  EXPECT_NE(mutual_only.message.find("--tls-cert and --tls-key"), std::string::npos) << mutual_only.message;
}

TEST_F(TransportProbeTest, AServerCertificateOfAnotherCaIsNotTrusted) {
  Server tls(Tls(*ours_));
  const TransportDiagnosis diagnosis = DiagnoseTransport(tls.address(), Client(other_->ca));
  EXPECT_EQ(diagnosis.fault, TransportFault::kServerNotTrusted) << diagnosis.message;
  EXPECT_NE(diagnosis.message.find("its certificate is not signed by --tls-ca's CA"), std::string::npos)
      << diagnosis.message;
  EXPECT_EQ(diagnosis.message.find("host"), std::string::npos) << diagnosis.message;
  ExpectOneCause(diagnosis);
}

TEST_F(TransportProbeTest, AServerCertificateForAnotherHostNamesBoth) {
  Server tls(Tls(*elsewhere_));
  const TransportDiagnosis diagnosis = DiagnoseTransport(tls.address(), Client(elsewhere_->ca));
  EXPECT_EQ(diagnosis.fault, TransportFault::kWrongHostName) << diagnosis.message;
  EXPECT_NE(diagnosis.message.find("is not made for 127.0.0.1 (it names DNS:other.example)"), std::string::npos)
      << diagnosis.message;
  EXPECT_NE(diagnosis.message.find("--tls-hosts 127.0.0.1"), std::string::npos) << diagnosis.message;
  ExpectOneCause(diagnosis);
}

TEST_F(TransportProbeTest, MutualTlsNamesAMissingOrRefusedClientCertificate) {
  Server mutual(Tls(*ours_, ours_->ca));
  const TransportDiagnosis missing = DiagnoseTransport(mutual.address(), Client(ours_->ca));
  EXPECT_EQ(missing.fault, TransportFault::kClientCertRequired) << missing.message;
  EXPECT_NE(missing.message.find("requires a client certificate (mutual TLS) that this client did not give (give "
                                 "--tls-cert and --tls-key)"),
            std::string::npos)
      << missing.message;
  ExpectOneCause(missing);

  const TransportDiagnosis refused = DiagnoseTransport(mutual.address(), Client(ours_->ca, other_));
  EXPECT_EQ(refused.fault, TransportFault::kClientCertRejected) << refused.message;
  EXPECT_NE(refused.message.find("does not accept this client's certificate"), std::string::npos) << refused.message;
  ExpectOneCause(refused);
}

TEST_F(TransportProbeTest, AnAddressWithoutAPortIsSaidSo) {
  const TransportDiagnosis diagnosis = DiagnoseTransport("head", SecurityMaterial{});
  EXPECT_EQ(diagnosis.fault, TransportFault::kUnknown);
  EXPECT_NE(diagnosis.message.find("'head' is not HOST:PORT"), std::string::npos) << diagnosis.message;
}

}  // namespace
}  // namespace ltrain
