// ltrain logs JOB: a job's log lines, from its coordinator, the local launch running it, or the state
// under $LTRAIN_HOME once it has ended.
#include <cstdio>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "cmd/job_printer.h"
#include "common/clock.h"
#include "launcher/log_view.h"
#include "launcher/coordinator_server.h"
#include "launcher/state_store.h"

namespace ltrain::cli {
namespace {

struct LogsArgs {
  std::string job_id;
  std::string coordinator;
  bool follow = false;
  int rank = -1;
  std::string since;
  int tail = 0;
  std::string output = "text";
};

void PrintLogLines(const std::vector<v1::Event>& lines, LogFormat format) {
  std::fputs(FormatLogLines(lines, format).c_str(), stdout);
  if (format == LogFormat::kText) std::fflush(stdout);
}

int Logs(const LogsArgs& args, const SecurityMaterial& security) {
  int64_t since = 0;
  if (!args.since.empty()) {
    std::optional<int64_t> parsed = launcher::ParseSince(args.since, RealClock().UnixMs());
    if (!parsed) {
      std::fprintf(stderr, "ltrain logs: --since %s is neither a duration (90s, 10m, 2h, 1d) nor Unix milliseconds\n",
                   args.since.c_str());
      return kExitInvalid;
    }
    since = *parsed;
  }
  LogFormat format = args.output == "json" ? LogFormat::kJson : LogFormat::kText;
  std::string address = args.coordinator;
  SecurityMaterial used = security;
  if (address.empty()) {
    if (std::optional<LocalLaunch> launch = FindLocalLaunch(LtrainHome(), args.job_id)) {  // a local launch still running it
      address = launch->address;
      used = launch->security;
    }
  }
  std::vector<v1::Event> lines;
  if (!address.empty()) {
    CoordinatorClient client(address, used);
    grpc::ClientContext context;
    context.set_deadline(Deadline(10));
    v1::GetLogsRequest request;
    request.set_job_id(args.job_id);
    request.set_rank(args.rank);
    request.set_since_unix_ms(since);
    request.set_limit(args.tail);
    v1::GetLogsReply reply;
    grpc::Status status = client.stub().GetLogs(&context, request, &reply);
    if (!status.ok()) {
      if (!args.coordinator.empty()) return client.Unreachable(status);
      address.clear();  // the local launch ended: read the state directly below
    } else if (reply.status().code() != 0) {
      return ReplyError(reply.status());
    } else {
      lines.assign(reply.lines().begin(), reply.lines().end());
    }
  }
  if (address.empty()) {
    StatusOr<std::unique_ptr<launcher::StateStore>> store = launcher::OpenStateStore(LtrainHome());
    if (!store.ok()) {
      std::fprintf(stderr, "ltrain: %s\n", store.status().message().c_str());
      return kExitUnavailable;
    }
    if (StatusOr<v1::Job> job = (*store)->GetJob(args.job_id); !job.ok()) return NoLocalJob(args.job_id, LtrainHome());
    StatusOr<std::vector<v1::Event>> stored = (*store)->Logs(args.job_id, args.rank, since, args.tail);
    if (!stored.ok()) {
      std::fprintf(stderr, "ltrain: %s\n", stored.status().message().c_str());
      return kExitUnavailable;
    }
    lines = std::move(stored).value();
  }
  PrintLogLines(lines, format);
  if (!args.follow || address.empty()) return kExitOk;
  // Follow: new lines as they come, until the job ends.
  int64_t after = lines.empty() ? 0 : lines.back().seq();
  CoordinatorClient client(address, used);
  grpc::ClientContext context;
  v1::WatchJobRequest request;
  request.set_job_id(args.job_id);
  request.set_after_seq(after);
  request.set_logs(true);
  auto reader = client.stub().WatchJob(&context, request);
  v1::Event event;
  while (reader->Read(&event)) {
    if (event.kind() != "log" || (args.rank >= 0 && event.rank() != args.rank)) continue;
    PrintLogLines({event}, format);
  }
  grpc::Status status = reader->Finish();
  return status.ok() ? kExitOk : client.Unreachable(status);
}

}  // namespace

void AddLogsCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<LogsArgs>();
  CLI::App* cmd = app.add_subcommand(
      "logs", "Print a job's log lines, rank-prefixed; identical lines of many ranks fold into one [ranks 0-7] line");
  cmd->add_option("job", args->job_id, "Job id")->required();
  cmd->add_flag("-f,--follow", args->follow, "Keep printing new lines until the job ends");
  cmd->add_option("--rank", args->rank, "Only this rank's lines");
  cmd->add_option("--since", args->since, "Only lines newer than this: 90s, 10m, 2h, 1d, or Unix milliseconds");
  cmd->add_option("--tail", args->tail, "Only the newest N lines");
  AddCoordinatorOption(cmd, &args->coordinator, "HOST:PORT; without it, the local state in $LTRAIN_HOME");
  AddOutputOption(cmd, &args->output, "text");
  ctx.Bind(cmd, [args, &ctx] { return Logs(*args, ctx.security()); });
}

}  // namespace ltrain::cli
