// Reading PyTorch's NCCL flight-recorder dumps: the pickle reader, a dump's collectives, the pipe
// that asks a rank for one.
#include "agent/flight_recorder.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "agent/pickle_reader.h"

namespace ltrain::agent {
namespace {

// A dump of rank 0 of two, as Python pickles it: all_reduce #1 of default_pg completed (4 MiB of
// float, 250 ms), #2 started; the ring out of record order.
//   entry = {"record_id", "pg_id", "process_group": ("0", "default_pg"), "collective_seq_id",
//            "p2p_seq_id", "profiling_name": "nccl:all_reduce", "time_created_ns",
//            "input_sizes": [[1024, 1024]], "input_dtypes": ["Float"], "state",
//            "time_discovered_completed_ns", "is_p2p": False}
//   dump = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
//           "entries": [entry(#2, started), entry(#1, completed)]}
// pickle.dumps(dump, protocol=2)
constexpr const char* kProtocol2 =
    "80027d710028580700000076657273696f6e71015804000000322e31307102580900000070675f636f6e66696771037d7104"
    "58010000003071057d71062858040000006e616d65710768055804000000646573637108580a00000064656661756c745f70"
    "677109580500000072616e6b73710a58060000005b302c20315d710b75735807000000656e7472696573710c5d710d287d71"
    "0e2858090000007265636f72645f6964710f4b01580500000070675f696471104b00580d00000070726f636573735f67726f"
    "75707111680568098671125811000000636f6c6c6563746976655f7365715f696471134b02580a0000007032705f7365715f"
    "696471144b00580e00000070726f66696c696e675f6e616d657115580f0000006e63636c3a616c6c5f726564756365711658"
    "0f00000074696d655f637265617465645f6e7371178a08004a2b48268a7e18580b000000696e7075745f73697a657371185d"
    "71195d711a284d00044d00046561580c000000696e7075745f647479706573711b5d711c5805000000466c6f6174711d6158"
    "050000007374617465711e580700000073746172746564711f581c00000074696d655f646973636f76657265645f636f6d70"
    "6c657465645f6e7371204e580600000069735f703270712189757d712228680f4b0068104b006811681268134b0168144b00"
    "6815681668178a080080900c268a7e1868185d71235d7124284d00044d00046561681b5d7125681d61681e5809000000636f"
    "6d706c65746564712668208a088032771b268a7e186821897565752e";
// pickle.dumps(dump, protocol=4)
constexpr const char* kProtocol4 =
    "800495cb010000000000007d94288c0776657273696f6e948c04322e3130948c0970675f636f6e666967947d948c0130947d"
    "94288c046e616d659468058c0464657363948c0a64656661756c745f7067948c0572616e6b73948c065b302c20315d947573"
    "8c07656e7472696573945d94287d94288c097265636f72645f6964944b018c0570675f6964944b008c0d70726f636573735f"
    "67726f7570946805680986948c11636f6c6c6563746976655f7365715f6964944b028c0a7032705f7365715f6964944b008c"
    "0e70726f66696c696e675f6e616d65948c0f6e63636c3a616c6c5f726564756365948c0f74696d655f637265617465645f6e"
    "73948a08004a2b48268a7e188c0b696e7075745f73697a6573945d945d94284d00044d000465618c0c696e7075745f647479"
    "706573945d948c05466c6f617494618c057374617465948c0773746172746564948c1c74696d655f646973636f7665726564"
    "5f636f6d706c657465645f6e73944e8c0669735f7032709489757d9428680f4b0068104b006811681268134b0168144b0068"
    "15681668178a080080900c268a7e1868185d945d94284d00044d00046561681b5d94681d61681e8c09636f6d706c65746564"
    "9468208a088032771b268a7e186821897565752e";

// PyTorch 2.11's dump (LibTorch's pickler) of a 1-GPU program under `ltrain run` whose second all_reduce
// timed out behind a busy stream (nccl-trace-rank-0, an H100): #1 completed, #2 scheduled.
constexpr const char* kPyTorchDump =
    "80027d28580700000076657273696f6e71005804000000322e31307101580900000070675f636f6e66696771027d28580100"
    "00003071037d2858040000006e616d65710468035804000000646573637105580a00000064656661756c745f706771065805"
    "00000072616e6b73710758030000005b305d710875755810000000636f6d6d5f6c69625f76657273696f6e71095806000000"
    "322e32382e39710a580900000070675f737461747573710b7d2868037d2858180000006c6173745f656e7175657565645f63"
    "6f6c6c656374697665710c4b0258170000006c6173745f737461727465645f636f6c6c656374697665710d4affffffff5819"
    "0000006c6173745f636f6d706c657465645f636f6c6c656374697665710e4b0175755807000000656e7472696573710f5d28"
    "7d2858060000006672616d657371105d287d286804580a000000616c6c5f7265647563657111580800000066696c656e616d"
    "65711258530000002f6f70742f746f7263682f2e76656e762f6c69622f707974686f6e332e31322f736974652d7061636b61"
    "6765732f746f7263682f64697374726962757465642f64697374726962757465645f633130642e7079711358040000006c69"
    "6e6571144dfc0b7571157d28680458070000007772617070657271166812584e0000002f6f70742f746f7263682f2e76656e"
    "762f6c69622f707974686f6e332e31322f736974652d7061636b616765732f746f7263682f64697374726962757465642f63"
    "3130645f6c6f676765722e7079711768144b537571187d28680458080000003c6d6f64756c653e7119681258130000002f74"
    "6d702f6672322f74696d656f75742e7079711a68144b05756558090000007265636f72645f6964711b4b0058050000007067"
    "5f6964711c4b00580d00000070726f636573735f67726f7570711d6803680686580b0000007468726561645f6e616d65711e"
    "5807000000707974686f6e33711f58090000007468726561645f69647120580f000000313430333532373135373331373132"
    "71215811000000636f6c6c6563746976655f7365715f696471224b01580a0000007032705f7365715f696471234b00580500"
    "00006f705f696471244b01580e00000070726f66696c696e675f6e616d657125580f0000006e63636c3a616c6c5f72656475"
    "63657126580f00000074696d655f637265617465645f6e7371278a082e0e9caf84afee18580b000000696e7075745f73697a"
    "657371285d285d284a000010006565580c000000696e7075745f64747970657371295d285805000000466c6f6174712a6558"
    "0c0000006f75747075745f73697a6573712b5d285d284a000010006565580d0000006f75747075745f647479706573712c5d"
    "28682a6558050000007374617465712d5809000000636f6d706c65746564712e581a00000074696d655f646973636f766572"
    "65645f737461727465645f6e73712f4e581c00000074696d655f646973636f76657265645f636f6d706c657465645f6e7371"
    "308a08131ff5af84afee18580700000072657469726564713188580a00000074696d656f75745f6d7371324d881358060000"
    "0069735f703270713389757d2868105d28681568187d28680468196812681a68144b087565681b4b01681c4b00681d680368"
    "0686681e681f6820682168224b0268234b0068244b026825682668278a08ab62aaaf84afee1868285d285d284a0000100065"
    "6568295d28682a65682b5d285d284a000010006565682c5d28682a65682d58090000007363686564756c65647134682f4e68"
    "304e68318968324d881368338975657571352e";

std::string FromHex(const std::string& hex) {
  std::string bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return bytes;
}

TEST(PickleReaderTest, ReadsWhatPythonPickles) {
  for (const char* hex : {kProtocol2, kProtocol4}) {
    StatusOr<nlohmann::json> read = ReadPickle(FromHex(hex));
    ASSERT_TRUE(read.ok()) << read.status().message();
    EXPECT_EQ((*read)["version"], "2.10");
    EXPECT_EQ((*read)["pg_config"]["0"]["desc"], "default_pg");
    const nlohmann::json& first = (*read)["entries"][0];
    EXPECT_EQ(first["collective_seq_id"], 2);
    EXPECT_EQ(first["time_created_ns"].get<int64_t>(), 1765000001000000000);
    EXPECT_EQ(first["process_group"], nlohmann::json::array({"0", "default_pg"}));
    EXPECT_EQ(first["input_sizes"], nlohmann::json::parse("[[1024, 1024]]"));
    EXPECT_TRUE(first["time_discovered_completed_ns"].is_null());
    EXPECT_EQ(first["is_p2p"], false);
    // Memoized text (BINGET) reads as its text in the second entry.
    EXPECT_EQ((*read)["entries"][1]["state"], "completed");
    EXPECT_EQ((*read)["entries"][1]["profiling_name"], "nccl:all_reduce");
  }
}

// As LibTorch's pickler writes: typed lists through torch.jit._pickle, negative and wide integers,
// floats big-endian.
TEST(PickleReaderTest, ReadsLibTorchsTypedListsAndNumbers) {
  std::string data = "\x80\x02}(";
  data += std::string("X\x04\0\0\0", 5) + "dims";
  data += "ctorch.jit._pickle\nbuild_intlist\n](K\x02J\xfe\xff\xff\xff" "e\x85R";
  data += std::string("X\x01\0\0\0", 5) + "f";
  data += std::string("G\x3f\xf8\0\0\0\0\0\0", 9);  // 1.5
  data += std::string("X\x01\0\0\0", 5) + "n";
  data += std::string("\x8a\x02\x00\x80", 4);  // -32768 as LONG1
  data += "u.";
  StatusOr<nlohmann::json> read = ReadPickle(data);
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ((*read)["dims"], nlohmann::json::parse("[2, -2]"));
  EXPECT_DOUBLE_EQ((*read)["f"].get<double>(), 1.5);
  EXPECT_EQ((*read)["n"].get<int64_t>(), -32768);
}

TEST(PickleReaderTest, RefusesWhatIsNoPickleOfData) {
  EXPECT_FALSE(ReadPickle("").ok());
  EXPECT_FALSE(ReadPickle("(dp0\nS'a'\n").ok());                         // protocol 0
  EXPECT_FALSE(ReadPickle(std::string("\x80\x02X\xff\0\0\0ab", 9)).ok());  // a string past the end
  EXPECT_FALSE(ReadPickle("\x80\x02}K\x01u.").ok());                      // SETITEMS without a mark
  EXPECT_FALSE(ReadPickle("\x80\x02h\x05.").ok());                        // a memo never put
  StatusOr<nlohmann::json> truncated = ReadPickle(FromHex(kProtocol2).substr(0, 300));
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(truncated.status().message().find("not a pickle of plain data"), std::string::npos);
}

TEST(FlightRecorderTest, ADumpIsItsRanksCollectivesInOrder) {
  for (const char* hex : {kProtocol2, kProtocol4}) {
    StatusOr<v1::FlightRecord> record = ParseFlightRecorderDump(FromHex(hex));
    ASSERT_TRUE(record.ok()) << record.status().message();
    ASSERT_EQ(record->collectives_size(), 2);
    const v1::CollectiveRecord& done = record->collectives(0);
    EXPECT_EQ(done.seq(), 1u);
    EXPECT_EQ(done.op(), "all_reduce");
    EXPECT_EQ(done.group(), "default_pg");
    EXPECT_EQ(done.bytes(), 4 << 20);
    EXPECT_EQ(done.state(), "completed");
    EXPECT_EQ(done.start_unix_ms(), 1765000000000);
    EXPECT_EQ(done.end_unix_ms(), 1765000000250);
    const v1::CollectiveRecord& open = record->collectives(1);
    EXPECT_EQ(open.seq(), 2u);
    EXPECT_EQ(open.state(), "started");
    EXPECT_EQ(open.end_unix_ms(), 0);
    ASSERT_EQ(record->groups_size(), 1);
    EXPECT_EQ(record->groups(0).group(), "default_pg");
    EXPECT_EQ(record->groups(0).ranks_size(), 2);
  }
}

TEST(FlightRecorderTest, ReadsADumpPyTorchWrote) {
  StatusOr<v1::FlightRecord> record = ParseFlightRecorderDump(FromHex(kPyTorchDump));
  ASSERT_TRUE(record.ok()) << record.status().message();
  ASSERT_EQ(record->collectives_size(), 2);
  EXPECT_EQ(record->collectives(0).op(), "all_reduce");
  EXPECT_EQ(record->collectives(0).group(), "default_pg");
  EXPECT_EQ(record->collectives(0).bytes(), 4 << 20);
  EXPECT_EQ(record->collectives(0).state(), "completed");
  EXPECT_EQ(record->collectives(0).start_unix_ms(), 1796566285784);
  EXPECT_EQ(record->collectives(0).end_unix_ms(), 1796566285790);
  EXPECT_EQ(record->collectives(1).seq(), 2u);
  EXPECT_EQ(record->collectives(1).state(), "scheduled");
  EXPECT_EQ(record->collectives(1).end_unix_ms(), 0);
  ASSERT_EQ(record->groups_size(), 1);
  EXPECT_EQ(record->groups(0).ranks_size(), 1);
}

TEST(FlightRecorderTest, KeepsTheLastFewOfEachGroupAndReadsJson) {
  nlohmann::json dump = {{"version", "2.10"}, {"entries", nlohmann::json::array()}};
  for (int i = 0; i < 20; ++i) {
    dump["entries"].push_back({{"record_id", i}, {"collective_seq_id", i + 1}, {"profiling_name", "nccl:all_gather"},
                               {"process_group", {"1", i % 2 ? "tp" : "dp"}}, {"state", "completed"},
                               {"time_created_ns", 1000000}, {"input_sizes", {{8}}}, {"input_dtypes", {"BFloat16"}}});
  }
  StatusOr<v1::FlightRecord> record = ParseFlightRecorderDump(dump.dump());
  ASSERT_TRUE(record.ok()) << record.status().message();
  ASSERT_EQ(record->collectives_size(), 2 * kFlightRecordsPerGroup);
  EXPECT_EQ(record->collectives(0).seq(), 5u);  // the oldest kept: dp's #5 (of #1, #3, ..., #19)
  EXPECT_EQ(record->collectives(0).bytes(), 16);
  EXPECT_EQ(record->collectives(2 * kFlightRecordsPerGroup - 1).seq(), 20u);
  EXPECT_FALSE(ParseFlightRecorderDump("{\"version\": 1}").ok());
}

class FlightRecorderFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/ltrain-fr-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(FlightRecorderFileTest, ReadsARanksDumpAndSaysWhatIsWrongWithOne) {
  EXPECT_EQ(ReadFlightRecorderDump(dir_, 0).status().code(), StatusCode::kNotFound);
  std::ofstream(FlightRecorderDumpPath(dir_, 0), std::ios::binary) << FromHex(kProtocol4);
  StatusOr<v1::FlightRecord> record = ReadFlightRecorderDump(dir_, 0);
  ASSERT_TRUE(record.ok()) << record.status().message();
  EXPECT_EQ(record->rank(), 0);
  EXPECT_EQ(record->path(), dir_ + "/nccl-trace-rank-0");
  EXPECT_GT(record->written_unix_ms(), 0);
  EXPECT_EQ(record->collectives_size(), 2);
  std::ofstream(FlightRecorderDumpPath(dir_, 1), std::ios::binary) << FromHex(kProtocol4).substr(0, 100);
  StatusOr<v1::FlightRecord> cut = ReadFlightRecorderDump(dir_, 1);
  ASSERT_TRUE(cut.ok());
  EXPECT_NE(cut->error().find("before STOP"), std::string::npos) << cut->error();
}

TEST_F(FlightRecorderFileTest, APipeWithAReaderTakesTheRequest) {
  EXPECT_FALSE(RequestFlightRecorderDump(dir_, 3));  // no pipe
  const std::string pipe = FlightRecorderPipePath(dir_, 3);
  EXPECT_EQ(pipe, dir_ + "/nccl-dump-request-rank-3.pipe");
  ASSERT_EQ(mkfifo(pipe.c_str(), 0600), 0);
  EXPECT_FALSE(RequestFlightRecorderDump(dir_, 3));  // nobody reads it
  const int reader = open(pipe.c_str(), O_RDONLY | O_NONBLOCK);  // as PyTorch's watchdog holds it
  ASSERT_GE(reader, 0);
  EXPECT_TRUE(RequestFlightRecorderDump(dir_, 3));
  char byte = 0;
  EXPECT_EQ(read(reader, &byte, 1), 1);
  close(reader);
}

}  // namespace
}  // namespace ltrain::agent
