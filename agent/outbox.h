// How the agent's sender treats what the coordinator answers: which refusals are for now (the
// message is sent again, in order) and which are for good (it is dropped, so that one message can
// never hold back the exit reports behind it), and the line that takes a dropped batch's place.
#pragma once

#include <optional>
#include <string>

#include "ltrain/v1/ltrain.grpc.pb.h"

namespace ltrain::agent {

// A gRPC status code under which the coordinator may take the same message later: it is away,
// slow, restarting, or refused the agent's credentials (which a message cannot change).
bool IsRetryable(int grpc_code);

// In place of a batch of lines the coordinator refused for good (`why`): one line, of the batch's
// first rank, saying how many lines of which ranks were dropped and where they are kept. Nothing
// for an empty batch or for such a notice itself (no notice of a notice).
std::optional<v1::PushLogsRequest> DroppedLinesNotice(const v1::PushLogsRequest& dropped, const std::string& why);

}  // namespace ltrain::agent
