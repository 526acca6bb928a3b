// The tokenizer against the reference: Python's tiktoken package (tests/tokenizer_vs_tiktoken.py
// builds tiktoken.Encoding with Kimi's pat_str, our rank files and specials, and chunks like
// tokenization_kimi.py) must give exactly our ids, with and without special tokens, on a fixed
// corpus plus fresh random text. Two rank files: the synthetic tokenizer of the tiny presets,
// and a "pair probe" (every byte and every byte pair is a token, in a scrambled order) on which
// any difference in where the pre-tokenizer cuts changes the ids. Skipped without tiktoken.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "synth/tokenizer_synth.h"
#include "test_util.h"
#include "text/base64.h"
#include "text/tokenizer.h"
#include "text_samples.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;

void write_pair_probe(const fs::path& dir) {
  fs::create_directories(dir);
  std::vector<uint32_t> pairs(65536);
  for (uint32_t i = 0; i < pairs.size(); ++i) pairs[i] = i;
  // A fixed scramble (multiplicative hash order), so merge order is not byte order.
  std::sort(pairs.begin(), pairs.end(),
            [](uint32_t a, uint32_t b) { return (a * 2654435761u) < (b * 2654435761u); });
  std::ofstream f(dir / "tiktoken.model");
  for (int b = 0; b < 256; ++b) f << base64_encode(std::string(1, char(b))) << ' ' << b << '\n';
  for (size_t i = 0; i < pairs.size(); ++i) {
    const char two[2] = {char(pairs[i] >> 8), char(pairs[i] & 0xff)};
    f << base64_encode(std::string_view(two, 2)) << ' ' << 256 + i << '\n';
  }
}

// Non-ASCII and control characters as escapes, for failure messages.
std::string show(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out.size() > 300 ? out.substr(0, 300) + "..." : out;
}

std::string show(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size() && i < 60; ++i) out += std::to_string(ids[i]) + " ";
  return out + (ids.size() > 60 ? "..." : "");
}

TEST(TokenizerVsTiktoken, SameIdsAsPythonTiktoken) {
  if (std::system("python3 -c 'import tiktoken' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3 with the tiktoken package is not available "
                    "(python3 -m pip install tiktoken==0.14.0)";
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng r(seed);
  std::vector<std::string> texts = test::tokenizer_corpus();
  for (int i = 0; i < 400; ++i) texts.push_back(test::random_text(r, r.next_u64() % 150));
  // Long runs, where tokenization_kimi.py's chunking decides the ids.
  texts.push_back(std::string(30000, 'a') + " tail");
  texts.push_back(std::string(26000, ' ') + "x" + std::string(25001, '\n'));
  texts.push_back(test::random_text(r, 40000));

  const fs::path root = test::temp_dir("tok_vs_tiktoken");
  const fs::path synth = root / "synth", probe = root / "probe";
  write_synthetic_tokenizer(synth.string());
  write_pair_probe(probe);
  nlohmann::json job = {{"dirs", {synth.string(), probe.string()}}, {"texts", texts}};
  std::ofstream(root / "in.json") << job.dump();
  const std::string cmd = "python3 " + std::string(K3_SOURCE_DIR) +
                          "/tests/tokenizer_vs_tiktoken.py " + (root / "in.json").string() + " " +
                          (root / "out.json").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto out = nlohmann::json::parse(std::ifstream(root / "out.json"));
  // The script carries tokenization_kimi.py's pat_str; ours must be the same string.
  EXPECT_EQ(out["pattern"].get<std::string>(), std::string(kKimiPattern));
  std::printf("tiktoken %s, %zu texts\n", out["tiktoken"].get<std::string>().c_str(), texts.size());

  const PreTokenizer pre;
  for (const fs::path& dir : {synth, probe}) {
    const auto tok = Tokenizer::load(dir.string());
    const auto& res = out["results"][dir.string()];
    int mismatches = 0;
    size_t total_ids = 0;
    for (const char* mode : {"ordinary", "special"}) {
      for (size_t i = 0; i < texts.size(); ++i) {
        const auto want = res[mode][i].get<std::vector<int64_t>>();
        const auto got = tok->encode(texts[i], std::string(mode) == "special");
        total_ids += got.size();
        if (got == want) continue;
        if (++mismatches <= 5) {
          std::string cut;
          for (const auto p : pre.split(texts[i])) cut.append("[").append(show(p)).append("]");
          ADD_FAILURE() << dir.filename() << " " << mode << " text " << i << ": " << show(texts[i])
                        << "\n  ours:     " << show(got) << "\n  tiktoken: " << show(want)
                        << "\n  our pieces: " << cut;
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << dir.filename();
    std::printf("%s: %zu ids compared, %d mismatching texts\n", dir.filename().c_str(), total_ids,
                mismatches);
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace k3
