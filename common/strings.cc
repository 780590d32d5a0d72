#include "common/strings.h"

namespace ltrain {

std::vector<std::string> Split(std::string_view text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(separator, start);
    parts.emplace_back(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

std::vector<std::string> SplitNonEmpty(std::string_view text, char separator) {
  std::vector<std::string> parts;
  for (std::string& part : Split(text, separator)) {
    if (!part.empty()) parts.push_back(std::move(part));
  }
  return parts;
}

std::string Shortened(std::string_view text, size_t max) {
  if (text.size() <= max) return std::string(text);
  size_t cut = max > 24 ? max - 24 : max;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 character
  return std::string(text.substr(0, cut)) + "... (" + std::to_string(text.size()) + " bytes)";
}

}  // namespace ltrain
