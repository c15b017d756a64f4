#!/usr/bin/env bash
# Device checks on a CUDA machine (CI has no GPU, so these run by hand):
# the profiled KV budget, HF parity with the engine on CUDA, GPU benchmarks.
# Usage: OUT=/tmp/gpu bash scripts/gpu_check.sh   (from the repository root)
set -uo pipefail
OUT=${OUT:-/tmp/tessera-gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
for preset in tiny bench; do
  $PY -m tessera_tools.cli make-model --preset $preset models/$preset || exit 1
done

echo "== profiled KV budget and a generation on CUDA"
$PY - <<'PYEOF'
from engine_pod import LLM, SamplingParams
llm = LLM("models/tiny", device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
print("profiled KV blocks:", llm.engine_core.num_blocks, "of", llm.config.cache.block_size, "tokens")
out = llm.generate(["Hello world", "Paged attention"], SamplingParams(temperature=0, max_tokens=8))
print([o.outputs[0].token_ids for o in out])
PYEOF

echo "== HF parity with the engine on CUDA (float64)"
TESSERA_TEST_DEVICE=cuda $PY -m pytest tests/engine_pod/test_hf_parity.py -q -x -p no:cacheprovider 2>&1 | tail -4

echo "== benchmarks on CUDA (bfloat16)"
$PY -m tessera_tools.cli bench throughput --model models/bench --dtype bfloat16 --device cuda --output "$OUT/throughput_gpu.json" 2>&1 | grep -v -i "warn\|indices\|Loading weights"
$PY -m tessera_tools.cli bench prefix-cache --model models/bench --dtype bfloat16 --device cuda --output "$OUT/prefix_cache_gpu.json" 2>&1 | grep -v -i "warn\|indices\|Loading weights"

echo "== triton attention kernels on CUDA: the CPU suite's cases compiled for the GPU, then the benchmark"
$PY -m pytest tests/engine_pod/attention/test_triton_attention.py tests/engine_pod/test_triton_backend.py -q -x -p no:cacheprovider 2>&1 | tail -4
$PY -m tessera_tools.cli bench kernels --output "$OUT/kernels_gpu.json" 2>"$OUT/kernels_gpu.log"

echo "== P/D on the GPU: TTFT of the direct channel vs Redis at 2,016-token prompts, real engines (issue 22)"
# Two pods per set-up share the one GPU (bfloat16, 512 MiB of KV each); every set-up has a private
# redis-server, so the machine needs one on its PATH.
if command -v redis-server >/dev/null; then
  $PY -m tessera_tools.cli bench pd --model models/bench --dtype bfloat16 --tp 1 --rounds 3 \
    --modes mixed,redis,direct --logs "$OUT/pd-logs" --out "$OUT/pd_gpu.json" 2>&1 | tail -20
else
  echo "skipped: no redis-server on this machine"
fi
