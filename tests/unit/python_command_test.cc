// ParsePythonCommand: the Python command lines a warm standby can run, and the reason for the others.
#include "common/python_command.h"

#include <gtest/gtest.h>

namespace ltrain {
namespace {

TEST(PythonCommandTest, AScriptWithTheInterpretersOptions) {
  std::string error;
  std::optional<PythonCommand> command =
      ParsePythonCommand({"/usr/bin/python3.11", "-u", "-X", "dev", "-Wignore", "-OB", "train.py", "--lr", "-m"}, error);
  ASSERT_TRUE(command) << error;
  EXPECT_EQ(command->interpreter, "/usr/bin/python3.11");
  EXPECT_EQ(command->options, (std::vector<std::string>{"-u", "-X", "dev", "-Wignore", "-OB"}));
  EXPECT_FALSE(command->module);
  EXPECT_EQ(command->target, "train.py");
  EXPECT_EQ(command->args, (std::vector<std::string>{"--lr", "-m"})) << "the script's own arguments";
}

TEST(PythonCommandTest, AModule) {
  std::string error;
  std::optional<PythonCommand> command = ParsePythonCommand({"python", "-m", "trainer.main", "x"}, error);
  ASSERT_TRUE(command) << error;
  EXPECT_TRUE(command->module);
  EXPECT_EQ(command->target, "trainer.main");
  EXPECT_EQ(command->args, (std::vector<std::string>{"x"}));
}

TEST(PythonCommandTest, OtherProgramsAndCodeOnTheCommandLineAreRefusedWithTheReason) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"./train"}, "not a Python interpreter"},
      {{"pythonista", "t.py"}, "not a Python interpreter"},
      {{"python3", "-c", "print(1)"}, "not code given on the command line"},
      {{"python3"}, "runs no script or module"},
      {{"python3", "-u"}, "runs no script or module"},
      {{"python3", "-"}, "runs no script or module"},
      {{"python3", "-m"}, "runs no script or module"},
      {{"python3", "--check-hash-based-pycs", "always", "t.py"}, "not one a warm standby knows"},
  };
  for (const auto& [command, reason] : cases) {
    std::string error;
    EXPECT_FALSE(ParsePythonCommand(command, error)) << command.front();
    EXPECT_NE(error.find(reason), std::string::npos) << error;
  }
}

}  // namespace
}  // namespace ltrain
