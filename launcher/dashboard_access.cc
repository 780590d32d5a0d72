#include "launcher/dashboard_access.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>

#include "common/transport_security.h"

namespace ltrain::launcher {
namespace {

constexpr std::string_view kBearer = "Bearer ";

bool Matches(std::string_view given, const std::string& secret) { return !secret.empty() && SameSecret(given, secret); }

std::string Lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

}  // namespace

DashboardAccess::DashboardAccess(const Clock& clock, std::string token, std::string metrics_token)
    : clock_(clock), token_(std::move(token)), metrics_token_(std::move(metrics_token)) {}

void DashboardAccess::Trim(std::vector<Expiring>& entries, size_t limit) const {
  const int64_t now = clock_.SteadyMs();
  entries.erase(std::remove_if(entries.begin(), entries.end(), [now](const Expiring& e) { return e.expires_ms <= now; }),
                entries.end());
  if (entries.size() > limit) entries.erase(entries.begin(), entries.begin() + static_cast<long>(entries.size() - limit));
}

std::string DashboardAccess::NewLoginCode() {
  std::string code = NewToken();
  std::lock_guard<std::mutex> lock(mu_);
  codes_.push_back({code, clock_.SteadyMs() + kLoginCodeTtlMs});
  Trim(codes_, kMaxLoginCodes);
  return code;
}

std::optional<std::string> DashboardAccess::Redeem(std::string_view code) {
  std::lock_guard<std::mutex> lock(mu_);
  Trim(codes_, kMaxLoginCodes);
  auto found = std::find_if(codes_.begin(), codes_.end(), [&](const Expiring& e) { return Matches(code, e.secret); });
  if (found == codes_.end()) return std::nullopt;
  codes_.erase(found);
  std::string session = NewToken() + NewToken();
  sessions_.push_back({session, clock_.SteadyMs() + kSessionTtlMs});
  Trim(sessions_, kMaxSessions);
  return session;
}

DashboardAccess::Scope DashboardAccess::Grant(std::string_view authorization, std::string_view cookie) const {
  if (authorization.substr(0, kBearer.size()) == kBearer) {
    const std::string_view presented = authorization.substr(kBearer.size());
    if (Matches(presented, token_)) return Scope::kRead;
    if (Matches(presented, metrics_token_)) return Scope::kMetrics;
  }
  const std::string_view session = CookieValue(cookie, kSessionCookie);
  if (session.empty()) return Scope::kNone;
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = clock_.SteadyMs();
  const bool valid = std::any_of(sessions_.begin(), sessions_.end(), [&](const Expiring& e) {
    return e.expires_ms > now && Matches(session, e.secret);
  });
  return valid ? Scope::kRead : Scope::kNone;
}

std::string_view CookieValue(std::string_view header, std::string_view name) {
  while (!header.empty()) {
    const size_t end = header.find(';');
    std::string_view pair = header.substr(0, end);
    while (!pair.empty() && pair.front() == ' ') pair.remove_prefix(1);
    if (pair.size() > name.size() && pair.substr(0, name.size()) == name && pair[name.size()] == '=') {
      return pair.substr(name.size() + 1);
    }
    if (end == std::string_view::npos) break;
    header.remove_prefix(end + 1);
  }
  return {};
}

bool HostAllowed(std::string_view host_header, const std::string& hostname, const std::vector<std::string>& names) {
  std::string host = Lower(host_header);
  if (host.empty()) return false;
  if (host.front() == '[') {  // [v6]:port
    const size_t close = host.find(']');
    if (close == std::string::npos) return false;
    in6_addr v6{};
    return inet_pton(AF_INET6, host.substr(1, close - 1).c_str(), &v6) == 1;
  }
  if (const size_t colon = host.rfind(':'); colon != std::string::npos) host = host.substr(0, colon);
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return true;
  if (host == "localhost") return true;
  const std::string own = Lower(hostname);
  if (!own.empty() && (host == own || host == own.substr(0, own.find('.')))) return true;
  return std::any_of(names.begin(), names.end(), [&](const std::string& name) { return host == Lower(name); });
}

}  // namespace ltrain::launcher
