// Why a client cannot talk to a coordinator, found out on the wire: whether anything accepts a TCP
// connection at its address, and if so whether the two ends agree on TLS, on the server's
// certificate and on the client's. Called by the agent before it starts and when it loses the
// coordinator, and by the CLI when a call failed with UNAVAILABLE; any thread, no state. It opens
// one or two short connections of its own (a TLS handshake with OpenSSL, or the HTTP/2 preface in
// clear text) and closes them: a coordinator sees a client that came and went.
#pragma once

#include <string>

#include "common/transport_security.h"

namespace ltrain {

enum class TransportFault {
  kNone,                // the transport works (a failed call failed for another reason)
  kUnreachable,         // nothing accepts connections there, or what does never answers
  kServerPlaintext,     // the client speaks TLS (--tls-ca), the server does not
  kServerTls,           // the server speaks TLS, the client does not
  kServerNotTrusted,    // the server's certificate is not valid under the client's CA
  kWrongHostName,       // the server's certificate does not name the host the client dialled
  kClientCertRequired,  // mutual TLS, and the client gave no certificate
  kClientCertRejected,  // mutual TLS, and the server refused the client's certificate
  kUnknown,             // the TLS connection failed otherwise (OpenSSL's words in the message)
};

struct TransportDiagnosis {
  TransportFault fault = TransportFault::kNone;
  // The one cause and its fix, naming the address ("cannot reach the coordinator at head:7070:
  // connection refused"); empty for kNone.
  std::string message;
};

// Diagnoses the transport to `target` with the client's `security` (only its CA, certificate and
// key matter; no token is sent). `target` is what --coordinator takes: HOST:PORT, [V6]:PORT, with a
// "dns:", "ipv4:" or "ipv6:" prefix, "unix:PATH", or a list HOST:PORT,HOST:PORT: unreachable only
// when every address is, else the first to accept is diagnosed (and a certificate must name the
// first host, as gRPC's channel requires). Each step (connecting, the exchange after it) waits at
// most `timeout_ms`.
TransportDiagnosis DiagnoseTransport(const std::string& target, const SecurityMaterial& security,
                                     int timeout_ms = 2000);

}  // namespace ltrain
