// TLS and bearer tokens for every gRPC channel between the CLI, the agents and the coordinator.
// Servers take a certificate (and, for mutual TLS, the CA that signs client certificates); clients
// take the CA that signs the server's certificate (and their own certificate for mutual TLS). A
// bearer token, read from a file or the environment, rides on every call as "authorization:
// Bearer ..."; it is never logged or printed. Every coordinator requires a token (one started
// without keeps a new one in its state directory, token, 0600); a coordinator serves beyond
// loopback in plain text only when told --insecure. Without TLS, channels are plaintext.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <grpcpp/grpcpp.h>

#include "common/status.h"

namespace ltrain {

struct SecurityOptions {
  std::string tls_ca;         // client: PEM file of the CA that signed the server; empty: plaintext
  std::string tls_cert;       // server: its certificate; client: its own, for mutual TLS
  std::string tls_key;
  std::string tls_client_ca;  // server: require client certificates signed by this CA (mutual TLS)
  std::string token_file;     // the bearer token's file; LTRAIN_TOKEN overrides, LTRAIN_TOKEN_FILE stands in
  // Read when no token is given otherwise and the file is there: $LTRAIN_HOME/token, where a
  // coordinator started without a token by this user keeps the one it made.
  std::string default_token_file;
  // client: send the token in clear text to a non-loopback address; coordinator: serve without TLS
  // beyond loopback (LTRAIN_INSECURE=1)
  bool insecure = false;
};

// The security material, read from its files. Errors name the file.
struct SecurityMaterial {
  std::string ca_pem, cert_pem, key_pem, client_ca_pem;
  std::string token;
  bool token_by_default = false;  // the token came from SecurityOptions::default_token_file
  bool insecure = false;          // SecurityOptions::insecure
  bool tls() const { return !ca_pem.empty() || !cert_pem.empty(); }
};

// Fills empty options from LTRAIN_TLS_CA, LTRAIN_TLS_CERT, LTRAIN_TLS_KEY, LTRAIN_TLS_CLIENT_CA and
// LTRAIN_TOKEN_FILE, reads every file, and takes LTRAIN_TOKEN as the token when set.
StatusOr<SecurityMaterial> LoadSecurity(SecurityOptions options);

// Whether HOST:PORT (or HOST) is on loopback: 127.0.0.0/8, ::1, localhost.
bool IsLoopbackAddress(const std::string& address);

// The token of a coordinator started without one: the one in `path` when it is there (a regular
// file of this user's that no one else may read), else a new one written there, 0600. Errors name
// the file and the fix.
StatusOr<std::string> LoadOrCreateTokenFile(const std::string& path);

// Whether a client may send its token to `target`: always over TLS (a CA given) or to loopback;
// in clear text elsewhere only with `insecure`, since anyone on the path could read it. The error
// says what to pass.
Status CheckTokenTransport(const std::string& target, const SecurityMaterial& security);

// A channel to `target`. A token that CheckTokenTransport refuses is not sent (the refusal is
// logged, and the server answers UNAUTHENTICATED). `target` may list several coordinators,
// HOST:PORT,HOST:PORT,...: the channel connects to all of them and reaches whichever listens (the
// leader; standbys do not listen), and the next leader once it listens. A certificate
// must then name the first host.

// The gRPC target of a list of HOST:PORT (ipv4: or ipv6: addresses, resolved now), or `target`
// itself when it is one address. Sets on `args` what a list needs. An unknown host is an error.
StatusOr<std::string> ListTarget(const std::string& target, grpc::ChannelArguments* args);
// `args`: more channel arguments (a connection of its own, say).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const SecurityMaterial& security,
                                           grpc::ChannelArguments args = {});
// A client's credentials: TLS against `ca_pem` (with its own certificate where `cert_pem` is given,
// for mutual TLS), or plaintext without a CA.
std::shared_ptr<grpc::ChannelCredentials> ClientCredentials(const std::string& ca_pem, const std::string& cert_pem,
                                                            const std::string& key_pem);
// Why a channel fails on the wire (nothing listens, TLS on one side only, a certificate not
// accepted): DiagnoseTransport in common/transport_probe.h.

// A new random bearer token: 40 hex digits (160 bits) from the system's random source.
std::string NewToken();
// Whether two secrets are equal, in a time that does not depend on where they differ.
bool SameSecret(std::string_view a, std::string_view b);
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const SecurityMaterial& security);

// For server handlers: OK when no token is configured or the call carries it; UNAUTHENTICATED
// otherwise (compared in constant time).
grpc::Status CheckBearerToken(const grpc::ServerContextBase& context, const std::string& token);

// Writes a CA, a server certificate for `hosts` (host names and IP addresses), a client
// certificate and a random token into `dir`, with openssl, for a first try of TLS.
Status InitTls(const std::string& dir, const std::vector<std::string>& hosts);

}  // namespace ltrain
