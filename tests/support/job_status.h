// The job record as `ltrain status JOB --output json` prints it, parsed: how the integration,
// fault and Slurm tests read a job's state. Needs ltrain::proto.
#pragma once

#include <gtest/gtest.h>
#include <google/protobuf/util/json_util.h>

#include <chrono>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {

// Parses what `-o json` prints (docs/json.md) into `message`: its job states are the tables' names
// ("RUNNING"), which become the enum's again.
inline bool ParseCliJson(const std::string& text, google::protobuf::Message* message) {
  const std::string with_enums =
      std::regex_replace(text, std::regex(R"re("state": ?"([A-Z]+)")re"), R"("state": "JOB_STATE_$1")");
  return google::protobuf::util::JsonStringToMessage(with_enums, message).ok();
}

// What is wrong with `json` (one document, or one per line for "logs_line") against the definition
// `name` of docs/json-schema.json, as python3's jsonschema says; "" when it conforms.
inline std::string SchemaProblems(const std::string& name, const std::string& json) {
  static const char* kCheck = R"py(
import json, sys, jsonschema
schema = json.load(open(sys.argv[1]))
validator = jsonschema.Draft202012Validator({"$ref": "#/$defs/" + sys.argv[2], "$defs": schema["$defs"]})
text = open(sys.argv[3]).read()
docs = [json.loads(line) for line in text.splitlines() if line.strip()] if sys.argv[2] == "logs_line" else [json.loads(text)]
problems = ["%s: %s" % ("/".join(map(str, e.path)), e.message) for d in docs for e in validator.iter_errors(d)]
print("\n".join(problems[:10]) if problems else "ok %d document(s)" % len(docs))
sys.exit(1 if problems or not docs else 0)
)py";
  TempDir dir;
  const std::string file = dir.Write("out.json", json);
  ProcessResult checked = RunProcess({"/usr/bin/python3", "-c", kCheck, SourceDir() + "/docs/json-schema.json", name, file});
  return checked.exit_code == 0 ? "" : name + ": " + checked.output;
}

// Runs `ltrain status JOB --output json` with `extra` arguments (e.g. --coordinator HOST:PORT)
// under `env`; an answer that does not parse as a job fails the calling test. The command's exit
// code goes to `exit_code` when given.
inline v1::Job JobStatus(const std::string& job_id, const std::map<std::string, std::string>& env,
                         const std::vector<std::string>& extra = {}, int* exit_code = nullptr,
                         std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
  std::vector<std::string> argv = {LtrainBinary(), "status", job_id, "--output", "json"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  ProcessResult result = RunProcess(argv, env, timeout);
  if (exit_code != nullptr) *exit_code = result.exit_code;
  v1::Job job;
  EXPECT_TRUE(ParseCliJson(result.output, &job)) << result.output;
  return job;
}

}  // namespace ltrain::testing
