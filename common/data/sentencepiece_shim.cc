// libltrain_sentencepiece.so: SentencePiece behind a C interface, for common/data/tokenizer.cc to load
// with dlopen(RTLD_LOCAL | RTLD_DEEPBIND). Debian's libsentencepiece carries its own copy of
// protobuf-lite and exports it; linked into a process that also has libprotobuf (gRPC), the two bind
// to each other's symbols and the process crashes while loading. Loaded this way its symbols stay
// its own. Strings and arrays it returns are malloc'd: the caller frees them.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <sentencepiece_processor.h>

namespace {

char* Copy(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

}  // namespace

extern "C" {

// A processor for the model at `path`, or null with the reason in *error.
void* ltrain_sp_load(const char* path, char** error) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  const auto status = sp->Load(path);
  if (!status.ok()) {
    *error = Copy(status.ToString());
    delete sp;
    return nullptr;
  }
  return sp;
}

void ltrain_sp_free(void* sp) { delete static_cast<sentencepiece::SentencePieceProcessor*>(sp); }

// The ids of `text` into *ids (malloc'd), their count returned; -1 on failure.
long ltrain_sp_encode(void* sp, const char* text, size_t length, int** ids) {
  std::vector<int> out;
  if (!static_cast<sentencepiece::SentencePieceProcessor*>(sp)->Encode(std::string(text, length), &out).ok()) return -1;
  *ids = static_cast<int*>(std::malloc(sizeof(int) * (out.empty() ? 1 : out.size())));
  if (*ids == nullptr) return -1;
  std::memcpy(*ids, out.data(), sizeof(int) * out.size());
  return static_cast<long>(out.size());
}

// The text of `count` ids (malloc'd, *length bytes), or null.
char* ltrain_sp_decode(void* sp, const int* ids, size_t count, size_t* length) {
  std::string out;
  if (!static_cast<sentencepiece::SentencePieceProcessor*>(sp)->Decode(std::vector<int>(ids, ids + count), &out).ok()) {
    return nullptr;
  }
  *length = out.size();
  return Copy(out);
}

int ltrain_sp_piece_size(void* sp) { return static_cast<sentencepiece::SentencePieceProcessor*>(sp)->GetPieceSize(); }

int ltrain_sp_eos_id(void* sp) { return static_cast<sentencepiece::SentencePieceProcessor*>(sp)->eos_id(); }

}  // extern "C"
