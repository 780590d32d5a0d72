#include "cmd/commands.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "cmd/cli_support.h"
#include "common/logging.h"

namespace ltrain::cli {

void CommandContext::AddGlobalOptions(CLI::App& app) {
  app.add_option("--log-level", log_level_, "debug, info, warning or error")->capture_default_str();
  app.fallthrough();  // the options below may also follow the subcommand
  app.add_option("--tls-ca", security_options_.tls_ca,
                 "PEM of the CA that signed the coordinator's certificate: use TLS ($LTRAIN_TLS_CA)");
  app.add_option("--tls-cert", security_options_.tls_cert,
                 "PEM certificate: the coordinator's own, or a client's for mutual TLS ($LTRAIN_TLS_CERT)");
  app.add_option("--tls-key", security_options_.tls_key, "PEM key of --tls-cert ($LTRAIN_TLS_KEY)");
  app.add_option("--token-file", security_options_.token_file,
                 "File holding the bearer token the coordinator requires ($LTRAIN_TOKEN_FILE; $LTRAIN_TOKEN wins; "
                 "default $LTRAIN_HOME/token, where a coordinator started without one keeps the one it made)");
  app.add_flag("--insecure", security_options_.insecure,
               "Without TLS beyond loopback ($LTRAIN_INSECURE=1): a client sends the token in clear text to a "
               "coordinator off this host; a coordinator serves a non-loopback address in clear text (refused "
               "otherwise), and says so at start and to every `ltrain status`. Only on a network you trust");
}

int CommandContext::ApplyGlobalOptions() {
  LogLevel level;
  if (!ParseLogLevel(log_level_, &level)) {
    std::fprintf(stderr, "ltrain: --log-level %s is not one of debug, info, warning, error\n", log_level_.c_str());
    return kExitInvalid;
  }
  SetLogLevel(level);
  security_options_.default_token_file = LtrainHome() + "/token";
  StatusOr<SecurityMaterial> loaded = LoadSecurity(security_options_);
  if (!loaded.ok()) {
    std::fprintf(stderr, "ltrain: %s\n", loaded.status().message().c_str());
    return kExitInvalid;
  }
  security_ = *loaded;
  return kExitOk;
}

void CommandContext::Bind(CLI::App* command, std::function<int()> handler) {
  handlers_.emplace_back(command, std::move(handler));
}

int CommandContext::RefuseNonFiniteNumbers(const CLI::App& app) {
  for (const CLI::Option* option : app.get_options()) {
    if (option->count() == 0 || option->get_type_name().find("FLOAT") == std::string::npos) continue;
    for (const std::string& given : option->results()) {
      char* end = nullptr;
      const double value = std::strtod(given.c_str(), &end);
      if (end != given.c_str() && !std::isfinite(value)) {
        std::fprintf(stderr, "ltrain: %s %s is not a finite number\n", option->get_name().c_str(), given.c_str());
        return kExitInvalid;
      }
    }
  }
  for (const CLI::App* command : app.get_subcommands()) {
    if (int code = RefuseNonFiniteNumbers(*command); code != kExitOk) return code;
  }
  return kExitOk;
}

int CommandContext::RunSelected() const {
  for (const auto& [command, handler] : handlers_) {
    if (command->parsed()) return handler();
  }
  return kExitInvalid;
}

}  // namespace ltrain::cli
