// Parsing K3 assistant output (reasoning / content / tool calls) one-shot and streaming. Model
// output is never an error: malformed structure comes back as content.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "core/rng.h"
#include "test_util.h"
#include "text/chat.h"

namespace k3 {
namespace {

using nlohmann::json;

const std::string kEnd = "<|close|>message<|sep|><|end_of_msg|>";

// A thinking-mode completion: the prompt already opened the think channel.
std::string completion(const std::string& reasoning, const std::string& content,
                       const std::string& tools = "") {
  return reasoning + "<|close|>think<|sep|><|open|>response<|sep|>" + content +
         "<|close|>response<|sep|>" + tools + kEnd;
}

std::string call(const std::string& name, int index, const std::string& args) {
  return "<|open|>call tool=\"" + name + "\" index=\"" + std::to_string(index) + "\"<|sep|>" +
         args + "<|close|>call<|sep|>";
}
std::string arg(const std::string& key, const std::string& type, const std::string& value) {
  return "<|open|>argument key=\"" + key + "\" type=\"" + type + "\"<|sep|>" + value +
         "<|close|>argument<|sep|>";
}
std::string tools(const std::string& calls) {
  return "<|open|>tools<|sep|>" + calls + "<|close|>tools<|sep|>";
}

TEST(ChatOutput, PlainTextInstructMode) {
  auto o = parse_assistant_output("Hello there.<|close|>response<|sep|>" + kEnd, false);
  EXPECT_EQ(o.content, "Hello there.");
  EXPECT_EQ(o.reasoning_content, "");
  EXPECT_TRUE(o.tool_calls.empty());
  // No markers at all (or the end token stripped by the caller): everything is content.
  EXPECT_EQ(parse_assistant_output("just text", false).content, "just text");
  // Literal angle brackets in text survive.
  EXPECT_EQ(parse_assistant_output("a < b <| c |> d <", false).content, "a < b <| c |> d <");
}

TEST(ChatOutput, ReasoningAndContent) {
  auto o = parse_assistant_output(completion("Think hard. ", "\nAnswer: 4"), true);
  EXPECT_EQ(o.reasoning_content, "Think hard. ");  // verbatim, like the model wrote it
  EXPECT_EQ(o.content, "\nAnswer: 4");
  // A repeated opening tag is tolerated.
  o = parse_assistant_output("<|open|>think<|sep|>r" + completion("", "c"), true);
  EXPECT_EQ(o.reasoning_content, "r");
  EXPECT_EQ(o.content, "c");
  // A dropped think close is recovered at the response opener.
  o = parse_assistant_output("r<|open|>response<|sep|>c<|close|>response<|sep|>" + kEnd, true);
  EXPECT_EQ(o.reasoning_content, "r");
  EXPECT_EQ(o.content, "c");
}

TEST(ChatOutput, OneToolCall) {
  const auto o = parse_assistant_output(
      completion("Need weather.", "",
                 tools(call("get_weather", 1,
                            arg("city", "string", "Paris") + arg("days", "number", "2")))),
      true);
  EXPECT_EQ(o.reasoning_content, "Need weather.");
  EXPECT_EQ(o.content, "");
  ASSERT_EQ(o.tool_calls.size(), 1u);
  EXPECT_EQ(o.tool_calls[0].id, "functions.get_weather:1");
  EXPECT_EQ(o.tool_calls[0].name, "get_weather");
  EXPECT_EQ(o.tool_calls[0].arguments, R"({"city":"Paris","days":2})");
}

TEST(ChatOutput, SeveralToolCallsKeepArgumentJson) {
  const std::string code = "def f(x):\n    return \"<tag>\" + x\n";
  const auto o = parse_assistant_output(
      completion(
          "", "Checking.",
          tools(call("run", 1,
                     arg("code", "string", code) + arg("flag", "boolean", "true") +
                         arg("none", "null", "null") + arg("cfg", "object", R"({"a": [1, 2.5]})") +
                         arg("ids", "array", "[3, 4]")) +
                call("now", 2, "") +
                call("q&a", 3,
                     "<|open|>json type=\"object\"<|sep|>{\"k\": \"v\"}<|close|>json<|sep|>"))),
      true);
  EXPECT_EQ(o.content, "Checking.");
  ASSERT_EQ(o.tool_calls.size(), 3u);
  EXPECT_EQ(json::parse(o.tool_calls[0].arguments), (json{{"code", code},
                                                          {"flag", true},
                                                          {"none", nullptr},
                                                          {"cfg", {{"a", {1, 2.5}}}},
                                                          {"ids", {3, 4}}}));
  EXPECT_EQ(o.tool_calls[0].arguments.substr(0, 8), "{\"code\":");  // model order kept
  EXPECT_EQ(o.tool_calls[1].id, "functions.now:2");
  EXPECT_EQ(o.tool_calls[1].arguments, "{}");
  EXPECT_EQ(o.tool_calls[2].name, "q&a");
  EXPECT_EQ(o.tool_calls[2].arguments, R"({"k":"v"})");
}

TEST(ChatOutput, MalformedAndTruncatedFallBackGracefully) {
  // Truncated while thinking: reasoning only.
  auto o = parse_assistant_output("still thinking", true);
  EXPECT_EQ(o.reasoning_content, "still thinking");
  EXPECT_EQ(o.content, "");
  // A marker cut in half at the end is dropped, not shown.
  EXPECT_EQ(parse_assistant_output("Hi<|close|>resp", false).content, "Hi");
  EXPECT_EQ(parse_assistant_output("Hi<|clo", false).content, "Hi");
  // A tool call that never closes comes back as content, verbatim.
  const std::string open_call = "<|open|>call tool=\"f\" index=\"1\"<|sep|>" +
                                std::string("<|open|>argument key=\"x\" type=\"string\"<|sep|>abc");
  o = parse_assistant_output("c<|close|>response<|sep|><|open|>tools<|sep|>" + open_call, false);
  EXPECT_EQ(o.content, "c" + open_call);
  EXPECT_TRUE(o.tool_calls.empty());
  // A call without a tool name, or stray text in the tools section: content from there on.
  o = parse_assistant_output(
      completion("", "c", tools(call("ok", 1, "") + "<|open|>call index=\"2\"<|sep|>junk")), true);
  ASSERT_EQ(o.tool_calls.size(), 1u);
  EXPECT_EQ(o.content, "c<|open|>call index=\"2\"<|sep|>junk");
  o = parse_assistant_output(completion("", "c", tools("hello" + call("ok", 1, ""))), true);
  EXPECT_EQ(o.content, "chello" + call("ok", 1, ""));
  EXPECT_TRUE(o.tool_calls.empty());
  // Invalid JSON in a json block; a typed value that is not JSON is kept as a string.
  o = parse_assistant_output(
      completion("", "",
                 tools(call("f", 1, "<|open|>json type=\"object\"<|sep|>{x<|close|>json<|sep|>"))),
      true);
  EXPECT_TRUE(o.tool_calls.empty());
  EXPECT_NE(o.content.find("{x"), std::string::npos);
  o = parse_assistant_output(completion("", "", tools(call("f", 1, arg("n", "number", "many")))),
                             true);
  ASSERT_EQ(o.tool_calls.size(), 1u);
  EXPECT_EQ(o.tool_calls[0].arguments, R"({"n":"many"})");
  // Nothing after the closed message belongs to it.
  o = parse_assistant_output(
      "a<|close|>response<|sep|>" + kEnd + "<|open|>message role=\"user\"<|sep|>x", false);
  EXPECT_EQ(o.content, "a");
}

// Random chunking must give the one-shot totals, and no feed() delta may end inside a marker.
struct Collected {
  AssistantOutput total;
  bool partial_marker = false;
  bool saw_lt_pipe = false;
};

bool ends_in_partial_marker(const std::string& s) {
  for (const ChatSpecialToken& t : xtml::kTokens)
    for (size_t n = 1; n < t.text.size() && n <= s.size(); ++n)
      if (s.compare(s.size() - n, n, t.text.substr(0, n)) == 0) return true;
  return false;
}

void add(Collected& c, const AssistantDelta& d, bool final) {
  c.total.content += d.content;
  c.total.reasoning_content += d.reasoning_content;
  for (const ToolCall& t : d.tool_calls) c.total.tool_calls.push_back(t);
  if (!final && (ends_in_partial_marker(d.content) || ends_in_partial_marker(d.reasoning_content)))
    c.partial_marker = true;
  if (d.content.find("<|") != std::string::npos ||
      d.reasoning_content.find("<|") != std::string::npos)
    c.saw_lt_pipe = true;
}

Collected stream(const std::string& text, bool thinking, Rng& rng) {
  AssistantStreamParser p(thinking);
  Collected c;
  for (size_t pos = 0; pos < text.size();) {
    const size_t n = 1 + rng.next_u64() % (rng.uniform() < 0.5 ? 4 : 24);
    add(c, p.feed(std::string_view(text).substr(pos, n)), false);
    pos += n;
  }
  add(c, p.finish(), true);
  return c;
}

void expect_same(const AssistantOutput& a, const AssistantOutput& b, const std::string& text) {
  EXPECT_EQ(a.content, b.content) << text;
  EXPECT_EQ(a.reasoning_content, b.reasoning_content) << text;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << text;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].id, b.tool_calls[i].id) << text;
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments) << text;
  }
}

TEST(ChatStream, RandomChunksMatchOneShotAndNeverSplitMarkers) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<std::pair<std::string, bool>> wellformed = {
      {completion("Let me think.\nStep 1.", "The answer is 42."), true},
      {completion("", "", tools(call("a", 1, arg("x", "string", "1 > 0")) + call("b", 2, ""))),
       true},
      {"Hello!<|close|>response<|sep|>" + kEnd, false},
      {completion("r", "c", tools(call("f", 1, arg("o", "object", R"({"k": [1, {"z": null}]})")))),
       true},
  };
  for (const auto& [text, thinking] : wellformed) {
    const AssistantOutput want = parse_assistant_output(text, thinking);
    for (int rep = 0; rep < 50; ++rep) {
      const Collected c = stream(text, thinking, rng);
      expect_same(c.total, want, text);
      EXPECT_FALSE(c.saw_lt_pipe) << "a marker leaked into a delta: " << text;
    }
  }
}

// Token soup: markers, tag names, attributes and text in random order. Whatever the parser makes
// of it, streaming must agree with one-shot, and nothing may throw.
TEST(ChatStream, RandomSoupNeverThrowsAndStreamsConsistently) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<std::string> pieces = {"<|open|>",
                                           "<|close|>",
                                           "<|sep|>",
                                           "<|end_of_msg|>",
                                           "think",
                                           "response",
                                           "tools",
                                           "call",
                                           "argument",
                                           "json",
                                           "message",
                                           " tool=\"f\"",
                                           " index=\"1\"",
                                           " key=\"k\"",
                                           " type=\"string\"",
                                           " type=\"number\"",
                                           " type=\"object\"",
                                           "hello ",
                                           "12",
                                           "{\"a\":1}",
                                           "\n",
                                           " ",
                                           "&quot;",
                                           "x"};
  for (int rep = 0; rep < 300; ++rep) {
    std::string text;
    const size_t n = rng.next_u64() % 40;
    for (size_t i = 0; i < n; ++i) text += pieces[rng.next_u64() % pieces.size()];
    const bool thinking = rng.uniform() < 0.5;
    AssistantOutput want;
    ASSERT_NO_THROW(want = parse_assistant_output(text, thinking)) << text;
    for (int k = 0; k < 4; ++k) {
      const Collected c = stream(text, thinking, rng);
      expect_same(c.total, want, text);
      EXPECT_FALSE(c.partial_marker) << text;
    }
  }
}

TEST(ChatStream, DoneAfterMessageClose) {
  AssistantStreamParser p(false);
  p.feed("hi<|close|>response<|sep|><|close|>mess");
  EXPECT_FALSE(p.done());
  const AssistantDelta d = p.feed("age<|sep|>");
  EXPECT_TRUE(p.done());
  EXPECT_TRUE(d.empty());
  EXPECT_TRUE(p.finish().empty());
}

}  // namespace
}  // namespace k3
