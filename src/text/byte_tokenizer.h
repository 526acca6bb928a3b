// Byte-level fallback tokenizer until the real tiktoken BPE lands: token id = byte value for
// ids < 256; ids >= 256 are special tokens, shown as <|id|>.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k3 {

std::vector<int64_t> byte_encode(const std::string& text);
std::string byte_decode(const std::vector<int64_t>& ids);
// Parses "1,2, 3" into ids; throws k3::Error naming the bad entry.
std::vector<int64_t> parse_token_ids(const std::string& csv);

}  // namespace k3
