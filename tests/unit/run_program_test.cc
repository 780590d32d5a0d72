#include "worker/control/run_program.h"

#include <gtest/gtest.h>

namespace ltrain::worker {
namespace {

TEST(ParseProgressLineTest, AFullLineSetsEveryField) {
  std::optional<ProgressLine> line =
      ParseProgressLine("step=12 phase=backward loss=2.75 total_steps=100 tokens=4096 step_ms=250.5 lr=3e-4");
  ASSERT_TRUE(line.has_value());
  EXPECT_EQ(line->step, 12);
  EXPECT_EQ(line->phase, "backward");
  EXPECT_DOUBLE_EQ(line->loss.value(), 2.75);
  EXPECT_EQ(line->total_steps, 100);
  EXPECT_EQ(line->tokens, 4096);
  EXPECT_DOUBLE_EQ(line->step_ms.value(), 250.5);
  EXPECT_DOUBLE_EQ(line->lr.value(), 3e-4);
}

TEST(ParseProgressLineTest, KeysLeftOutStayUnsetAndSpacingIsFree) {
  std::optional<ProgressLine> line = ParseProgressLine("  phase=data\t step=3  \r");
  ASSERT_TRUE(line.has_value());
  EXPECT_EQ(line->step, 3);
  EXPECT_EQ(line->phase, "data");
  EXPECT_FALSE(line->loss.has_value());
  EXPECT_FALSE(line->total_steps.has_value());
  EXPECT_FALSE(line->tokens.has_value());
  EXPECT_FALSE(line->step_ms.has_value());
  EXPECT_FALSE(line->lr.has_value());
}

TEST(ParseProgressLineTest, UnknownKeysAreSkipped) {
  std::optional<ProgressLine> line = ParseProgressLine("epoch=2 step=7 grad_norm=0.9 mfu=41%");
  ASSERT_TRUE(line.has_value());
  EXPECT_EQ(line->step, 7);
  EXPECT_FALSE(ParseProgressLine("epoch=2 grad_norm=0.9").has_value()) << "no known key: no report";
}

TEST(ParseProgressLineTest, AMalformedNumberMakesTheLineNoReport) {
  for (const char* text : {"step=abc", "step=1.5", "step=-1", "step=", "step=7x loss=1", "loss=2.5.1",
                           "loss=", "total_steps=1e3", "tokens=-5", "step_ms=-1", "step_ms=fast", "lr=0.1,",
                           "step=99999999999999999999"}) {
    EXPECT_FALSE(ParseProgressLine(text).has_value()) << text;
  }
}

TEST(ParseProgressLineTest, TextThatIsNoReportIsIgnored) {
  for (const char* text : {"", " ", "\r", "hello world", "step 3", "=3", "step=3 and more", "phase=",
                           "phase=\x1b[2J", "phase=caf\xc3\xa9"}) {
    EXPECT_FALSE(ParseProgressLine(text).has_value()) << text;
  }
  EXPECT_FALSE(ParseProgressLine("phase=" + std::string(65, 'x')).has_value()) << "a phase is a short word";
  EXPECT_TRUE(ParseProgressLine("phase=" + std::string(64, 'x')).has_value());
}

TEST(ParseProgressLineTest, TheLastOfARepeatedKeyWins) {
  std::optional<ProgressLine> line = ParseProgressLine("step=1 step=2");
  ASSERT_TRUE(line.has_value());
  EXPECT_EQ(line->step, 2);
}

TEST(ParseExecArgsTest, EnvironmentEntriesComeBeforeTheProgram) {
  std::string error;
  std::optional<ExecArgs> args =
      ParseExecArgs({"--env", "A=b", "--env", "LD_LIBRARY_PATH=/x:/y", "--", "python3", "t.py", "--env", "C=d"}, error);
  ASSERT_TRUE(args) << error;
  EXPECT_EQ(args->env, (std::vector<std::string>{"A=b", "LD_LIBRARY_PATH=/x:/y"}));
  EXPECT_EQ(args->program, (std::vector<std::string>{"python3", "t.py", "--env", "C=d"}));
  args = ParseExecArgs({"--", "./train"}, error);
  ASSERT_TRUE(args) << error;
  EXPECT_TRUE(args->env.empty());
  EXPECT_EQ(args->program, (std::vector<std::string>{"./train"}));
  EXPECT_EQ(args->output_timeout_s, 0) << "no silence timeout unless asked";
  args = ParseExecArgs({"--output-timeout", "2.5", "--env", "A=b", "--", "./train"}, error);
  ASSERT_TRUE(args) << error;
  EXPECT_EQ(args->output_timeout_s, 2.5);
  EXPECT_EQ(args->env, (std::vector<std::string>{"A=b"}));
}

TEST(ParseExecArgsTest, AStandbyRunsAPythonProgram) {
  std::string error;
  std::optional<ExecArgs> args = ParseExecArgs({"--standby", "gpu", "--env", "A=b", "--", "python3", "-u", "t.py"}, error);
  ASSERT_TRUE(args) << error;
  EXPECT_EQ(args->standby, "gpu");
  EXPECT_EQ(args->program, (std::vector<std::string>{"python3", "-u", "t.py"}));
  EXPECT_EQ(ParseExecArgs({"--", "python3", "t.py"}, error)->standby, "") << "no standby unless asked";
  EXPECT_FALSE(ParseExecArgs({"--standby", "import", "--", "./train"}, error));
  EXPECT_NE(error.find("not a Python interpreter"), std::string::npos) << error;
  EXPECT_FALSE(ParseExecArgs({"--standby", "tpu", "--", "python3", "t.py"}, error));
  EXPECT_NE(error.find("expected import or gpu"), std::string::npos) << error;
}

TEST(ParseExecArgsTest, AnythingElseIsRefusedWithTheUsage) {
  for (const std::vector<std::string>& bad : std::vector<std::vector<std::string>>{
           {}, {"--"}, {"python3"}, {"--env"}, {"--env", "A=b"}, {"--env", "=b", "--", "p"}, {"--env", "A", "--", "p"},
           {"--flag", "x", "--", "p"}, {"--output-timeout", "soon", "--", "p"}, {"--output-timeout", "-1", "--", "p"}}) {
    std::string error;
    EXPECT_FALSE(ParseExecArgs(bad, error)) << bad.size();
    EXPECT_FALSE(error.empty());
  }
}

TEST(ProgramProgressTest, ALossRecordsTheStepWithItsFigures) {
  Progress progress;
  ProgramProgress relay(progress);
  relay.Apply(*ParseProgressLine("total_steps=50"));
  relay.Apply(*ParseProgressLine("step=4 phase=forward"));
  relay.Apply(*ParseProgressLine("loss=1.5 tokens=2000 step_ms=500 lr=0.01"));
  ProgressSnapshot snapshot = progress.Snapshot();
  EXPECT_EQ(snapshot.step, 4);
  EXPECT_EQ(snapshot.phase, "forward") << "a report naming no phase keeps the previous one";
  ASSERT_TRUE(snapshot.completed.has_value());
  EXPECT_EQ(snapshot.completed->step, 4);
  EXPECT_EQ(snapshot.completed->total_steps, 50);
  EXPECT_DOUBLE_EQ(snapshot.completed->loss, 1.5);
  EXPECT_DOUBLE_EQ(snapshot.completed->lr, 0.01);
  EXPECT_DOUBLE_EQ(snapshot.completed->step_ms, 500);
  EXPECT_DOUBLE_EQ(snapshot.completed->tokens_per_s, 4000);
}

TEST(ProgramProgressTest, StepAndPhaseMoveWithoutRecordingAStep) {
  Progress progress;
  ProgramProgress relay(progress);
  EXPECT_EQ(relay.phase(), "startup");
  relay.Apply(*ParseProgressLine("step=9"));
  EXPECT_EQ(progress.Snapshot().step, 9);
  EXPECT_EQ(progress.Snapshot().phase, "startup");
  relay.Apply(*ParseProgressLine("phase=checkpoint"));
  EXPECT_EQ(progress.Snapshot().step, 9);
  EXPECT_EQ(progress.Snapshot().phase, "checkpoint");
  EXPECT_FALSE(progress.Snapshot().completed.has_value());
}

TEST(ProgramProgressTest, TokensPerSecondNeedsTokensAndADuration) {
  Progress progress;
  ProgramProgress relay(progress);
  relay.Apply(*ParseProgressLine("step=1 loss=3 tokens=100"));
  EXPECT_EQ(progress.Snapshot().completed->tokens_per_s, 0);
  relay.Apply(*ParseProgressLine("step=2 loss=3 tokens=100 step_ms=0"));
  EXPECT_EQ(progress.Snapshot().completed->tokens_per_s, 0);
  EXPECT_EQ(progress.Snapshot().completed->step, 2);
}

}  // namespace
}  // namespace ltrain::worker
