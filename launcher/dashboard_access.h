// Who may read the coordinator's HTTP side (http_server.h), decided without sockets: the request's
// Authorization and Cookie headers in, what it may see out.
//   - The control-plane token as "Authorization: Bearer TOKEN": everything (scripts that hold it).
//   - The read-only metrics token, as Prometheus' `authorization` block sends it: /metrics only.
//   - A dashboard session, a cookie set by /login from a one-time code (`ltrain dashboard` prints the
//     link; a standalone launch prints one at start): the page, its JSON and /metrics, for 12 hours.
//     A code works once, within 10 minutes of being made: the link that lands in a terminal's
//     scrollback or a log file opens nothing later, and no full-power token is ever in an address.
// Thread-safe: the HTTP server's threads and the coordinator's RPC threads call it at once.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"

namespace ltrain::launcher {

class DashboardAccess {
 public:
  static constexpr int64_t kLoginCodeTtlMs = 10 * 60 * 1000;
  static constexpr int64_t kSessionTtlMs = 12LL * 3600 * 1000;
  // At most this many codes and sessions are held; the oldest goes first.
  static constexpr size_t kMaxLoginCodes = 256;
  static constexpr size_t kMaxSessions = 1024;
  static constexpr const char* kSessionCookie = "ltrain_session";

  enum class Scope { kNone, kMetrics, kRead };

  // `clock` must outlive this. Empty tokens are never accepted.
  DashboardAccess(const Clock& clock, std::string token, std::string metrics_token);

  // A new one-time login code.
  std::string NewLoginCode();
  // The session a valid, unused, unexpired code opens (the code is spent), or nullopt.
  std::optional<std::string> Redeem(std::string_view code);
  // What a request with these headers (either may be empty) may read.
  Scope Grant(std::string_view authorization, std::string_view cookie) const;

 private:
  struct Expiring {
    std::string secret;
    int64_t expires_ms = 0;
  };
  // Drops what expired, then the oldest while over `limit`.
  void Trim(std::vector<Expiring>& entries, size_t limit) const;

  const Clock& clock_;
  const std::string token_, metrics_token_;
  mutable std::mutex mu_;
  std::vector<Expiring> codes_, sessions_;  // oldest first
};

// The value of cookie `name` in a Cookie header ("a=1; b=2"), or "".
std::string_view CookieValue(std::string_view header, std::string_view name);

// Whether a request's Host header names this coordinator: an IP address literal (with or without a
// port), localhost, this machine's host name (as given, short or fully qualified), or one of
// `names`. Anything else is refused, so that a page of another site cannot reach the dashboard
// through a name it controls (DNS rebinding).
bool HostAllowed(std::string_view host_header, const std::string& hostname, const std::vector<std::string>& names);

}  // namespace ltrain::launcher
