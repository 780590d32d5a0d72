#include "agent/flight_recorder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <vector>

#include "agent/pickle_reader.h"

namespace ltrain::agent {
namespace {

using Json = nlohmann::json;

// Bytes of one element of a dtype as PyTorch names it in a dump ("Float", "BFloat16", ...).
int64_t ElementBytes(const std::string& dtype) {
  static const std::map<std::string, int64_t> sizes = {
      {"Double", 8},      {"Long", 8},       {"ComplexFloat", 8}, {"ComplexDouble", 16}, {"Float", 4},
      {"Int", 4},         {"UInt32", 4},     {"Half", 2},         {"BFloat16", 2},       {"Short", 2},
      {"UInt16", 2},      {"Byte", 1},       {"Char", 1},         {"Bool", 1},           {"Float8_e4m3fn", 1},
      {"Float8_e5m2", 1}, {"Float8_e4m3fnuz", 1}, {"Float8_e5m2fnuz", 1}, {"Float8_e8m0fnu", 1}, {"UInt64", 8},
  };
  auto found = sizes.find(dtype);
  return found == sizes.end() ? 0 : found->second;
}

int64_t Integer(const Json& entry, const char* key) {
  auto found = entry.find(key);
  if (found == entry.end()) return 0;
  if (found->is_number_integer()) return found->get<int64_t>();
  if (found->is_number()) return static_cast<int64_t>(found->get<double>());
  return 0;
}

std::string Text(const Json& entry, const char* key) {
  auto found = entry.find(key);
  return found != entry.end() && found->is_string() ? found->get<std::string>() : "";
}

// The group as a user knows it: its description ("default_pg"), else its name ("0").
std::string GroupName(const std::string& name, const std::string& desc) {
  return !desc.empty() && desc != "undefined" ? desc : name;
}

// "[0, 1, 2]" as PyTorch writes a group's ranks, or a list.
std::vector<int> RankList(const Json& ranks) {
  std::vector<int> out;
  if (ranks.is_array()) {
    for (const auto& rank : ranks) {
      if (rank.is_number_integer()) out.push_back(rank.get<int>());
    }
  } else if (ranks.is_string()) {
    const std::string& text = ranks.get_ref<const std::string&>();
    for (size_t i = 0; i < text.size();) {
      if (text[i] >= '0' && text[i] <= '9') {
        size_t end = i;
        while (end < text.size() && text[end] >= '0' && text[end] <= '9' && end - i < 9) ++end;
        out.push_back(std::stoi(text.substr(i, end - i)));
        i = end;
      } else {
        ++i;
      }
    }
  }
  return out;
}

// Bytes of a collective's inputs: each input's element count times its element's size.
int64_t InputBytes(const Json& entry) {
  auto sizes = entry.find("input_sizes");
  auto dtypes = entry.find("input_dtypes");
  if (sizes == entry.end() || !sizes->is_array()) return 0;
  int64_t bytes = 0;
  for (size_t i = 0; i < sizes->size(); ++i) {
    const Json& shape = (*sizes)[i];
    if (!shape.is_array()) continue;
    int64_t count = 1;
    for (const auto& dim : shape) count *= dim.is_number_integer() ? dim.get<int64_t>() : 0;
    std::string dtype = dtypes != entry.end() && dtypes->is_array() && i < dtypes->size() && (*dtypes)[i].is_string()
                            ? (*dtypes)[i].get<std::string>()
                            : "";
    bytes += count * ElementBytes(dtype);
  }
  return bytes;
}

bool IsP2p(const Json& entry) {
  auto found = entry.find("is_p2p");
  return found != entry.end() && found->is_boolean() && found->get<bool>();
}

// An entry's group: its process_group (name, description), else its pg_id.
std::string EntryGroup(const Json& entry) {
  auto pg = entry.find("process_group");
  if (pg == entry.end() || !pg->is_array() || pg->empty()) return std::to_string(Integer(entry, "pg_id"));
  return GroupName((*pg)[0].is_string() ? (*pg)[0].get<std::string>() : (*pg)[0].dump(),
                   pg->size() > 1 && (*pg)[1].is_string() ? (*pg)[1].get<std::string>() : "");
}

}  // namespace

std::string FlightRecorderDumpPath(const std::string& dir, int rank) {
  return dir + "/" + kFlightRecorderPrefix + std::to_string(rank);
}

std::string FlightRecorderPipePath(const std::string& dir, int rank) {
  return dir + "/" + kFlightRecorderPipePrefix + std::to_string(rank) + ".pipe";
}

StatusOr<v1::FlightRecord> ParseFlightRecorderDump(const std::string& data) {
  const size_t first = data.find_first_not_of(" \t\r\n");
  Json dump;
  if (first != std::string::npos && data[first] == '{') {
    dump = Json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (dump.is_discarded()) return InvalidArgument("it is neither a pickle nor JSON");
  } else {
    StatusOr<Json> read = ReadPickle(data);
    if (!read.ok()) return read.status();
    dump = std::move(*read);
  }
  if (!dump.is_object() || !dump.contains("entries") || !dump["entries"].is_array()) {
    return InvalidArgument("it has no \"entries\" list");
  }
  v1::FlightRecord record;
  if (auto config = dump.find("pg_config"); config != dump.end() && config->is_object()) {
    for (const auto& [name, group] : config->items()) {
      if (!group.is_object()) continue;
      v1::ProcessGroupRanks* ranks = record.add_groups();
      ranks->set_group(GroupName(group.contains("name") ? Text(group, "name") : name, Text(group, "desc")));
      if (group.contains("ranks")) {
        for (int rank : RankList(group["ranks"])) ranks->add_ranks(rank);
      }
    }
  }
  // The ring in the order of its records; of each group (collectives and point-to-point apart) the last few.
  std::vector<const Json*> entries;
  for (const auto& entry : dump["entries"]) {
    if (entry.is_object()) entries.push_back(&entry);
  }
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Json* a, const Json* b) { return Integer(*a, "record_id") < Integer(*b, "record_id"); });
  std::map<std::pair<std::string, bool>, int> kept;
  std::vector<const Json*> last;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (++kept[{EntryGroup(**it), IsP2p(**it)}] <= kFlightRecordsPerGroup) last.push_back(*it);
  }
  std::reverse(last.begin(), last.end());
  for (const Json* found : last) {
    const Json& entry = *found;
    v1::CollectiveRecord* c = record.add_collectives();
    const bool p2p = IsP2p(entry);
    c->set_p2p(p2p);
    c->set_seq(static_cast<uint64_t>(Integer(entry, p2p ? "p2p_seq_id" : "collective_seq_id")));
    std::string op = Text(entry, "profiling_name");
    if (const size_t colon = op.find(':'); colon != std::string::npos && op.compare(0, colon, "nccl") == 0) {
      op = op.substr(colon + 1);
    }
    c->set_op(op.empty() ? "collective" : op);
    c->set_group(EntryGroup(entry));
    c->set_bytes(InputBytes(entry));
    c->set_start_unix_ms(Integer(entry, "time_created_ns") / 1'000'000);
    c->set_state(Text(entry, "state"));
    if (c->state() == "completed") {
      const int64_t ended = Integer(entry, "time_discovered_completed_ns") / 1'000'000;
      c->set_end_unix_ms(ended > 0 ? ended : std::max<int64_t>(c->start_unix_ms(), 1));
    }
  }
  return record;
}

StatusOr<v1::FlightRecord> ReadFlightRecorderDump(const std::string& dir, int rank) {
  const std::string path = FlightRecorderDumpPath(dir, rank);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0 && errno == ENOENT) return NotFound("no flight-recorder dump at " + path);
  v1::FlightRecord record;
  record.set_rank(rank);
  record.set_path(path);
  if (fd < 0) {
    record.set_error(std::string("cannot open it: ") + std::strerror(errno));
    return record;
  }
  struct stat info {};
  const bool stated = fstat(fd, &info) == 0;
  if (stated) {
    record.set_written_unix_ms(static_cast<int64_t>(info.st_mtim.tv_sec) * 1000 + info.st_mtim.tv_nsec / 1'000'000);
  }
  if (!stated || !S_ISREG(info.st_mode) || static_cast<size_t>(info.st_size) > kMaxFlightRecorderDumpBytes) {
    close(fd);
    record.set_error("it is not a file of at most " + std::to_string(kMaxFlightRecorderDumpBytes >> 20) + " MiB");
    return record;
  }
  std::string data(static_cast<size_t>(info.st_size), '\0');
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = read(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  data.resize(done);
  close(fd);
  StatusOr<v1::FlightRecord> parsed = ParseFlightRecorderDump(data);
  if (!parsed.ok()) {
    record.set_error(parsed.status().message());
    return record;
  }
  parsed->set_rank(rank);
  parsed->set_path(path);
  parsed->set_written_unix_ms(record.written_unix_ms());
  return parsed;
}

bool RequestFlightRecorderDump(const std::string& dir, int rank) {
  const std::string path = FlightRecorderPipePath(dir, rank);
  struct stat info {};
  if (lstat(path.c_str(), &info) != 0 || !S_ISFIFO(info.st_mode)) return false;
  // Non-blocking: a pipe nobody reads (ENXIO) or whose buffer is full is no request.
  const int fd = open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  const bool written = write(fd, "1", 1) == 1;
  close(fd);
  return written;
}

}  // namespace ltrain::agent
