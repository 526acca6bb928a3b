// Standard base64 (RFC 4648 alphabet, '=' padding), as tiktoken.model stores token bytes.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace k3 {

std::string base64_encode(std::string_view bytes);
// nullopt unless s is canonical padded base64 (length a multiple of 4, padding only at the end).
std::optional<std::string> base64_decode(std::string_view s);

}  // namespace k3
