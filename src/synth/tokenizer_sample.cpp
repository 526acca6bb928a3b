// The text the synthetic tokenizer learns its merges on: English prose, C++ and Python, JSON,
// numbers, Chinese, Japanese, Korean and a few emoji, so the tiny model's tokenizer has real
// multi-byte merges (and multi-token characters) in every script the tests exercise. Written
// for this repository. Changing it changes the built-in tiny model (bump kBuiltinTinyVersion).
#include "synth/tokenizer_synth.h"

namespace k3 {

std::string_view synth_tokenizer_sample() {
  static constexpr char kSample[] = R"sample(
The model reads a prompt one token at a time and writes the next token at the end of the
context. Each step of the decoder moves every weight of the active experts through the memory
system once, so the time of a step is set by the bytes it reads, not by the arithmetic it does.
A good engine therefore keeps the weights in their compressed form, reads each byte exactly
once, and overlaps the reading with the small amount of math that remains. The attention
layers keep a cache of what they have seen; the linear attention layers keep a fixed-size
state instead, which is why a long context costs the same memory as a short one for them.

When the user sends a message, the server turns the text into tokens, runs the prompt through
the model, and then streams the answer back while it is being generated. The tokenizer must be
exact: the same text has to give the same tokens as the reference implementation, or the model
sees input it was never trained on. It's the kind of detail that's easy to get wrong, and we'll
test it against the reference on every kind of text we can think of: English, code, numbers,
Chinese, Japanese, Korean, emoji, and the whitespace between them. They're all here; I'm sure
you'd agree that we've covered the usual cases. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.
the quick brown fox jumps over the lazy dog. The Quick Brown Fox Jumps Over The Lazy Dog.

Questions worth asking of any system: what does it do when the input is empty? What happens at
the boundary? Which errors are reported, and do the messages name the file and the line? Is the
output the same for every thread count? Can a test be replayed from its seed?

  for (int layer = 0; layer < num_layers; ++layer) {
    const float* weights = model.layer(layer).weights();
    std::vector<float> hidden(config.hidden_size, 0.0f);
    if (layer % 4 == 3) {
      attention(hidden.data(), cache, position);
    } else {
      linear_attention(hidden.data(), state, position);
    }
    residual[layer] = hidden;
  }

  template <typename T>
  T clamp(T value, T low, T high) {
    return value < low ? low : (value > high ? high : value);
  }

  struct Request {
    std::string prompt;
    int max_tokens = 32;
    float temperature = 0.0f;
  };

def encode(text: str, allow_special: bool = False) -> list[int]:
    """Returns the token ids of text."""
    ids = []
    for piece in split(text):
        if piece in vocabulary:
            ids.append(vocabulary[piece])
        else:
            ids.extend(merge(piece))
    return ids

class Sampler:
    def __init__(self, temperature=1.0, top_k=0, top_p=1.0, seed=None):
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.random = random.Random(seed)

{"model": "kimi-k3", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 128,
 "temperature": 0.7, "stream": true, "stop": ["\n\n"], "seed": 2026}
{"id": "chatcmpl-123", "object": "chat.completion", "created": 1767225600, "choices": []}

Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 100 128 256 512 1000 1024 2048 4096 8192 65536
3.14159 2.71828 1.41421 0.5 0.25 0.125 1e-5 1e-6 6.02e23 -1 -42 +7 50% 99.9% $19.99 #1 @home
2024-01-01 2025-12-31 12:30:45 10:00 v1.2.3 192.168.0.1 http://example.com/path?q=1&r=2

语言模型每次读取一个词元，并在上下文的末尾写出下一个词元。解码器的每一步都要把活跃专家的
全部权重从显存中读出一次，所以一步的时间取决于读取的字节数，而不是计算量。一个好的推理引擎
会保持权重的压缩形式，每个字节只读一次，并把读取与剩下的少量计算重叠起来。注意力层保存它们
看到过的内容的缓存；线性注意力层则保存一个固定大小的状态。我们的测试覆盖中文、英文、代码、
数字和表情符号。你好，世界！今天天气很好。这是一个简单的例子，用来检查分词器是否正确。

言語モデルはプロンプトを一度に一つのトークンずつ読み、次のトークンを書き出します。
こんにちは、世界！トークナイザーのテストです。ひらがな、カタカナ、漢字が混ざっています。

언어 모델은 한 번에 하나의 토큰을 읽고 다음 토큰을 씁니다. 안녕하세요, 세계! 토크나이저 테스트입니다.

Café, naïve, façade, jalapeño, Zürich, São Paulo, Ελληνικά, Русский язык, العربية, हिन्दी.
Emoji: 😀 😃 🚀 🌍 ✨ 👍 🎉 ❤️ — and punctuation: “quotes”, ‘single’, «guillemets», …, –, —.
)sample";
  return kSample;
}

}  // namespace k3
