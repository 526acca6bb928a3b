#!/usr/bin/env bash
# A short load run of `k3 serve` with a real benchmark client: GuideLLM (PyPI guidellm 0.8.1)
# at several concurrencies against /v1/completions, synthetic prompts, streaming, reporting
# TTFT / ITL / TPOT and throughput; then the server's own /metrics (TTFT, TPOT histograms).
#
#   python3 -m venv /tmp/gllm && /tmp/gllm/bin/pip install guidellm==0.8.1
#   GUIDELLM=/tmp/gllm/bin/guidellm tools/load_test.sh [--model DIR] [k3 serve flags...]
#
# Env: GUIDELLM (default: guidellm on the PATH), K3 (default build/k3), STREAMS (1,4,16),
# REQUESTS per concurrency (32), PROMPT_TOKENS (64), OUTPUT_TOKENS (64), OUT (a temp dir).
#
# Runs offline: GuideLLM needs a Hugging Face tokenizer to size synthetic prompts, so a
# byte-level one is built locally (no download). Prompt sizes are therefore in bytes; the
# reported token counts come from the server's usage, in the model's own tokens.
set -euo pipefail
cd "$(dirname "$0")/.."

GUIDELLM=${GUIDELLM:-guidellm}
K3=${K3:-build/k3}
STREAMS=${STREAMS:-1,4,16}
REQUESTS=${REQUESTS:-32}
PROMPT_TOKENS=${PROMPT_TOKENS:-64}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
OUT=${OUT:-$(mktemp -d)}
command -v "$GUIDELLM" >/dev/null || {
  echo "guidellm not found: pip install guidellm==0.8.1 (or set GUIDELLM)" >&2
  exit 1
}
guidellm_python=$(head -1 "$(command -v "$GUIDELLM")" | sed 's/^#!//')

# The byte-level tokenizer GuideLLM sizes prompts with.
"$guidellm_python" - "$OUT/bytetok" <<'EOF'
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(sys.argv[1])
EOF

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$K3" serve --port "$port" --served-model-name k3-load --max-num-seqs 16 "$@" >"$OUT/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 0.1
done
grep "k3 serve:" "$OUT/server.log"
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"

HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$GUIDELLM" run \
  --backend "kind=openai_http,target=http://127.0.0.1:$port,model=k3-load,request_format=/v1/completions" \
  --tokenizer "kind=huggingface_auto,model=$OUT/bytetok" \
  --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
  --profile kind=concurrent,streams=1 --override profile.streams "$STREAMS" \
  --constraint "kind=max_requests,count=$REQUESTS" \
  --output "kind=json,path=$OUT/guidellm.json" \
  --disable-console-interactive

echo "--- server-side /metrics (all runs together)"
curl -s "http://127.0.0.1:$port/metrics" | python3 -c '
import sys
m = {}
for line in sys.stdin:
    if line.strip() and not line.startswith("#"):
        k, v = line.rsplit(" ", 1)
        m[k] = float(v)
for name in ("k3_time_to_first_token_seconds", "k3_time_per_output_token_seconds"):
    n, total = m[name + "_count"], m[name + "_sum"]
    print("%s: %d requests, mean %.1f ms" % (name, n, 1e3 * total / max(n, 1)))
print("k3_generation_tokens_total", int(m["k3_generation_tokens_total"]),
      "k3_prompt_tokens_total", int(m["k3_prompt_tokens_total"]))
'
echo "results: $OUT/guidellm.json"
