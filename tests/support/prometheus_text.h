// A strict reader of Prometheus' text exposition format (version 0.0.4), for tests of GET /metrics:
// every line must be a HELP or TYPE comment, another comment, or a sample `name{label="value",...}
// value [timestamp]` with valid names, escapes and number; a family's TYPE comes once, before its
// samples, and its samples are not interleaved with another family's.
#pragma once

#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace ltrain::testing {

struct PrometheusSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct PrometheusParse {
  std::string error;  // empty when every line is valid: "line N: why"
  std::vector<PrometheusSample> samples;
  std::map<std::string, std::string> types;  // family -> counter, gauge, ...
};

inline bool IsMetricName(const std::string& s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' || (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

inline bool IsLabelName(const std::string& s) { return IsMetricName(s) && s.find(':') == std::string::npos; }

inline bool ParsePrometheusNumber(const std::string& text, double& value) {
  if (text == "NaN" || text == "+Inf" || text == "Inf" || text == "-Inf") {
    value = text == "NaN" ? NAN : text == "-Inf" ? -INFINITY : INFINITY;
    return true;
  }
  if (text.empty()) return false;
  char* end = nullptr;
  value = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size();
}

inline PrometheusParse ParsePrometheusText(const std::string& text) {
  PrometheusParse out;
  std::istringstream in(text);
  std::string line;
  int number = 0;
  std::string current_family;
  std::set<std::string> finished_families;
  auto fail = [&](const std::string& why) {
    out.error = "line " + std::to_string(number) + ": " + why + ": " + line;
    return out;
  };
  if (!text.empty() && text.back() != '\n') {
    out.error = "the text does not end with a line feed";
    return out;
  }
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::istringstream words(line.substr(1));
      std::string keyword, name;
      words >> keyword >> name;
      if (keyword == "TYPE") {
        std::string type, rest;
        words >> type;
        if (!IsMetricName(name)) return fail("a TYPE line with a bad metric name");
        if (type != "counter" && type != "gauge" && type != "histogram" && type != "summary" && type != "untyped") {
          return fail("an unknown type");
        }
        if (words >> rest) return fail("text after the type");
        if (out.types.count(name)) return fail("a second TYPE line for " + name);
        out.types[name] = type;
      } else if (keyword == "HELP") {
        if (!IsMetricName(name)) return fail("a HELP line with a bad metric name");
      }
      continue;
    }
    PrometheusSample sample;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    sample.name = line.substr(0, i);
    if (!IsMetricName(sample.name)) return fail("a bad metric name");
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        size_t eq = line.find('=', i);
        if (eq == std::string::npos) return fail("a label without '='");
        const std::string label = line.substr(i, eq - i);
        if (!IsLabelName(label)) return fail("a bad label name '" + label + "'");
        if (eq + 1 >= line.size() || line[eq + 1] != '"') return fail("a label value without quotes");
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\') {
            if (j + 1 >= line.size()) return fail("an escape at the end");
            const char e = line[++j];
            if (e == 'n') {
              value += '\n';
            } else if (e == '\\' || e == '"') {
              value += e;
            } else {
              return fail("an unknown escape");
            }
          } else {
            value += line[j];
          }
        }
        if (j >= line.size()) return fail("an unterminated label value");
        if (sample.labels.count(label)) return fail("a repeated label");
        sample.labels[label] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) return fail("no closing brace");
      ++i;
    }
    if (i >= line.size() || line[i] != ' ') return fail("no space before the value");
    std::istringstream rest(line.substr(i + 1));
    std::string value, timestamp, extra;
    rest >> value >> timestamp >> extra;
    if (!ParsePrometheusNumber(value, sample.value)) return fail("a value that is not a number");
    if (!timestamp.empty()) {
      double ts = 0;
      if (!ParsePrometheusNumber(timestamp, ts) || ts != std::floor(ts)) return fail("a bad timestamp");
    }
    if (!extra.empty()) return fail("text after the timestamp");
    const std::string family = sample.name;
    if (!out.types.count(family)) return fail("a sample before its family's TYPE line");
    if (family != current_family) {
      if (finished_families.count(family)) return fail("samples of " + family + " apart from the others");
      if (!current_family.empty()) finished_families.insert(current_family);
      current_family = family;
    }
    out.samples.push_back(std::move(sample));
  }
  return out;
}

}  // namespace ltrain::testing
