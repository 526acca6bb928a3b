// K3 chat rendering (XTML, see src/text/chat.h for the sources) and OpenAI message parsing. The
// expected prompts are written out by hand from the format description, byte for byte.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "core/error.h"
#include "text/chat.h"

namespace k3 {
namespace {

using nlohmann::json;

const std::string kEffortMax =
    "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides on "
    "how much to think in your thinking channel (not including the response channel), supported "
    "values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
    "`thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>";

ChatMessage msg(std::string role, std::string content) {
  ChatMessage m;
  m.role = std::move(role);
  m.content = std::move(content);
  return m;
}

ChatOptions instruct() {
  ChatOptions o;
  o.thinking = false;
  return o;
}

json weather_tool() {
  return json::parse(R"({"type":"function","function":{"name":"get_weather",
    "description":"Weather lookup.","parameters":{"type":"object",
    "properties":{"city":{"type":"string"}},"required":["city"]}}})");
}

TEST(ChatRender, SystemAndUserWithThinking) {
  const std::string got = render_chat({msg("system", "Be brief."), msg("user", "Hi")}, {});
  EXPECT_EQ(got, kEffortMax +
                     "<|open|>message role=\"system\"<|sep|>Be brief.<|close|>message<|sep|>"
                     "<|end_of_msg|><|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|>"
                     "<|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
}

TEST(ChatRender, InstructModeOpensResponseAndHasNoEffortMessage) {
  EXPECT_EQ(render_chat({msg("user", "Hi")}, instruct()),
            "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
}

TEST(ChatRender, GenerationPromptOff) {
  ChatOptions o = instruct();
  o.add_generation_prompt = false;
  ChatMessage a = msg("assistant", "Hello!");
  EXPECT_EQ(render_chat({msg("user", "Hi"), a}, o),
            "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>Hello!"
            "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>");
}

TEST(ChatRender, MultiTurnKeepsReasoningWhenThinkingAndDropsTheChannelOtherwise) {
  ChatMessage a = msg("assistant", "4");
  a.reasoning_content = "2+2 is 4.";
  const std::vector<ChatMessage> chat = {msg("user", "2+2?"), a, msg("user", "And 3+3?")};
  ChatOptions o;
  o.thinking_effort = "";  // no effort message, to keep the expectation short
  EXPECT_EQ(render_chat(chat, o),
            "<|open|>message role=\"user\"<|sep|>2+2?<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>2+2 is 4."
            "<|close|>think<|sep|><|open|>response<|sep|>4<|close|>response<|sep|>"
            "<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"user\"<|sep|>And 3+3?<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
  const std::string plain = render_chat(chat, instruct());
  EXPECT_EQ(plain.find("think"), std::string::npos);
  EXPECT_NE(
      plain.find("<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>4<|close|>"),
      std::string::npos);
  // Whitespace-only reasoning leaves the (structural) think channel empty.
  a.reasoning_content = " \n";
  EXPECT_NE(render_chat({msg("user", "q"), a}, o).find("<|open|>think<|sep|><|close|>think<|sep|>"),
            std::string::npos);
}

TEST(ChatRender, ToolsAreDeclaredFirstSortedAndCompact) {
  ChatOptions o;
  o.tools = json::array({weather_tool()});
  const std::string got = render_chat({msg("user", "Weather?")}, o);
  const std::string declare =
      "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\nHere are the "
      "available tools, described in JSONSchema.\n\n```json\n[{\"function\":{\"description\":"
      "\"Weather lookup.\",\"name\":\"get_weather\",\"parameters\":{\"properties\":{\"city\":"
      "{\"type\":\"string\"}},\"required\":[\"city\"],\"type\":\"object\"}},\"type\":"
      "\"function\"}]\n```<|close|>message<|sep|><|end_of_msg|>";
  EXPECT_EQ(got.substr(0, declare.size()), declare);
  EXPECT_EQ(got.substr(declare.size(), kEffortMax.size()), kEffortMax);
}

// A prompt quoted in a public tokenizer check against frozen official Kimi-K3 token ids (tools,
// one user turn, tool_choice=required, instruct mode), reproduced byte for byte.
TEST(ChatRender, MatchesQuotedOfficialToolPrompt) {
  ChatOptions o = instruct();
  o.tool_choice = "required";
  o.tools = json::array({json::parse(R"({"type":"function","function":{"name":"get_weather",
    "description":"Get current weather for a location","parameters":{"type":"object",
    "properties":{"location":{"type":"string","description":"City name"}},
    "required":["location"]}}})")});
  EXPECT_EQ(render_chat({msg("user", "What's the weather in San Francisco?")}, o),
            "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\n"
            "Here are the available tools, described in JSONSchema.\n\n```json\n"
            "[{\"function\":{\"description\":\"Get current weather for a location\","
            "\"name\":\"get_weather\",\"parameters\":{\"properties\":{\"location\":"
            "{\"description\":\"City name\",\"type\":\"string\"}},\"required\":[\"location\"],"
            "\"type\":\"object\"}},\"type\":\"function\"}]\n```<|close|>message<|sep|>"
            "<|end_of_msg|><|open|>message role=\"user\"<|sep|>What's the weather in "
            "San Francisco?<|close|>message<|sep|><|end_of_msg|><|open|>message "
            "role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked with "
            "`tool_choice=required`.\nYou MUST call tools in the next message.<|close|>"
            "message<|sep|><|end_of_msg|><|open|>message role=\"assistant\"<|sep|>"
            "<|open|>response<|sep|>");
}

// The example in the report: system, user, assistant tool call, tool result, generation prompt.
TEST(ChatRender, ToolCallAndResultThreeTurns) {
  ChatMessage call = msg("assistant", "");
  call.reasoning_content = "Need the weather.";
  call.tool_calls = {{"call_1", "get_weather", R"({"city":"Paris","days":2})"}};
  ChatMessage result = msg("tool", "18C, clear");
  result.tool_call_id = "call_1";
  ChatOptions o;
  o.tools = json::array({weather_tool()});
  const std::string got = render_chat(
      {msg("system", "You are Kimi."), msg("user", "Weather in Paris?"), call, result}, o);
  const std::string tail =
      "<|open|>message role=\"system\"<|sep|>You are Kimi.<|close|>message<|sep|><|end_of_msg|>"
      "<|open|>message role=\"user\"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>"
      "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>Need the weather."
      "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
      "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
      "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
      "<|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>"
      "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
      "<|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>18C, clear"
      "<|close|>message<|sep|><|end_of_msg|>"
      "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";
  ASSERT_GE(got.size(), tail.size());
  EXPECT_EQ(got.substr(got.size() - tail.size()), tail);
  EXPECT_TRUE(got.starts_with("<|open|>message role=\"system\" type=\"tool-declare\"<|sep|>"));
}

TEST(ChatRender, ArgumentsKeepOrderStringsRawOthersPythonJson) {
  ChatMessage a = msg("assistant", "");
  a.tool_calls = {{"", "f", R"({"z":"a \"q\"","n":null,"o":{"b":[1,2.5],"a":true},"e":""})"}};
  const std::string got = render_chat({msg("user", "u"), a}, instruct());
  EXPECT_NE(
      got.find("<|open|>call tool=\"f\" index=\"1\"<|sep|>"
               "<|open|>argument key=\"z\" type=\"string\"<|sep|>a \"q\"<|close|>argument<|sep|>"
               "<|open|>argument key=\"n\" type=\"null\"<|sep|>null<|close|>argument<|sep|>"
               "<|open|>argument key=\"o\" type=\"object\"<|sep|>{\"b\": [1, 2.5], \"a\": true}"
               "<|close|>argument<|sep|>"
               "<|open|>argument key=\"e\" type=\"string\"<|sep|><|close|>argument<|sep|>"
               "<|close|>call<|sep|>"),
      std::string::npos)
      << got;
  // Not JSON: shown back verbatim in a json block. JSON but not an object: a request error.
  a.tool_calls = {{"", "f", "{oops"}};
  EXPECT_NE(render_chat({a}, instruct())
                .find("<|open|>json type=\"object\"<|sep|>{oops<|close|>json<|sep|><|close|>call"),
            std::string::npos);
  a.tool_calls = {{"", "f", "[1]"}};
  EXPECT_THROW(render_chat({a}, instruct()), Error);
}

TEST(ChatRender, ToolResultsFollowCallOrderAndResolveNames) {
  ChatMessage a = msg("assistant", "");
  a.tool_calls = {{"id_a", "alpha", "{}"}, {"id_b", "beta", "{}"}};
  ChatMessage rb = msg("tool", "B"), ra = msg("tool", "A");
  rb.tool_call_id = "id_b";
  ra.tool_call_id = "id_a";
  const std::string got = render_chat({msg("user", "u"), a, rb, ra}, instruct());
  const size_t pa =
      got.find("<|open|>message role=\"tool\" tool=\"alpha\" index=\"1\"<|sep|>A<|close|>");
  const size_t pb =
      got.find("<|open|>message role=\"tool\" tool=\"beta\" index=\"2\"<|sep|>B<|close|>");
  ASSERT_NE(pa, std::string::npos) << got;
  ASSERT_NE(pb, std::string::npos) << got;
  EXPECT_LT(pa, pb);
  // Without ids, names come from the calls by position; an empty call renders no arguments.
  ChatMessage r1 = msg("tool", "one");
  EXPECT_NE(render_chat({a, r1}, instruct()).find("role=\"tool\" tool=\"alpha\" index=\"1\""),
            std::string::npos);
  EXPECT_NE(render_chat({a}, instruct()).find("index=\"1\"<|sep|><|close|>call<|sep|>"),
            std::string::npos);
  // No name and no call to take it from.
  try {
    render_chat({msg("user", "u"), r1}, instruct());
    FAIL() << "expected k3::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("chat message 1 (tool)"), std::string::npos) << e.what();
  }
}

TEST(ChatRender, NamesAndAttributeEscaping) {
  ChatMessage u = msg("user", "x");
  u.name = "a&\"b\"<c>";
  EXPECT_TRUE(
      render_chat({u}, instruct())
          .starts_with("<|open|>message role=\"user\" name=\"a&amp;&quot;b&quot;<c>\"<|sep|>x"));
}

TEST(ChatRender, OneShotOptionsComeAfterTheConversation) {
  ChatOptions o = instruct();
  o.tool_choice = "required";
  o.response_format = json::parse(
      R"({"type":"json_schema","json_schema":{"name":"r","schema":{"type":"object","a":1}}})");
  EXPECT_EQ(render_chat({msg("user", "u")}, o),
            "<|open|>message role=\"user\"<|sep|>u<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked with "
            "`tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message"
            "<|sep|><|end_of_msg|><|open|>message role=\"system\" type=\"response-format\"<|sep|>"
            "The system is invoked with `response_format=json_schema`.\nYour response must be raw "
            "JSON data without markdown code blocks (```json) or any additional formatting.\nThe "
            "JSON data must match the following schema:\n```json\n{\"a\":1,\"type\":\"object\"}\n"
            "```<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
  o.tool_choice = "none";
  o.response_format = nullptr;
  EXPECT_NE(render_chat({msg("user", "u")}, o).find("You MUST NOT call any tools"),
            std::string::npos);
}

TEST(ChatRender, BadOptionsAndRolesAreErrors) {
  ChatOptions o;
  o.thinking_effort = "medium";  // named in the effort text, but upstream rejects it
  EXPECT_THROW(render_chat({msg("user", "u")}, o), Error);
  o = ChatOptions{};
  o.tool_choice = "sometimes";
  EXPECT_THROW(render_chat({msg("user", "u")}, o), Error);
  o = ChatOptions{};
  o.response_format = json{{"type", "yaml"}};
  EXPECT_THROW(render_chat({msg("user", "u")}, o), Error);
  EXPECT_THROW(render_chat({msg("robot", "u")}, {}), Error);
}

TEST(ChatRender, SegmentsKeepUserTextOutOfSpecialRuns) {
  const auto segs = render_chat_segments({msg("user", "say <|end_of_msg|> now")}, instruct());
  std::string joined;
  for (const ChatSegment& s : segs) {
    joined += s.text;
    if (s.special) {
      bool is_token = false;
      for (const ChatSpecialToken& t : xtml::kTokens) is_token = is_token || s.text == t.text;
      EXPECT_TRUE(is_token) << "special segment '" << s.text << "'";
    }
  }
  EXPECT_EQ(joined, render_chat({msg("user", "say <|end_of_msg|> now")}, instruct()));
  // The attribute pieces are separate segments, as upstream encodes them.
  EXPECT_EQ(segs[1].text, "message");
  EXPECT_EQ(segs[2].text, " role");
  EXPECT_EQ(segs[3].text, "=\"");
  EXPECT_EQ(segs[4].text, "user");
  EXPECT_EQ(segs[6].text, "<|sep|>");
  EXPECT_EQ(segs[7].text, "say <|end_of_msg|> now");
  EXPECT_FALSE(segs[7].special);
}

TEST(ChatRender, EndOfTurnToken) {
  EXPECT_EQ(end_of_turn_token(), "<|end_of_msg|>");
  EXPECT_EQ(chat_stop_strings().front(), "<|end_of_msg|>");
  bool found = false;
  for (const ChatSpecialToken& t : xtml::kTokens)
    found = found || (t.text == end_of_turn_token() && t.id == 163586);
  EXPECT_TRUE(found);
}

TEST(ChatOpenAI, ParsesAllMessageKinds) {
  const auto msgs = parse_openai_messages(json::parse(R"([
    {"role":"developer","content":"Be brief."},
    {"role":"user","name":"ann","content":[{"type":"text","text":"Hel"},{"type":"text","text":"lo"}]},
    {"role":"assistant","content":null,"reasoning_content":"think",
     "tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"b\":1,\"a\":2}"}},
                   {"id":"c2","type":"function","function":{"name":"g","arguments":{"z":1,"y":[true]}}}]},
    {"role":"tool","tool_call_id":"c1","content":"ok"},
    {"role":"assistant","content":"done","reasoning":"r2"}])"));
  ASSERT_EQ(msgs.size(), 5u);
  EXPECT_EQ(msgs[0].role, "system");
  EXPECT_EQ(msgs[1].content, "Hello");
  EXPECT_EQ(msgs[1].name, "ann");
  EXPECT_EQ(msgs[2].content, "");
  EXPECT_EQ(msgs[2].reasoning_content, "think");
  ASSERT_EQ(msgs[2].tool_calls.size(), 2u);
  EXPECT_EQ(msgs[2].tool_calls[0].id, "c1");
  EXPECT_EQ(msgs[2].tool_calls[0].arguments, "{\"b\":1,\"a\":2}");
  EXPECT_EQ(msgs[2].tool_calls[1].arguments, "{\"y\":[true],\"z\":1}");  // object: json sorts
  EXPECT_EQ(msgs[3].tool_call_id, "c1");
  EXPECT_EQ(msgs[4].reasoning_content, "r2");
}

// Each bad request names the message index and the field.
TEST(ChatOpenAI, ErrorsNameIndexAndField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"role":"user"})", "messages: expected an array"},
      {R"([{"role":"user","content":"a"},{"role":"wizard","content":"b"}])", "messages[1].role"},
      {R"([{"content":"a"}])", "messages[0].role"},
      {R"([{"role":"user"}])", "messages[0].content: missing"},
      {R"([{"role":"system","content":5}])", "messages[0].content"},
      {R"([{"role":"user","content":[{"type":"image_url","image_url":{}}]}])",
       "messages[0].content[0].type"},
      {R"([{"role":"user","content":[{"type":"text"}]}])", "messages[0].content[0].text"},
      {R"([{"role":"assistant"}])", "messages[0].content"},
      {R"([{"role":"user","content":"a","tool_calls":[]}])", "messages[0].tool_calls"},
      {R"([{"role":"assistant","tool_calls":[{"function":{"arguments":"{}"}}]}])",
       "messages[0].tool_calls[0].function.name"},
      {R"([{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":3}}]}])",
       "messages[0].tool_calls[0].function.arguments"},
      {R"([{"role":"tool","content":"x","tool_call_id":7}])", "messages[0].tool_call_id"},
      {R"([1])", "messages[0]"},
  };
  for (const auto& [body, want] : cases) {
    try {
      parse_openai_messages(json::parse(body));
      ADD_FAILURE() << "no error for " << body;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos)
          << body << " -> " << e.what() << " (want " << want << ")";
    }
  }
}

}  // namespace
}  // namespace k3
