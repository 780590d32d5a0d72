#include "agent/pickle_reader.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

namespace ltrain::agent {
namespace {

using Json = nlohmann::json;
using Node = std::shared_ptr<Json>;

// A dict's key as text.
std::string KeyText(const Json& key) {
  if (key.is_string()) return key.get<std::string>();
  if (key.is_number_integer()) return std::to_string(key.get<int64_t>());
  return key.dump();
}

// The stack holds nodes: a container built in place (SETITEMS on a memoized dict) is the one the memo
// names. A finished child is copied into its parent, as Python's pickler finishes a child first.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}

  StatusOr<Json> Run() {
    while (pos_ < data_.size()) {
      const auto op = static_cast<uint8_t>(data_[pos_++]);
      if (op == '.') {
        if (stack_.size() != 1 || !marks_.empty()) return Fail("STOP with " + std::to_string(stack_.size()) + " values");
        return std::move(*stack_.back());
      }
      if (Status step = Step(op); !step.ok()) return step;
    }
    return Fail("the data ends before STOP");
  }

 private:
  Status Fail(const std::string& what) const {
    return InvalidArgument("not a pickle of plain data: " + what + " (at byte " + std::to_string(pos_) + ")");
  }

  bool Take(size_t n, std::string_view* out) {
    if (n > data_.size() - pos_) return false;
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  bool TakeUnsigned(size_t n, uint64_t* out) {
    std::string_view bytes;
    if (!Take(n, &bytes)) return false;
    *out = 0;
    for (size_t i = 0; i < n; ++i) *out |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
    return true;
  }
  bool TakeLine(std::string* out) {
    const size_t end = data_.find('\n', pos_);
    if (end == std::string_view::npos) return false;
    *out = std::string(data_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return true;
  }

  void Push(Json value) { stack_.push_back(std::make_shared<Json>(std::move(value))); }
  Node Pop() {
    Node top = stack_.back();
    stack_.pop_back();
    return top;
  }
  // The values above the topmost mark, taken off with it.
  bool PopMark(std::vector<Node>* items) {
    if (marks_.empty()) return false;
    const size_t mark = marks_.back();
    marks_.pop_back();
    if (mark > stack_.size()) return false;
    items->assign(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return true;
  }
  bool Below(size_t n) const { return stack_.size() - (marks_.empty() ? 0 : marks_.back()) < n; }

  Status Text(size_t length_bytes) {
    uint64_t length = 0;
    std::string_view text;
    if (!TakeUnsigned(length_bytes, &length) || !Take(length, &text)) return Fail("a truncated string");
    Push(std::string(text));
    return Status::Ok();
  }

  Status Step(uint8_t op) {
    uint64_t n = 0;
    std::string_view bytes;
    std::vector<Node> items;
    switch (op) {
      case 0x80:  // PROTO
        if (!TakeUnsigned(1, &n)) return Fail("a truncated PROTO");
        if (n < 2 || n > 5) return Fail("protocol " + std::to_string(n));
        return Status::Ok();
      case 0x95:  // FRAME: the frames' bytes follow in line
        if (!TakeUnsigned(8, &n)) return Fail("a truncated FRAME");
        return Status::Ok();
      case '(':
        marks_.push_back(stack_.size());
        return Status::Ok();
      case '}':
        Push(Json::object());
        return Status::Ok();
      case ']':
        Push(Json::array());
        return Status::Ok();
      case ')':
        Push(Json::array());
        return Status::Ok();
      case 'N':
        Push(nullptr);
        return Status::Ok();
      case 0x88:
        Push(true);
        return Status::Ok();
      case 0x89:
        Push(false);
        return Status::Ok();
      case 'K':
      case 'M':
        if (!TakeUnsigned(op == 'K' ? 1 : 2, &n)) return Fail("a truncated integer");
        Push(static_cast<int64_t>(n));
        return Status::Ok();
      case 'J':
        if (!TakeUnsigned(4, &n)) return Fail("a truncated integer");
        Push(static_cast<int64_t>(static_cast<int32_t>(static_cast<uint32_t>(n))));
        return Status::Ok();
      case 0x8a:  // LONG1
      case 0x8b: {  // LONG4: little-endian two's complement
        if (!TakeUnsigned(op == 0x8a ? 1 : 4, &n) || !Take(n, &bytes)) return Fail("a truncated long");
        if (n > 8) {
          Push(nullptr);  // beyond 64 bits: no field of the data read here
          return Status::Ok();
        }
        uint64_t value = 0;
        for (size_t i = 0; i < n; ++i) value |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
        if (n > 0 && n < 8 && (static_cast<uint8_t>(bytes[n - 1]) & 0x80)) value |= ~uint64_t{0} << (8 * n);
        Push(static_cast<int64_t>(value));
        return Status::Ok();
      }
      case 'G': {  // BINFLOAT: big-endian
        if (!Take(8, &bytes)) return Fail("a truncated float");
        uint64_t bits = 0;
        for (size_t i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<uint8_t>(bytes[i]);
        double value;
        std::memcpy(&value, &bits, sizeof(value));
        Push(value);
        return Status::Ok();
      }
      case 0x8c:  // SHORT_BINUNICODE
      case 'C':   // SHORT_BINBYTES
      case 'U':   // SHORT_BINSTRING
        return Text(1);
      case 'X':  // BINUNICODE
      case 'B':  // BINBYTES
      case 'T':  // BINSTRING
        return Text(4);
      case 0x8d:  // BINUNICODE8
      case 0x8e:  // BINBYTES8
        return Text(8);
      case 'q':
      case 'r':
      case 0x94: {  // BINPUT, LONG_BINPUT, MEMOIZE
        if (op == 0x94) {
          n = memo_.size();
        } else if (!TakeUnsigned(op == 'q' ? 1 : 4, &n)) {
          return Fail("a truncated PUT");
        }
        if (stack_.empty()) return Fail("PUT on an empty stack");
        memo_[n] = stack_.back();
        return Status::Ok();
      }
      case 'h':
      case 'j': {  // BINGET, LONG_BINGET
        if (!TakeUnsigned(op == 'h' ? 1 : 4, &n)) return Fail("a truncated GET");
        auto found = memo_.find(n);
        if (found == memo_.end()) return Fail("GET of memo " + std::to_string(n) + ", never put");
        stack_.push_back(found->second);
        return Status::Ok();
      }
      case 'a':  // APPEND
        if (Below(2) || !stack_[stack_.size() - 2]->is_array()) return Fail("APPEND to no list");
        {
          Node item = Pop();
          stack_.back()->push_back(*item);
        }
        return Status::Ok();
      case 'e':  // APPENDS
        if (!PopMark(&items) || stack_.empty() || !stack_.back()->is_array()) return Fail("APPENDS to no list");
        for (const auto& item : items) stack_.back()->push_back(*item);
        return Status::Ok();
      case 's':  // SETITEM
        if (Below(3) || !stack_[stack_.size() - 3]->is_object()) return Fail("SETITEM to no dict");
        {
          Node value = Pop();
          Node key = Pop();
          (*stack_.back())[KeyText(*key)] = *value;
        }
        return Status::Ok();
      case 'u':  // SETITEMS
        if (!PopMark(&items) || items.size() % 2 != 0 || stack_.empty() || !stack_.back()->is_object()) {
          return Fail("SETITEMS to no dict");
        }
        for (size_t i = 0; i < items.size(); i += 2) (*stack_.back())[KeyText(*items[i])] = *items[i + 1];
        return Status::Ok();
      case 'd':  // DICT
      case 'l':  // LIST
      case 't': {  // TUPLE
        if (!PopMark(&items)) return Fail("a container without its MARK");
        if (op == 'd') {
          if (items.size() % 2 != 0) return Fail("DICT of an odd count");
          Json dict = Json::object();
          for (size_t i = 0; i < items.size(); i += 2) dict[KeyText(*items[i])] = *items[i + 1];
          Push(std::move(dict));
        } else {
          Json list = Json::array();
          for (const auto& item : items) list.push_back(*item);
          Push(std::move(list));
        }
        return Status::Ok();
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1-3
        const size_t count = op - 0x84;
        if (Below(count)) return Fail("a tuple of missing items");
        Json tuple = Json::array();
        for (size_t i = stack_.size() - count; i < stack_.size(); ++i) tuple.push_back(*stack_[i]);
        stack_.resize(stack_.size() - count);
        Push(std::move(tuple));
        return Status::Ok();
      }
      case '0':  // POP
        if (Below(1)) {
          if (marks_.empty()) return Fail("POP of an empty stack");
          marks_.pop_back();
        } else {
          stack_.pop_back();
        }
        return Status::Ok();
      case '1':  // POP_MARK
        if (!PopMark(&items)) return Fail("POP_MARK without a MARK");
        return Status::Ok();
      case '2':  // DUP
        if (stack_.empty()) return Fail("DUP of an empty stack");
        stack_.push_back(stack_.back());
        return Status::Ok();
      case 'c': {  // GLOBAL module\nname\n
        std::string module, name;
        if (!TakeLine(&module) || !TakeLine(&name)) return Fail("a truncated GLOBAL");
        Push(Json{{"__global__", module + "." + name}});
        return Status::Ok();
      }
      case 0x93: {  // STACK_GLOBAL
        if (Below(2)) return Fail("STACK_GLOBAL of missing names");
        Node name = Pop();
        Node module = Pop();
        Push(Json{{"__global__", KeyText(*module) + "." + KeyText(*name)}});
        return Status::Ok();
      }
      case 'R': {  // REDUCE: LibTorch's typed lists read as their list; any other call as null
        if (Below(2)) return Fail("REDUCE of missing values");
        Node args = Pop();
        Node callable = Pop();
        const bool typed_list = callable->is_object() && callable->contains("__global__") &&
                                (*callable)["__global__"].get<std::string>().rfind("torch.jit._pickle.build_", 0) == 0;
        if (typed_list && args->is_array() && args->size() == 1) {
          Push((*args)[0]);
        } else {
          Push(nullptr);
        }
        return Status::Ok();
      }
      case 0x81:  // NEWOBJ
      case 'b':   // BUILD: the object stays what it was (null)
        if (Below(2)) return Fail("an object of missing values");
        Pop();
        if (op == 0x81) {
          Pop();
          Push(nullptr);
        }
        return Status::Ok();
      case 'Q':  // BINPERSID: a tensor's storage; none in plain data
        if (Below(1)) return Fail("BINPERSID of nothing");
        Pop();
        Push(nullptr);
        return Status::Ok();
      default: {
        char text[8];
        std::snprintf(text, sizeof(text), "0x%02x", op);
        return Fail(std::string("opcode ") + text + " is not read");
      }
    }
  }

  std::string_view data_;
  size_t pos_ = 0;
  std::vector<Node> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, Node> memo_;
};

}  // namespace

StatusOr<nlohmann::json> ReadPickle(std::string_view data) { return Reader(data).Run(); }

}  // namespace ltrain::agent
