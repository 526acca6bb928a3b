// The OpenAI request parser / validator, response shapes, stop-string matching and the
// Prometheus text of `k3 serve`.
#include <gtest/gtest.h>

#include <regex>
#include <sstream>

#include "serve/metrics.h"
#include "serve/openai_api.h"
#include "serve/openai_response.h"
#include "serve/stop_matcher.h"

namespace {

using json = nlohmann::json;
using namespace k3::serve;

// The ApiError a body raises (status 0 when it parses).
ApiError completion_error(const json& body) {
  try {
    parse_completion_request(body);
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "parsed");
}

ApiError chat_error(const json& body) {
  try {
    parse_chat_request(body);
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "parsed");
}

const json kUser = json::array({{{"role", "user"}, {"content", "hi"}}});

TEST(ServeApi, CompletionDefaultsAndFields) {
  const CompletionRequest d = parse_completion_request({{"prompt", "hello"}});
  EXPECT_EQ(d.prompt_text, "hello");
  EXPECT_EQ(d.gen.max_tokens, 16);  // OpenAI's completions default
  EXPECT_EQ(d.gen.temperature, 1.0f);
  EXPECT_FALSE(d.gen.seed.has_value());
  EXPECT_FALSE(d.gen.stream);

  const CompletionRequest r =
      parse_completion_request({{"model", "m"},
                                {"prompt", {1, 2, 3}},
                                {"max_tokens", 7},
                                {"temperature", 0.5},
                                {"top_p", 0.9},
                                {"top_k", -1},
                                {"seed", -3},
                                {"stop", {"a", "", "b"}},
                                {"ignore_eos", true},
                                {"stream", true},
                                {"stream_options", {{"include_usage", true}}},
                                {"n", 1},
                                {"logprobs", nullptr},
                                {"some_future_field", {{"x", 1}}},
                                {"stop_token_ids", {5}},
                                {"user", "u"}});
  EXPECT_EQ(r.gen.model, "m");
  EXPECT_FALSE(r.prompt_text.has_value());
  EXPECT_EQ(r.prompt_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(r.gen.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.gen.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.gen.top_p, 0.9f);
  EXPECT_EQ(r.gen.top_k, 0);  // -1 is vLLM's "off"
  EXPECT_EQ(r.gen.seed, static_cast<uint64_t>(-3));
  EXPECT_EQ(r.gen.stop, (std::vector<std::string>{"a", "b"}));  // empty strings match nothing
  EXPECT_EQ(r.gen.stop_token_ids, (std::vector<int64_t>{5}));
  EXPECT_TRUE(r.gen.ignore_eos && r.gen.stream && r.gen.include_usage);

  // Other prompt spellings: one string or one id list inside a list; integral floats.
  EXPECT_EQ(parse_completion_request({{"prompt", {"x"}}}).prompt_text, "x");
  EXPECT_EQ(parse_completion_request({{"prompt", {{4, 5}}}}).prompt_ids,
            (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(parse_completion_request({{"prompt", "x"}, {"max_tokens", 16.0}}).gen.max_tokens, 16);
  EXPECT_EQ(parse_completion_request({{"prompt", "x"}, {"stop", "s"}}).gen.stop,
            (std::vector<std::string>{"s"}));
}

TEST(ServeApi, CompletionErrorsName400AndTheField) {
  struct Case {
    json body;
    std::string param, message_part;
  };
  const std::vector<Case> cases = {
      {json::object(), "prompt", "prompt is required"},
      {{{"prompt", 5}}, "prompt", "must be a string or an array"},
      {{{"prompt", json::array()}}, "prompt", "must not be empty"},
      {{{"prompt", {"a", "b"}}}, "prompt", "batched prompts (2)"},
      {{{"prompt", {1, -2}}}, "prompt", ">= 0"},
      {{{"prompt", {1, "x"}}}, "prompt", "must be an integer"},
      {{{"prompt", "x"}, {"temperature", "hot"}}, "temperature", "must be a number, got string"},
      {{{"prompt", "x"}, {"temperature", true}}, "temperature", "must be a number, got boolean"},
      {{{"prompt", "x"}, {"temperature", -0.1}}, "temperature", ">= 0"},
      {{{"prompt", "x"}, {"top_p", 0}}, "top_p", "(0, 1]"},
      {{{"prompt", "x"}, {"top_p", 1.5}}, "top_p", "(0, 1]"},
      {{{"prompt", "x"}, {"top_k", -2}}, "top_k", "top_k"},
      {{{"prompt", "x"}, {"max_tokens", 0}}, "max_tokens", ">= 1"},
      {{{"prompt", "x"}, {"max_tokens", 2.5}}, "max_tokens", "fractional"},
      {{{"prompt", "x"}, {"max_tokens", "8"}}, "max_tokens", "must be an integer, got string"},
      {{{"prompt", "x"}, {"n", 2}}, "n", "n > 1 is not supported"},
      {{{"prompt", "x"}, {"n", 0}}, "n", ">= 1"},
      {{{"prompt", "x"}, {"best_of", 3}}, "best_of", "not supported"},
      {{{"prompt", "x"}, {"echo", true}}, "echo", "not supported"},
      {{{"prompt", "x"}, {"logprobs", 2}}, "logprobs", "not supported"},
      {{{"prompt", "x"}, {"stop", 3}}, "stop", "string or an array"},
      {{{"prompt", "x"}, {"stop", {"a", 1}}}, "stop", "string or an array"},
      {{{"prompt", "x"}, {"stream", "yes"}}, "stream", "must be a boolean"},
      {{{"prompt", "x"}, {"stream_options", 1}}, "stream_options", "object"},
      {{{"prompt", "x"}, {"seed", 1.5}}, "seed", "integer"},
      {{{"prompt", "x"}, {"model", 3}}, "model", "must be a string"},
  };
  for (const Case& c : cases) {
    const ApiError e = completion_error(c.body);
    SCOPED_TRACE(c.body.dump());
    EXPECT_EQ(e.status, 400) << e.what();
    EXPECT_EQ(e.type, "invalid_request_error");
    EXPECT_EQ(e.param, c.param);
    EXPECT_NE(std::string(e.what()).find(c.message_part), std::string::npos) << e.what();
  }
  EXPECT_EQ(completion_error(json::array()).status, 400);  // not an object
}

TEST(ServeApi, ChatRequests) {
  const ChatRequest r = parse_chat_request({{"messages", kUser},
                                            {"max_tokens", 9},
                                            {"max_completion_tokens", 4},
                                            {"chat_template_kwargs", {{"thinking", false}}},
                                            {"tools", json::array()},
                                            {"tool_choice", "auto"}});
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "hi");
  EXPECT_EQ(r.gen.max_tokens, 4);  // max_completion_tokens supersedes max_tokens
  EXPECT_FALSE(r.chat.thinking);
  EXPECT_FALSE(parse_chat_request({{"messages", kUser}}).gen.max_tokens.has_value());

  EXPECT_EQ(chat_error(json::object()).param, "messages");
  EXPECT_EQ(chat_error({{"messages", "hi"}}).param, "messages");
  EXPECT_EQ(chat_error({{"messages", json::array()}}).param, "messages");
  const ApiError bad_role = chat_error({{"messages", {{{"role", "robot"}, {"content", "x"}}}}});
  EXPECT_EQ(bad_role.status, 400);
  EXPECT_EQ(bad_role.param, "messages");
  EXPECT_EQ(chat_error({{"messages", {1}}}).status, 400);
  EXPECT_EQ(chat_error({{"messages", kUser}, {"n", 3}}).param, "n");
  EXPECT_EQ(chat_error({{"messages", kUser}, {"tools", "x"}}).param, "tools");
  EXPECT_EQ(chat_error({{"messages", kUser}, {"chat_template_kwargs", {{"thinking", 1}}}}).param,
            "thinking");
  EXPECT_EQ(chat_error({{"messages", kUser}, {"max_completion_tokens", -1}}).param,
            "max_completion_tokens");
}

TEST(ServeApi, JsonBodiesAndErrorShape) {
  EXPECT_EQ(parse_json_body(R"({"a":1})")["a"], 1);
  for (const char* bad : {"", "{", "[1]", "\"s\"", "{\"a\":}", "nul"}) {
    try {
      parse_json_body(bad);
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
    }
  }
  const std::string deep = "{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  try {
    parse_json_body(deep);
    ADD_FAILURE() << "accepted 100000 levels";
  } catch (const ApiError& e) {
    EXPECT_NE(std::string(e.what()).find("nests deeper"), std::string::npos) << e.what();
  }
  const std::string ok = "{\"a\":" + std::string(60, '[') + std::string(60, ']') + "}";
  EXPECT_NO_THROW(parse_json_body(ok));
  EXPECT_EQ(completion_error({{"prompt", "x"}, {"stop", std::vector<std::string>(17, "s")}}).param,
            "stop");
  EXPECT_EQ(completion_error({{"prompt", "x"}, {"stop", std::string(513, 's')}}).param, "stop");

  const json j = error_json(ApiError(400, "bad top_p", "top_p"));
  ASSERT_TRUE(j.contains("error"));
  EXPECT_EQ(j["error"]["message"], "bad top_p");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "top_p");
  EXPECT_EQ(j["error"]["code"], 400);
  EXPECT_EQ(error_json(ApiError(503, "busy"))["error"]["type"], "server_error");
  EXPECT_TRUE(error_json(ApiError(404, "x"))["error"]["param"].is_null());
}

TEST(ServeApi, ContextBudget) {
  EXPECT_EQ(completion_budget(10, std::nullopt, 100), 90);
  EXPECT_EQ(completion_budget(10, 90, 100), 90);
  try {
    completion_budget(10, 91, 100);
    ADD_FAILURE();
  } catch (const ApiError& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(m.find("maximum context length is 100"), std::string::npos) << m;
    EXPECT_NE(m.find("10 in the prompt, 91 in the completion"), std::string::npos) << m;
  }
  EXPECT_THROW(completion_budget(100, std::nullopt, 100), ApiError);
}

TEST(ServeApi, ResponseShapes) {
  const ResponseIds ids = new_response_ids("chatcmpl", "m");
  EXPECT_EQ(ids.id.rfind("chatcmpl-", 0), 0u);
  k3::AssistantOutput out;
  out.content = "x";
  out.tool_calls.push_back({"functions.f:1", "f", "{}"});
  const json r = chat_response(ids, out, "stop", {3, 4});
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(r["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(r["usage"]["total_tokens"], 7);
  const json c = chat_chunk(ids, {{"content", "a"}}, "", true);
  EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(c.contains("usage") && c["usage"].is_null());
  EXPECT_TRUE(usage_chunk(ids, "chat.completion.chunk", {1, 2})["choices"].empty());
  k3::AssistantDelta d;
  d.reasoning_content = "r";
  d.tool_calls = {{"functions.a:1", "a", "{}"}, {"functions.b:2", "b", "{\"x\":1}"}};
  int next_index = 0;
  const json delta = chat_delta(d, &next_index);
  EXPECT_EQ(delta["reasoning_content"], "r");
  EXPECT_FALSE(delta.contains("content"));
  EXPECT_EQ(delta["tool_calls"][1]["index"], 1);
  EXPECT_EQ(delta["tool_calls"][1]["function"]["arguments"], "{\"x\":1}");
  EXPECT_EQ(next_index, 2);
  const json t = completion_response(ids, "hi", "length", {1, 1});
  EXPECT_EQ(t["choices"][0]["text"], "hi");
  EXPECT_EQ(sse_event({{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_NO_THROW(dump({{"bad", std::string("\xff")}}));  // invalid UTF-8 never throws
}

TEST(ServeStop, HoldsBackPrefixesAndCutsAtTheStop) {
  StopMatcher m({"STOP", "xy"});
  EXPECT_EQ(m.feed("abc S"), "abc ");  // "S" may start STOP
  EXPECT_EQ(m.feed("T"), "");
  EXPECT_EQ(m.feed("O"), "");
  EXPECT_EQ(m.feed("P tail"), "");
  EXPECT_TRUE(m.matched());
  EXPECT_EQ(m.feed("more"), "");

  StopMatcher n({"STOP"});
  EXPECT_EQ(n.feed("aST"), "a");
  EXPECT_EQ(n.feed("x"), "STx");  // not a stop after all
  EXPECT_EQ(n.feed("ST"), "");
  EXPECT_EQ(n.flush(), "ST");
  EXPECT_FALSE(n.matched());

  StopMatcher two({"STOP", "xy"});
  EXPECT_EQ(two.feed("STOx"), "STO");  // "x" may start "xy"
  EXPECT_EQ(two.feed("y!"), "");
  EXPECT_TRUE(two.matched());

  StopMatcher rep({"aab"});
  EXPECT_EQ(rep.feed("aaaa"), "aa");  // "aa" may start "aab"
  EXPECT_EQ(rep.feed("b"), "");
  EXPECT_TRUE(rep.matched());

  StopMatcher none;
  EXPECT_EQ(none.feed("abc"), "abc");
  StopMatcher earliest({"bc", "ab"});
  EXPECT_EQ(earliest.feed("xabc"), "x");
}

TEST(ServeMetrics, PrometheusText) {
  Metrics m;
  m.add_prompt_tokens(12);
  m.add_generation_tokens(5);
  m.observe_ttft(0.003);
  m.observe_ttft(100.0);
  m.observe_tpot(0.01);
  m.set_queue(2, 3);
  m.add_finished("stop");
  m.add_finished("abort");
  const std::string text = m.render();
  EXPECT_NE(text.find("# TYPE k3_time_to_first_token_seconds histogram"), std::string::npos);
  EXPECT_NE(text.find("k3_time_to_first_token_seconds_bucket{le=\"0.001\"} 0\n"),
            std::string::npos);
  EXPECT_NE(text.find("k3_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("k3_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("k3_time_to_first_token_seconds_count 2\n"), std::string::npos);
  EXPECT_NE(text.find("k3_time_to_first_token_seconds_sum 100.003\n"), std::string::npos);
  EXPECT_NE(text.find("k3_time_per_output_token_seconds_bucket{le=\"0.01\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("k3_prompt_tokens_total 12\n"), std::string::npos);
  EXPECT_NE(text.find("k3_generation_tokens_total 5\n"), std::string::npos);
  EXPECT_NE(text.find("k3_requests_running 2\n"), std::string::npos);
  EXPECT_NE(text.find("k3_requests_waiting 3\n"), std::string::npos);
  EXPECT_NE(text.find("k3_request_success_total{finished_reason=\"stop\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("k3_request_success_total{finished_reason=\"length\"} 0\n"),
            std::string::npos);
  // Every line is a comment or `name{labels} value`, and buckets never decrease.
  const std::regex sample(R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"\})? [-+0-9.eInf]+$)");
  std::istringstream in(text);
  std::string line;
  uint64_t last_bucket = 0;
  std::string last_name;
  while (std::getline(in, line)) {
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) continue;
    EXPECT_TRUE(std::regex_match(line, sample)) << line;
    if (line.find("_bucket{") != std::string::npos) {
      const uint64_t v = std::stoull(line.substr(line.rfind(' ') + 1));
      const std::string name = line.substr(0, line.find('{'));
      if (name != last_name) last_bucket = 0;
      last_name = name;
      EXPECT_GE(v, last_bucket) << line;
      last_bucket = v;
    }
  }
}

}  // namespace
