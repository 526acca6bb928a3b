#include "text/byte_tokenizer.h"

#include <cctype>

#include "core/error.h"

namespace k3 {

std::vector<int64_t> byte_encode(const std::string& text) {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::string byte_decode(const std::vector<int64_t>& ids) {
  std::string out;
  for (int64_t id : ids) {
    if (id >= 0 && id < 256)
      out.push_back(static_cast<char>(id));
    else
      out += "<|" + std::to_string(id) + "|>";
  }
  return out;
}

std::vector<int64_t> parse_token_ids(const std::string& csv) {
  std::vector<int64_t> ids;
  size_t i = 0;
  while (i < csv.size()) {
    while (i < csv.size() && (std::isspace(static_cast<unsigned char>(csv[i])) || csv[i] == ','))
      ++i;
    if (i == csv.size()) break;
    size_t j = i;
    while (j < csv.size() && csv[j] != ',' && !std::isspace(static_cast<unsigned char>(csv[j])))
      ++j;
    const std::string item = csv.substr(i, j - i);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    K3_CHECK(used == item.size() && v >= 0, "token id \"", item,
             "\" is not a non-negative integer");
    ids.push_back(v);
    i = j;
  }
  K3_CHECK(!ids.empty(), "no token ids given");
  return ids;
}

}  // namespace k3
