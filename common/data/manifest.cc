#include "common/data/manifest.h"

#include <openssl/evp.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <yaml-cpp/yaml.h>

#include "common/files.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

void PutLe(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

}  // namespace

Status WriteDataInfo(const std::string& dir, const DataInfo& info) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  if (info.format >= 2) out << YAML::Key << "format" << YAML::Value << info.format;
  out << YAML::Key << "tokenizer" << YAML::Value << info.tokenizer;
  out << YAML::Key << "tokenizer_file" << YAML::Value << info.tokenizer_file;
  if (!info.tokenizer_sha256.empty()) out << YAML::Key << "tokenizer_sha256" << YAML::Value << info.tokenizer_sha256;
  if (!info.tokenizer_from.empty()) out << YAML::Key << "tokenizer_from" << YAML::Value << info.tokenizer_from;
  out << YAML::Key << "vocab" << YAML::Value << info.vocab;
  if (info.format >= 2) out << YAML::Key << "dtype" << YAML::Value << info.dtype;
  if (info.sft) out << YAML::Key << "sft" << YAML::Value << true;
  out << YAML::Key << "train_tokens" << YAML::Value << info.train_tokens;
  out << YAML::Key << "val_tokens" << YAML::Value << info.val_tokens;
  if (info.format >= 2) {
    out << YAML::Key << "train_documents" << YAML::Value << info.train_documents;
    out << YAML::Key << "val_documents" << YAML::Value << info.val_documents;
    out << YAML::Key << "inputs" << YAML::Value << YAML::BeginSeq;
    for (const InputInfo& input : info.inputs) {
      out << YAML::Flow << YAML::BeginMap << YAML::Key << "path" << YAML::Value << input.path << YAML::Key << "bytes"
          << YAML::Value << input.bytes << YAML::Key << "documents" << YAML::Value << input.documents << YAML::EndMap;
    }
    out << YAML::EndSeq;
    out << YAML::Key << "shards" << YAML::Value << YAML::BeginSeq;
    for (const ShardInfo& s : info.shards) {
      out << YAML::Flow << YAML::BeginMap << YAML::Key << "file" << YAML::Value << s.file << YAML::Key << "index"
          << YAML::Value << s.index << YAML::Key << "split" << YAML::Value << s.split << YAML::Key << "tokens"
          << YAML::Value << s.tokens << YAML::Key << "documents" << YAML::Value << s.documents << YAML::Key
          << "first_input" << YAML::Value << s.first_input << YAML::Key << "last_input" << YAML::Value << s.last_input
          << YAML::Key << "xxh3" << YAML::Value << s.xxh3;
      if (!s.mask.empty()) out << YAML::Key << "mask" << YAML::Value << s.mask;
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  out << YAML::EndMap;
  return WriteFileAtomically((fs::path(dir) / "data.yaml").string(), std::string(out.c_str()) + "\n");
}

StatusOr<DataInfo> ReadDataInfo(const std::string& dir) {
  const std::string path = (fs::path(dir) / "data.yaml").string();
  std::error_code ec;
  if (!fs::exists(path, ec)) return NotFound(path + " does not exist");
  try {
    YAML::Node node = YAML::LoadFile(path);
    DataInfo info;
    info.format = node["format"].as<int>(1);
    if (info.format < 1 || info.format > 2) {
      return DataLoss(path + " is of format " + std::to_string(info.format) + ", which this build does not read "
                      "(it reads 1 and 2): prepare the data with this build, or use a newer ltrain");
    }
    info.tokenizer = node["tokenizer"].as<std::string>("byte");
    info.tokenizer_file = node["tokenizer_file"].as<std::string>("");
    info.tokenizer_sha256 = node["tokenizer_sha256"].as<std::string>("");
    info.tokenizer_from = node["tokenizer_from"].as<std::string>("");
    info.vocab = node["vocab"].as<int>(256);
    info.dtype = node["dtype"].as<std::string>(info.vocab <= 65536 ? "uint16" : "uint32");
    info.sft = node["sft"].as<bool>(false);
    info.train_tokens = node["train_tokens"].as<int64_t>(0);
    info.val_tokens = node["val_tokens"].as<int64_t>(0);
    info.train_documents = node["train_documents"].as<int64_t>(0);
    info.val_documents = node["val_documents"].as<int64_t>(0);
    for (const YAML::Node& n : node["inputs"]) {
      info.inputs.push_back({n["path"].as<std::string>(), n["bytes"].as<int64_t>(0), n["documents"].as<int64_t>(0)});
    }
    for (const YAML::Node& n : node["shards"]) {
      ShardInfo s;
      s.file = n["file"].as<std::string>();
      s.index = n["index"].as<std::string>("");
      s.split = n["split"].as<std::string>();
      s.tokens = n["tokens"].as<int64_t>();
      s.documents = n["documents"].as<int64_t>(0);
      s.first_input = n["first_input"].as<int>(0);
      s.last_input = n["last_input"].as<int>(0);
      s.xxh3 = n["xxh3"].as<std::string>("");
      s.mask = n["mask"].as<std::string>("");
      if (info.sft && s.mask.empty()) return DataLoss(path + ": shard " + s.file + " of SFT data names no mask file");
      if (s.split != "train" && s.split != "val") {
        return DataLoss(path + ": shard " + s.file + " has split '" + s.split + "', not train or val");
      }
      if (s.file.find('/') != std::string::npos || s.index.find('/') != std::string::npos ||
          s.mask.find('/') != std::string::npos) {
        return DataLoss(path + ": shard " + s.file + " names a file outside the dataset directory");
      }
      info.shards.push_back(std::move(s));
    }
    return info;
  } catch (const std::exception& e) {
    return DataLoss(path + " cannot be read: " + e.what());
  }
}

std::string DocumentIndexHeader(bool continues, uint64_t documents) {
  std::string bytes(kIndexMagic, sizeof(kIndexMagic));
  PutLe(&bytes, kIndexFormatVersion, 4);
  PutLe(&bytes, continues ? 1 : 0, 4);
  PutLe(&bytes, documents, 8);
  return bytes;
}

StatusOr<DocumentIndex> ReadDocumentIndex(const std::string& path) {
  LTRAIN_ASSIGN_OR_RETURN(std::string bytes, ReadFileText(path));
  if (bytes.size() < kIndexHeaderBytes || std::memcmp(bytes.data(), kIndexMagic, sizeof(kIndexMagic)) != 0) {
    return DataLoss("index file " + path + " has no LTRNIDX1 header: not a document index");
  }
  const uint64_t version = GetLe(bytes.data() + 8, 4);
  if (version != kIndexFormatVersion) {
    return DataLoss("index file " + path + " has format version " + std::to_string(version) + ", this build reads " +
                    std::to_string(kIndexFormatVersion));
  }
  DocumentIndex index;
  index.continues = (GetLe(bytes.data() + 12, 4) & 1) != 0;
  const uint64_t n = GetLe(bytes.data() + 16, 8);
  if (bytes.size() != kIndexHeaderBytes + 8 * n) {
    return DataLoss("index file " + path + " says " + std::to_string(n) + " documents but holds " +
                    std::to_string((bytes.size() - kIndexHeaderBytes) / 8) + ": truncated or corrupt");
  }
  index.starts.resize(n);
  for (uint64_t i = 0; i < n; ++i) index.starts[i] = GetLe(bytes.data() + kIndexHeaderBytes + 8 * i, 8);
  return index;
}

StatusOr<std::string> FileSha256(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot read " + path);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    EVP_DigestUpdate(ctx, buf.data(), static_cast<size_t>(in.gcount()));
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, digest, &len);
  EVP_MD_CTX_free(ctx);
  std::string hex;
  char two[3];
  for (unsigned int i = 0; i < len; ++i) {
    std::snprintf(two, sizeof(two), "%02x", digest[i]);
    hex += two;
  }
  return hex;
}

}  // namespace ltrain
