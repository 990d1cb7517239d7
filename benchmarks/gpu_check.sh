#!/usr/bin/env bash
# One prepared check for a machine with one NVIDIA GPU and no package registry; under 8 minutes on an H100/H200.
#
#   1. pretrain a ~134M-parameter Llama (12 layers × 768, vocab 32k, 1024-token blocks) in bf16 autocast with
#      torch.compile for --steps steps of 64 blocks: steady-state tokens/s and MFU (llmpipe's own logging), beside the
#      datasheet and the measured bf16 matmul peak;
#   2. a few steps with distributed.strategy fsdp (FSDP2, one process), then the same run with a larger step
#      budget, which must resume from the checkpoint; the final model must load as a standard HF directory;
#   3. the same with strategy deepspeed (ZeRO-3);
#   4. sft with peft.method lora under FSDP on every local GPU (num_processes auto): the saved adapter must hold
#      every LoRA tensor whole (not only rank 0's shard, a known Accelerate failure), and the merged model's
#      logits must equal base + adapter's (within 1e-4 in fp32). With one GPU the world is one rank: the shapes and
#      the merge are checked, the multi-rank case needs two GPUs.
#
# Usage (from anywhere; the runs work in a fresh folder, --work):
#   [PYTHON=python3] benchmarks/gpu_check.sh [--wheels DIR] [--out DIR] [--work DIR] [--steps N] [--batch N]
#                                            [--parts LIST] [--tiny]
#     --wheels DIR  first install every wheel in DIR with pip --no-index --no-deps into a private folder (the
#                   machine's own torch, transformers' deps etc. stay; bring pydantic, pydantic_core,
#                   annotated_types, typing_inspection, typing_extensions, hjson, deepspeed, transformers)
#     --out DIR     where the logs (one per part) and summary.txt go (default: ./gpu_check_out)
#     --work DIR    data, models and checkpoints of the runs (default: a new temp folder); an existing folder
#                   is emptied only if a previous gpu_check made it
#     --steps N     pretrain steps in part 1 (default 200; 64 × 1024 tokens each)
#     --batch N     blocks of 1024 tokens per step in every part (default 64)
#     --parts LIST  comma-separated subset of pretrain,fsdp,deepspeed,fsdp_lora to run (default: all four)
#     --tiny        a 2-layer model and a few steps: checks this script on a machine without a GPU (parts 2
#                   and 3 must then stop with llmpipe's "needs CUDA GPUs" error, which counts as a pass)
# Exit status: 0 when every part passed. Each part has its own time limit, so one hang cannot eat the rest.
set -uo pipefail

usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS="" OUT_DIR="$PWD/gpu_check_out" WORK="" STEPS=200 TINY=0 PARTS=pretrain,fsdp,deepspeed,fsdp_lora BATCH=64
while (($#)); do
  case "$1" in
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
    --out) OUT_DIR=${2:?--out needs a folder}; shift 2 ;;
    --work) WORK=${2:?--work needs a folder}; shift 2 ;;
    --steps) STEPS=${2:?--steps needs a number}; shift 2 ;;
    --batch) BATCH=${2:?--batch needs a number}; shift 2 ;;
    --parts) PARTS=${2:?--parts needs a list}; shift 2 ;;
    --tiny) TINY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for p in ${PARTS//,/ }; do
  [[ $p == pretrain || $p == fsdp || $p == deepspeed || $p == fsdp_lora ]] || { echo "gpu_check.sh: --parts: unknown part '$p'" >&2; exit 2; }
done
wants() { [[ ,$PARTS, == *",$1,"* ]]; }
[[ $BATCH =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: --batch must be a positive integer, got '$BATCH'" >&2; exit 2; }
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: --steps must be a positive integer, got '$STEPS'" >&2; exit 2; }
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
if [[ -z $WORK ]]; then
  WORK=$(mktemp -d -t llmpipe-gpu-check.XXXXXX)
elif [[ -d $WORK && -n $(ls -A "$WORK") && ! -e $WORK/.gpu_check ]]; then
  echo "gpu_check.sh: --work $WORK is not empty and was not made by gpu_check; give a new or empty folder" >&2; exit 2
else
  rm -rf "$WORK" && mkdir -p "$WORK"
fi
touch "$WORK/.gpu_check"
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

if [[ -n $WHEELS ]]; then
  SITE="$WORK/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "gpu_check.sh: installing the wheels in $WHEELS failed" >&2; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$WORK" || exit 1

if ((TINY)); then
  MODEL='{hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 4, intermediate_size: 128, max_position_embeddings: 128}'
  VOCAB=1024 BLOCK=128 BATCH=4 SHORT=4 LIMIT_S=240  # --batch does not apply
else
  MODEL='{hidden_size: 768, num_hidden_layers: 12, num_attention_heads: 12, num_key_value_heads: 12, intermediate_size: 2048, max_position_embeddings: 1024}'
  VOCAB=32000 BLOCK=1024 SHORT=20 LIMIT_S=300
fi

# params.yaml of part 1; parts 2-3 add their own files beside it (every stage reads --config-path).
cat >params.yaml <<EOF
tokenizer: {vocab_size: $VOCAB}
model: $MODEL
train: {precision: $( ((TINY)) && echo fp32 || echo bf16)}
pretrain: {max_steps: $STEPS, eval_steps: $((STEPS + 1)), save_steps: $((STEPS + 1)), max_length: $BLOCK,
           per_device_train_batch_size: $BATCH, per_device_eval_batch_size: $BATCH, max_eval_samples: $((BATCH * 2)),
           lr: 0.0006, warmup_steps: $((STEPS < 10 ? STEPS : 10)), logging_steps: 10, dataloader_num_workers: 2,
           optim: $( ((TINY)) && echo adamw_torch || echo adamw_torch_fused)}
distributed: {torch_compile: true}
EOF

status=0
part() {  # part NAME LIMIT_S COMMAND…: run with a time limit, log to OUT_DIR/NAME.log, record pass/fail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  say "$(printf '%-28s rc=%-3s %4ds' "$name" "$rc" $((SECONDS - t0)))"
  ((rc == 0)) || tail -n 25 "$OUT_DIR/$name.log"
  return $rc
}

say "== gpu_check $(date -u +%FT%TZ) on $(hostname); llmpipe $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch, transformers, accelerate
print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)")
    try:
        from llmpipe.throughput import device_peak_tflops, measure_matmul_tflops
        dev = torch.device("cuda")
        peak, source = device_peak_tflops(dev)
        print(f"bf16 peak: datasheet {peak} TFLOP/s ({source}); measured matmul {measure_matmul_tflops(dev):.0f} TFLOP/s")
    except Exception as err:  # the figures are context, not the check
        print(f"peak figures unavailable: {err!r}")
else:
    print("device: no CUDA GPU")
EOF

# 1. data, tokenizer, then the compiled bf16 pretrain run.
part prepare 120 "$PY" -m llmpipe.cli --task prepare || status=1
part tokenizer 120 "$PY" -m llmpipe.cli --task tokenizer || status=1
if ! wants pretrain; then
  :
elif part pretrain_compiled "$LIMIT_S" "$PY" -m llmpipe.cli --task pretrain; then
  "$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import csv, json, statistics
rows = [r for r in csv.DictReader(open("logs/pretrain/train.csv")) if r.get("tokens_per_s")]
steady = rows[2:] or rows[-1:]  # the first logged windows hold compilation and warm-up
m = json.load(open("metrics/pretrain.json"))
tps = statistics.median(float(r["tokens_per_s"]) for r in steady)
mfu = [float(r["mfu"]) for r in steady if r.get("mfu")]
print(f"pretrain: {m['num_parameters'] / 1e6:.1f} M parameters, {m['steps']} steps, {m['wall_time_s']:.0f} s wall")
what = f"median of {len(steady)} log windows after the first 2" if rows[2:] else "last log window, warm-up included"
print(f"pretrain steady state ({what}): {tps:,.0f} tokens/s"
      + (f", MFU {statistics.median(mfu):.1%}" if mfu else ", MFU not logged (no known peak for this device)")
      + f"; peak memory {m.get('peak_memory_gb', float('nan')):.1f} GB; final loss {float(rows[-1]['loss']):.3f}")
EOF
else
  status=1
fi

# 2-3. FSDP2 and DeepSpeed ZeRO-3, one process each: a short run, then a longer budget that must resume it.
check_sharded() {  # check_sharded STRATEGY EXTRA_YAML
  local s=$1 extra=$2
  local over="{paths: {output_root: runs/$s}, distributed: {strategy: $s, torch_compile: false$extra}}"
  for steps in "$SHORT" $((SHORT + 10)); do
    "$PY" - "$s" "$steps" "$over" <<'EOF'
import sys, yaml
s, steps, over = sys.argv[1], int(sys.argv[2]), yaml.safe_load(sys.argv[3])
raw = yaml.safe_load(open("params.yaml"))
raw.update(over)
raw["pretrain"] = {**raw["pretrain"], "max_steps": steps, "save_steps": 10, "eval_steps": 10, "logging_steps": 5,
                   "warmup_steps": min(raw["pretrain"]["warmup_steps"], steps)}  # params refuse warmup > max_steps
yaml.safe_dump(raw, open(f"params-{s}.yaml", "w"))
EOF
    if ! part "${s}_${steps}steps" 150 "$PY" -m llmpipe.cli --task pretrain --config-path "params-$s.yaml"; then
      if ((TINY)) && grep -q "distributed.strategy: $s needs CUDA GPUs" "$OUT_DIR/${s}_${steps}steps.log"; then
        say "$s: refused on this machine without a GPU, as it must be (--tiny)"
        return 0
      fi
      return 1
    fi
  done
  "$PY" - "$s" "$SHORT" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
from transformers import AutoModelForCausalLM
s, short = sys.argv[1], int(sys.argv[2])
m = json.load(open(f"runs/{s}/metrics/pretrain.json"))
model = AutoModelForCausalLM.from_pretrained(f"runs/{s}/models/pretrain")
n = sum(p.numel() for p in model.parameters())
ok = m["resumed_from_step"] == short and m["steps"] == short + 10 and m["strategy"] == s and n == m["num_parameters"]
print(f"{s}: world size {m['world_size']}, resumed from step {m['resumed_from_step']} to {m['steps']}, "
      f"{m['tokens_per_s']:,.0f} tokens/s, eval loss {m['eval_loss']:.3f}, consolidated model loads "
      f"({n / 1e6:.1f} M parameters): {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF
}
if wants fsdp; then check_sharded fsdp "" || status=1; fi
if wants deepspeed; then check_sharded deepspeed ", deepspeed: {zero_stage: 3}" || status=1; fi

# 4. LoRA sft under FSDP: every rank's adapter shard saved, the merge exact.
check_fsdp_lora() {
  "$PY" - <<'EOF'
import pathlib, yaml
from llmpipe.config import load_params
from llmpipe.models import build_model, load_tokenizer, save_model
raw = yaml.safe_load(open("params.yaml"))
raw.update(paths={"output_root": "runs/fsdp_lora"}, distributed={"strategy": "fsdp", "num_processes": "auto"})
raw["sft"] = {"max_steps": 10, "save_steps": 5, "eval_steps": 10, "logging_steps": 5, "warmup_steps": 1,
              "max_length": 256, "precision": "fp32",
              "peft": {"method": "lora", "r": 8, "target_modules": "all-linear"}}
yaml.safe_dump(raw, open("params-fsdp_lora.yaml", "w"))
if not pathlib.Path("models/pretrain/config.json").exists():  # part 1 not run: a random base of the same shape
    params = load_params("params-fsdp_lora.yaml")
    tok = load_tokenizer(params.paths.tokenizer)
    save_model(build_model(params.model, tok), tok, "models/pretrain")
EOF
  part fsdp_lora_sft 300 "$PY" -m llmpipe.cli --task sft --config-path params-fsdp_lora.yaml || {
    ((TINY)) && grep -q "needs CUDA GPUs" "$OUT_DIR/fsdp_lora_sft.log" && say "fsdp_lora: refused without a GPU (--tiny)" && return 0
    return 1
  }
  "$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys, torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from llmpipe.config import load_params
from llmpipe.train.adapters import peft_config
out = "runs/fsdp_lora/models/sft"
m = json.load(open("runs/fsdp_lora/metrics/sft.json"))
cfg = load_params("params-fsdp_lora.yaml").sft.peft
fresh = get_peft_model(AutoModelForCausalLM.from_pretrained("models/pretrain"), peft_config(cfg, "CAUSAL_LM", 10))
want = {n.replace(".default", ""): tuple(p.shape) for n, p in fresh.named_parameters() if p.requires_grad}
saved = load_file(f"{out}/adapter/adapter_model.safetensors")
got = {n: tuple(t.shape) for n, t in saved.items()}
whole = got == want and all(bool(t.abs().sum() > 0) for n, t in saved.items() if "lora_B" in n)
base = AutoModelForCausalLM.from_pretrained("models/pretrain")
with_adapter = PeftModel.from_pretrained(base, f"{out}/adapter").eval()
merged = AutoModelForCausalLM.from_pretrained(out).eval()
ids = torch.randint(0, merged.config.vocab_size, (2, 32))
with torch.no_grad():
    diff = (merged(ids).logits - with_adapter(ids).logits).abs().max().item()
ok = whole and diff < 1e-4
print(f"fsdp_lora: world size {m['world_size']}, {len(saved)} adapter tensors saved of {len(want)} expected, "
      f"all whole and trained: {whole}; merged vs base+adapter logits max |diff| {diff:.2e}: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF
}
if wants fsdp_lora; then check_fsdp_lora || status=1; fi

say "== gpu_check: $( ((status == 0)) && echo PASS || echo FAIL)"
exit $status
